"""The live session: ``trace(**options)`` installs the modes and hooks, restores them, builds the Trace.

Order on entry: the probes (``recording/probes.py``, in list order), module hooks, then the
function mode (outer), then the dispatch mode (inner); on exit the probes stop last, in reverse. On exit everything is undone in reverse before any
table is built, so a failure while building can never leave a mode behind,
and it is undone on exceptions and KeyboardInterrupt alike. Only one trace
records per thread: entering a second raises ``TraceActiveError`` (double
recording would attribute every op twice).
"""
from __future__ import annotations

import dataclasses
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional

import torch

from ..errors import ExportError, TraceActiveError
from ..options import DisplayOptions, RunContext, TraceOptions, resolve
from . import fastpaths
from .columns import _Links
from .context import RecordingContext, first_line_message
from .engines import EngineChoice, exit_mode, make_engine, select_engine
from .frames import exc_mark, seen_exc
from .history import _remember
from .ophooks import OpHooks
from .recorder import Recorder
from .schedstat import longest_wait, thread_delay_ns, threads_delay_ns
from .source import is_internal_file

if TYPE_CHECKING:
    import pyarrow as pa

    from .._trace import Trace
    from ..metadata import TraceMetadata
    from .probes import Probe

_local = threading.local()
_warned_tracer_bug = False


def active_session() -> Optional[Session]:
    return getattr(_local, "session", None)


class Session:
    """One trace's lifecycle: options, probes, start/stop, build, dataset, history. Holds no tensor.

    What the modes, the trackers and the engine read and write while it records is its
    recording context, ``self.ctx`` (``context.py``), made by the engine: they are handed that,
    never the session, and the session reads those fields back from it (one owner per field).
    The session drives the engine through ``engines.Engine`` only: it never asks which one it is."""

    def __init__(self, options: TraceOptions, *, cell: Optional[int] = None, cell_source: Optional[str] = None,
                 keep_history: bool = False, origin: str = "api", engine: Optional[EngineChoice] = None) -> None:
        self.engine_choice = engine or EngineChoice("python", "engine='python' was asked for")
        self.engine = make_engine(self.engine_choice)
        self.engine_choice = self.engine.choice   # the python engine when the observer was taken meanwhile

        self.options = options
        self.cell = cell
        self.cell_source = cell_source
        self.keep_history = keep_history
        self.origin = origin   # RunContext.origin
        #: what the modes, the trackers and the engine read and write while recording (context.py);
        #: the session hands this, never itself, to them
        self.ctx: RecordingContext = self.engine.make_context(
            Recorder(options.chunk_rows, options.spill_rows, options.spill_dir), OpHooks(), options)
        #: backward-to-forward rows, grown as chunks are decoded (dataset= spills, then the end)
        self.links = _Links()
        from .ranks import DistContext

        #: multi-rank: rank identity / run id / clock (recording/ranks.py); the dataset= parts name it
        self.dist = DistContext(sync_clocks=options.sync_clocks)
        self.dataset_error: Optional[BaseException] = None
        self._ds: Optional[dict[str, Any]] = None   # dataset= parts written while recording: {"ident", "trace_id", "ops_written"}
        if options.dataset:
            # weakly: the recorder is reachable from the modes, which hold no reference to the session
            self.ctx.rec.on_spill = _weak_call(self._spill_to_dataset)
        #: what records beside the engine (recording/probes.py), in start order: made at start
        self.probes: list[Probe] = []
        self._probes_stopped = False
        self.deferred_kernels = False   # always-on cells: link kernels at the next harvest, not per cell
        self.wall_ns = 0
        self.trace: Optional[Trace] = None
        self._fmode: Any = None   # the function mode (python or native)
        self._warn_token: Any = None
        self._entered: list[str] = []
        self._ident: dict[str, Any] = {}

    def _begin_cell_warnings(self) -> None:
        """Collect every warning shown while tracing that no torch-level call claims: a plain
        ``warnings.warn`` in user code, a C++ warning shown after its call returned (handed to the
        outer binding) or raised by a pass-through getter."""
        self._warn_token = None
        cap = self.ctx.capture
        if cap is not None:
            try:
                self._warn_token = cap.call_begin(None)
            except Exception as e:
                self.ctx.rec.tracer_error("warnings (begin)", e)

    def _end_cell_warnings(self) -> None:
        tok, self._warn_token = getattr(self, "_warn_token", None), None
        cap = self.ctx.capture
        if tok is None or cap is None:
            return
        try:
            ws = cap.call_end(tok)
        except Exception as e:
            self.ctx.rec.tracer_error("warnings (end)", e)
            return
        if not ws:
            return
        from collections import Counter

        # a C++ warning the native hooks recorded at its op is shown by Python later: not twice
        native = Counter(r.get("message") for r in self.ctx.rec.errors if r.get("kind") == "warning" and r.get("native"))
        for w in ws:
            msg = w.get("message")
            if w.get("cpp_file") is not None and native.get(msg):
                native[msg] -= 1
                continue
            file, line = w.get("filename"), w.get("lineno")
            if file is not None and (w.get("verbatim") or is_internal_file(file)):
                file = line = None   # shown at a C++ or library location: no user line to name
            self.ctx.rec.add_error(
                kind="warning", py_type=w.get("category") or "UserWarning", cpp_type=None, message=msg,
                cpp_file=w.get("cpp_file"), cpp_line=w.get("cpp_line"), cpp_function=w.get("cpp_function"),
                seq=None, call_id=None, op=None, source_file=file, source_line=line,
                native=bool(w.get("native", False)), count=1)

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        if active_session() is not None:
            raise TraceActiveError(
                "a tensorscope trace is already recording on this thread; nested traces would record every op "
                "twice. Exit the outer trace first (or use %tensorscope off).")
        opts = self.options
        with torch._C.DisableTorchFunction():   # what tensorscope reads is no call of the program's (README: user modes)
            _warm_up()
            self._start_probes()
            self._begin_cell_warnings()
        self._fmode = self.engine.function_mode(self.ctx)
        _local.session = self
        self.ctx.t0 = time.perf_counter_ns()
        self._run_delay0, self._threads0 = thread_delay_ns(), threads_delay_ns()
        self.dist.set_anchor(self.ctx.t0)
        try:
            if opts.modules:
                self.ctx.modules.install()
                self._entered.append("modules")
            self._fmode.__enter__()
            self._entered.append("function")
            fastpaths.install(self._fmode)   # torch's fast paths answer as in eager (recording/fastpaths.py)
            self.engine.start(self.ctx, opts)
            self._entered.append("engine")
        except BaseException:
            self._restore()
            raise
        self.ctx.recording = True

    def _start_probes(self) -> None:
        """Make the trace's probes (``probes.make_probes``: dist first, the allocator last) and
        start them in order; one that raises is counted and stays in the list (its stop and its
        contribution are contained too)."""
        from .probes import make_probes

        self.probes = make_probes(self.options, self.engine, self.dist, deferred_kernels=self.deferred_kernels)
        for p in self.probes:
            try:
                p.start(self.ctx)
            except Exception as e:
                self.ctx.rec.tracer_error(f"{p.name} (start)", e)

    def _restore(self) -> None:
        """Undo modes and hooks, innermost first. Safe to call twice."""
        self.ctx.recording = False
        errors: list[BaseException] = []
        try:   # also when it never started: it gives the native observer back (idempotent)
            self.engine.stop()
        except BaseException as e:
            errors.append(e)
        if "function" in self._entered:
            fastpaths.remove(self._fmode)
            try:
                from torch.overrides import _get_current_function_mode_stack

                exit_mode(self._fmode, _get_current_function_mode_stack)
            except BaseException as e:
                errors.append(e)
        if "modules" in self._entered:
            self.ctx.modules.remove()
        self._entered = []
        # the storage tracker stays open until the tables are built (free_seq of late frees): stop() closes it
        if getattr(_local, "session", None) is self:
            _local.session = None
        finish = getattr(self._fmode, "finish", None)
        if finish is not None:   # the native function mode hands its calls rows over (idempotent)
            try:
                finish()
            except Exception as e:
                errors.append(e)
        # the probes, last started first (the allocator's snapshot before its history is turned off,
        # an OOM in the block included; the capture closed; the rank's clock read again)
        if not self._probes_stopped:
            self._probes_stopped = True
            for p in reversed(self.probes):
                try:
                    p.stop()
                except BaseException as e:
                    errors.append(e)
        for err in errors:
            self.ctx.rec.tracer_error("restore", err)

    def stop(self, exc: Optional[BaseException] = None) -> Trace:
        """Stop recording, restore global state, build and return the Trace.

        Everything it runs (the leak finder reading tensors' storages and ``.grad``, the device
        description, the build) runs with ``__torch_function__`` disabled: a user's TorchFunctionMode
        around the trace sees none of it, nor does a tensor subclass's handler."""
        with torch._C.DisableTorchFunction():
            try:
                return self._stop(exc)
            finally:   # the context holds the engine: without this cut, the recording waited for a collection
                self.engine.release()   # (docs/development/architecture.md; never raises)

    def _stop(self, exc: Optional[BaseException]) -> Trace:
        end = time.perf_counter_ns()
        self.wall_ns = end - self.ctx.t0 if self.ctx.t0 else 0
        rd1, rd0 = thread_delay_ns(), getattr(self, "_run_delay0", None)
        self.run_delay = rd1 - rd0 if (rd1 is not None and rd0 is not None) else None
        self.worker_delay = longest_wait(getattr(self, "_threads0", None), threads_delay_ns())
        self.ctx.recording = False
        self._end_cell_warnings()
        self._restore()
        if exc is not None:
            self._note_cell_exception(exc)
        from .finish import finish_tables, metadata

        try:
            try:
                self.engine.finish(self.ctx)
            except Exception as e:
                self.ctx.rec.tracer_error("engine finish", e)
                self.ctx.screen = None   # an engine that did not finish left no screen verdicts
            others = [th for th in threading.enumerate() if th is not threading.current_thread() and not th.daemon]
            if others:
                self.ctx.rec.notes.append(
                    f"{len(others)} other Python thread(s) were running ({', '.join(th.name for th in others[:3])}): "
                    "ops they ran are not recorded (a trace records its own thread and autograd's workers)")
            for msg in self.ctx.op_hooks.errors:
                self.ctx.rec.tracer_error("op hook", RuntimeError(msg))
            tables, ops_file, notes = finish_tables(self)
            md = metadata(self, tables["ops"].num_rows, notes, **self._distributed(),
                          **({"run_delay_ns": self.run_delay} if getattr(self, "run_delay", None) is not None else {}),
                          **({"worker_run_delay_ns": self.worker_delay} if self.worker_delay is not None else {}))
        finally:
            if self.ctx.tracker is not None:
                self.ctx.tracker.close()
            self.ctx.rec.close()
        self.trace = self._complete(tables, md, ops_file)
        _remember(self.trace, self.keep_history)
        _warn_tracer_bugs(self.trace)
        return self.trace

    def _spill_to_dataset(self) -> None:
        """The recorder spilled: write the spilled ops rows as parts now (readable while the trace
        runs). Rank and run id are fixed for this trace from here on."""
        from ..io.dataset import reserve_trace_id, write_table_parts
        from .decode import decode_ops_from

        assert self.options.dataset is not None   # on_spill is set only with dataset=
        if self.dataset_error is not None:
            return   # a write failed (a full disk...): nothing more is written; trace.__exit__ reports it
        was, self.ctx.recording = self.ctx.recording, False   # nothing here may be recorded
        try:
            if self._ds is None:
                ident = self.dist.resolve()
                self._ds = {"ident": ident, "trace_id": reserve_trace_id(self.options.dataset, ident),
                            "ops_written": 0, "metadata": self._early_metadata(ident)}
            ds = self._ds
            for batch in decode_ops_from(self.ctx.rec, ds["ops_written"], cell=self.cell, screen=self.ctx.screen,
                                         links=self.links):
                write_table_parts(self.options.dataset, "ops", ds["ident"], ds["trace_id"], pa_table(batch),
                                  metadata=ds["metadata"])
                ds["ops_written"] += batch.num_rows
        except ExportError as e:   # the dataset's disk, not tensorscope: the trace is kept whole in memory
            self.dataset_error = e
        finally:
            self.ctx.recording = was

    def _early_metadata(self, ident: Mapping[str, Any]) -> TraceMetadata:
        """What the trace's metadata holds before the trace ends (for parts written while it records)."""
        import platform

        from .._version import __version__
        from ..metadata import TraceMetadata

        return TraceMetadata(tensorscope_version=__version__, torch_version=torch.__version__,
                             python_version=platform.python_version(), options=self.options.for_record(),
                             cell=self.cell, cell_source=self.cell_source, origin=self.origin,
                             engine=self.engine_choice.name, engine_reason=self.engine_choice.reason,
                             distributed=dict(ident),
                             notes=("written while the trace was recording: counts and notes are in the ranks "
                                    "row's metadata_json",))

    def _distributed(self) -> dict[str, Any]:
        """The rank identity and clock alignment for the metadata (``distributed``, with the notes
        the distributed context made); nothing when it cannot be described."""
        try:
            ident = self._ds["ident"] if self._ds is not None else self.dist.resolve()
            self._ident = ident
            return {"distributed": {**ident, "clock": self.dist.clock, "clock_end": self.dist.clock_end,
                                    "anchor_unix_ns": self.dist.anchor_unix_ns},
                    "dist_notes": tuple(self.dist.notes)}
        except Exception as e:   # describing the rank must never break the trace
            if self.options.dataset:
                self.dataset_error = e
            return {}

    def _complete(self, tables: dict[str, Any], md: dict[str, Any], ops_file: Optional[str]) -> Trace:
        """The finished Trace, built whole: with ``dataset=DIR`` this rank's tables are written into
        the multi-rank dataset first (io/dataset.py), and the Trace says where they went."""
        from .._trace import Trace

        dist_notes = md.pop("dist_notes", ())
        md["notes"] = list(md["notes"]) + list(dist_notes)
        from .. import schema as S

        kernels = tables.pop("kernels", None)
        if kernels is None:   # the kernels probe contributed nothing (it failed): an empty table
            kernels = S.empty("kernels")
        resolver = getattr(kernels, "resolve", None)   # a pending table, not a pa.Table: always-on cells link later
        if resolver is None:
            tables["kernels"] = kernels
        if not self.options.dataset or self.dataset_error is not None:
            return Trace(tables, md, kernels=resolver, _spill_file=ops_file)
        from ..io.dataset import write_trace

        written = Trace(tables, md, kernels=resolver)   # what is written; the result says where it went
        try:
            early = self._ds or {}
            where = write_trace(written, self.options.dataset, ident=self._ident, dist=self.dist,
                                trace_id=early.get("trace_id"), ops_written=early.get("ops_written", 0))
        except Exception as e:   # the trace is kept (tensorscope.last()); trace.__exit__ reports it
            self.dataset_error = e
            where = None
        return Trace(written.tables, written.metadata.replace(dataset=where) if where else written.metadata,
                     _spill_file=ops_file)

    def _note_cell_exception(self, exc: BaseException) -> None:
        """An exception that left the traced block: recorded once (modes may have seen it already)."""
        if seen_exc(self.ctx.last_exc_key, exc):
            return
        from .source import user_traceback_location

        file, line = user_traceback_location(exc.__traceback__)
        self.ctx.last_error_id = self.ctx.rec.add_error(
            kind="exception", py_type=type(exc).__name__, cpp_type=None, message=first_line_message(exc),
            cpp_file=None, cpp_line=None, cpp_function=None, seq=None, call_id=None, op=None,
            source_file=file, source_line=line, native=False, count=1)
        self.ctx.last_exc_key = exc_mark(exc, None)


_warmed = False


def _warm_up() -> None:
    """One-time imports the first dispatch would trigger (torch._dynamo: seconds), kept out of the timings."""
    global _warmed
    if _warmed:
        return
    _warmed = True
    try:
        import torch._dynamo  # every mode's __torch_dispatch__ runs under a dynamo-disable wrapper
        import torch.utils.flop_counter  # noqa: F401
    except Exception:
        pass


def _weak_call(method: Callable[[], None]) -> Callable[[], None]:
    """``method()`` through a weak reference to its object (nothing when it is gone)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        m = ref()
        if m is not None:
            m()
    return call


def _warn_tracer_bugs(t: Trace) -> None:
    global _warned_tracer_bug
    n = t.metadata.get("tracer_errors", 0)
    if n and not _warned_tracer_bug:
        _warned_tracer_bug = True
        first = (t.metadata.get("tracer_error_messages") or ["?"])[0]
        warnings.warn(f"tensorscope: {n} internal error(s) while tracing were contained (first: {first}); "
                      "the program ran unchanged but the trace may be incomplete. Please report this.",
                      RuntimeWarning, stacklevel=3)


def raise_for_guards(t: Trace, baseline: Optional[Trace] = None) -> None:
    """Cell guards (``expect=``, ``max_casts=``, ``baseline=``): raise GuardError after the block, trace kept."""
    opts = t.metadata.options
    if not (opts.expect or opts.max_casts is not None or baseline is not None):
        return
    from ..analyses.guards import check_guards
    from ..errors import GuardError

    failures = check_guards(t)
    if baseline is not None:
        from .._diff import diff

        found = diff(baseline, t).regressions(time=opts.baseline_time, memory=opts.baseline_memory)
        failures += [f"{f} against the baseline (tensorscope.diff(baseline, trace) shows where)" for f in found]
    if failures:
        raise GuardError("tensorscope guard failed:\n" + "\n".join(f"  - {f}" for f in failures), t, failures)


def pa_table(batch: pa.RecordBatch) -> pa.Table:
    import pyarrow as pa

    return pa.Table.from_batches([batch])


def _exit_errors(session: Session, t: Optional[Trace]) -> list[BaseException]:
    """What went wrong writing the trace's files while it recorded or finished, each a
    TensorscopeError: a failed dataset write first (``ExportError``: the dataset lacks the trace),
    then a failed spill (``SpillError``, carrying the trace: the rows were kept in memory, nothing
    was lost)."""
    out: list[BaseException] = []
    e = session.dataset_error
    if e is not None:
        out.append(e if isinstance(e, ExportError) else ExportError(
            f"could not write the trace into the dataset: {type(e).__name__}: {e} "
            "(the trace is still in memory: tensorscope.last())"))
    spill = session.ctx.rec.spill_failed
    if spill is not None:
        spill.trace = t
        out.append(spill)
    return out


def _report_exit_errors(errors: list[BaseException], raise_: bool) -> None:
    """Failed writes (``_exit_errors``): the first raised after the block (the trace is kept:
    tensorscope.last(), ``err.trace``), the others warned; all warned when the block already raised
    (the user's exception comes first and is untouched)."""
    if not errors:
        return
    first = errors[0] if raise_ else None
    for e in errors:
        if e is not first:
            warnings.warn(str(e), RuntimeWarning, stacklevel=3)
    if first is not None:
        first.__traceback__ = None   # point at the with-statement, not into tensorscope
        raise first


def new_session(options: TraceOptions, **kw: Any) -> Session:
    """A Session recording with the engine ``options.engine`` selects."""
    return Session(options, engine=select_engine(options), **kw)


class trace:
    """Record every torch-level call and ATen op run inside a ``with`` block.

    The block runs exactly as it would untraced (same outputs, exceptions and warnings). When it
    ends, the context manager holds the finished, read-only :class:`tensorscope.Trace` and forwards
    attribute access to it, so ``t.ops``, ``t.sql(...)`` and ``t.summary()`` work on the ``as``
    target. Traces do not nest.

    Parameters
    ----------
    options : TraceOptions, optional
        What to record. Keywords given too replace its fields.
    context : RunContext, optional
        Where the trace runs (cell number, cell source, origin) and whether it joins
        :func:`tensorscope.history`; the magics and the CLI fill it in.
    display : DisplayOptions, optional
        How this object's own display shows the trace (``numerics_threshold``).
    **keywords
        Any field of :class:`TraceOptions` (``modules=False``, ``expect="no_leaks"``,
        ``dataset="runs/ds"``, ...) or of :class:`DisplayOptions`.

    Raises
    ------
    OptionsError
        An unknown keyword or a value of the wrong kind, before anything runs.
    TraceActiveError
        Another trace is already recording on this thread.
    GuardError
        After the block, when a guard (``expect=``, ``max_casts=``, ``baseline=``) failed; the
        trace is kept in ``err.trace``.
    SpillError
        After the block, when spilled rows could not be written to ``spill_dir`` (a full disk):
        nothing was lost, the whole trace is in ``err.trace`` (a warning instead when the block
        raised: its exception comes first).

    See Also
    --------
    tensorscope.Trace : the result.
    tensorscope.schedule : one trace per window of a training loop.

    Examples
    --------
    >>> import torch, tensorscope
    >>> model = torch.nn.Linear(4, 2)
    >>> with tensorscope.trace(leaks=False) as t:
    ...     loss = model(torch.randn(3, 4)).sum()
    ...     loss.backward()
    >>> t.ops.num_rows > 0
    True
    >>> bool(t.sql("select count(*) as n from ops where phase = 'backward'")["n"][0] > 0)
    True
    """

    def __init__(self, options: Optional[TraceOptions] = None, *, context: Optional[RunContext] = None,
                 display: Optional[DisplayOptions] = None, **keywords: Any) -> None:
        """Resolve and validate the options; nothing is recorded until the block is entered."""
        opts, disp = resolve(options, display, keywords)
        if opts.baseline is not None:
            from .._diff import as_trace

            opts = dataclasses.replace(opts, baseline=as_trace(opts.baseline))   # a bad baseline fails before anything runs
        self.options = opts
        self.display = disp
        self.context = context if context is not None else RunContext()
        self._session: Optional[Session] = None
        self._trace: Optional[Trace] = None

    def __enter__(self) -> trace:
        ctx = self.context
        self._session = new_session(self.options, cell=ctx.cell, cell_source=ctx.cell_source,
                                    keep_history=ctx.keep_history, origin=ctx.origin)
        self._session.deferred_kernels = ctx.deferred_kernels
        self._session.start()
        return self

    def __exit__(self, et: Optional[type[BaseException]], ev: Optional[BaseException], tb: Any) -> Literal[False]:
        session = self._session
        assert session is not None   # __enter__ made it
        self._trace = session.stop(ev)
        self._session = None
        errors = _exit_errors(session, self._trace)
        spilled = session.ctx.rec.n_spilled
        del session
        if spilled:   # the recording's buffers are gone with the session: give their memory back now
            from .spilled import release_memory

            release_memory()
        _report_exit_errors(errors, raise_=ev is None)
        if ev is not None:
            from .frames import clean_traceback

            clean_traceback(ev)   # the with-statement re-raises ev: its traceback as untraced
            return False
        try:
            raise_for_guards(self._trace, baseline=self.options.baseline)
        except BaseException as g:
            g.__traceback__ = None   # point at the with-statement, not into tensorscope
            raise
        return False

    @property
    def result(self) -> Trace:
        if self._trace is None:
            raise AttributeError("the trace is still recording; its tables exist once the with-block exits")
        return self._trace

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.result, name)

    def __repr__(self) -> str:
        return repr(self._trace) if self._trace is not None else "<tensorscope.trace (recording)>"

    def summary(self, display: Optional[DisplayOptions] = None) -> Any:
        """The finished trace's summary, shown with ``display`` (default: this trace()'s display options)."""
        return self.result.summary(display if display is not None else self.display)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        return self.summary()._repr_mimebundle_(include, exclude)

