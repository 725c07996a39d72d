"""The live session: ``trace(**options)`` installs the modes and hooks, restores them, builds the Trace.

Order on entry: module hooks, then the function mode (outer), then the
dispatch mode (inner). On exit everything is undone in reverse before any
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
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Literal, Mapping, Optional, Type

import torch

from ..errors import TraceActiveError
from ..modes.context import NativeRecordingContext, RecordingContext, first_line_message
from ..modes.frames import exc_mark, seen_exc
from ..modes.source import is_internal_file
from ..options import DisplayOptions, RunContext, TraceOptions, resolve
from .history import _remember
from .recorder import Recorder

if TYPE_CHECKING:
    import pyarrow as pa

    from .._trace import Trace
    from ..metadata import TraceMetadata
    from ..timing.kernels import KernelCollector
    from .collectives import CollectiveProbe
    from .engines import EngineChoice, OpHook, OpHooks
    from .ranks import DistContext

_local = threading.local()
_warned_tracer_bug = False


def active_session() -> Optional[Session]:
    return getattr(_local, "session", None)


class Session:
    """One trace's lifecycle: options, probes, start/stop, build, dataset, history. Holds no tensor.

    What the modes, the trackers and the engine read and write while it records is its
    recording context, ``self.ctx`` (``modes/context.py``): they are handed that, never the
    session, and the session reads those fields back from it (one owner per field)."""

    def __init__(self, options: TraceOptions, *, cell: Optional[int] = None, cell_source: Optional[str] = None,
                 keep_history: bool = False, origin: str = "api", engine: Optional[EngineChoice] = None) -> None:
        from .engines import EngineChoice, OpHooks, make_engine

        self.engine_choice = engine or EngineChoice("python", "engine='python' was asked for")
        self.engine = make_engine(self.engine_choice)

        self.options = options
        self.cell = cell
        self.cell_source = cell_source
        self.keep_history = keep_history
        self.origin = origin   # RunContext.origin
        #: what the modes, the trackers and the engine read and write while recording (modes/context.py);
        #: the session hands this, never itself, to them
        self.ctx = self._context(Recorder(options.chunk_rows, options.spill_rows, options.spill_dir), OpHooks())
        # multi-rank: collectives table, rank identity / run id / clock (recording/collectives.py, ranks.py)
        from .collectives import NAMESPACES as COLLECTIVE_NAMESPACES
        from .collectives import CollectiveProbe
        from .ranks import DistContext

        self.dist = DistContext(sync_clocks=options.sync_clocks)
        self.collectives = CollectiveProbe(on_first=_first_collective(self.ctx, self.dist))
        # both engines hand c10d / _c10d_functional ops to the op hooks (engines.OpHooks)
        self.ctx.op_hooks.add(COLLECTIVE_NAMESPACES, _collective_hook(self.collectives))
        self.dataset_error: Optional[BaseException] = None
        self._ds: Optional[Dict[str, Any]] = None   # dataset= parts written while recording: {"ident", "trace_id", "ops_written"}
        if options.dataset:
            # weakly: the recorder is reachable from the modes, which hold no reference to the session
            self.ctx.rec.on_spill = _weak_call(self._spill_to_dataset)
        self.kernels: Optional[KernelCollector] = None
        self.compile_capture: Any = None   # torch.compile artifacts (recording/compiled.py)
        self.deferred_kernels = False   # always-on cells: link kernels at the next harvest, not per cell
        self.wall_ns = 0
        self.trace: Optional[Trace] = None
        self._fmode: Any = None   # the function mode (python or native)
        self._warn_token: Any = None
        self._entered: List[str] = []

    def _context(self, rec: Recorder, op_hooks: OpHooks) -> RecordingContext:
        opts = self.options
        return RecordingContext(rec, op_hooks, want_source=opts.source, want_modules=opts.modules,
                                track_storages=opts.storages)

    def _function_mode(self) -> Any:
        from ..modes.function import TracingFunctionMode

        return TracingFunctionMode(self.ctx)

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
            self.dist.capture()   # before any mode: a clock ping-pong here is seen by no one
            self._setup_probes()
            self._begin_cell_warnings()
        self._fmode = self._function_mode()
        _local.session = self
        self.ctx.t0 = time.perf_counter_ns()
        self.dist.set_anchor(self.ctx.t0)
        try:
            if opts.modules:
                self.ctx.modules.install()
                self._entered.append("modules")
            self._fmode.__enter__()
            self._entered.append("function")
            self.engine.start(self)
            self._entered.append("engine")
        except BaseException:
            self._restore()
            raise
        self.ctx.recording = True

    def _setup_probes(self) -> None:
        opts = self.options
        try:
            from .. import native

            self.ctx.capture = native.open_capture(native=opts.native, cpp_errors=opts.cpp_errors)
        except Exception as e:
            self.ctx.capture = None
            self.ctx.rec.notes.append(f"warning/error capture unavailable: {type(e).__name__}: {e}")
        if opts.nonfinite and self.engine.name == "python":
            try:
                from ..modes.numerics import NonfiniteScreen

                self.ctx.screen = NonfiniteScreen()
            except Exception as e:
                self.ctx.rec.notes.append(f"non-finite screen unavailable: {e}")
        if opts.numerics:
            from ..modes.numerics import NumericsShadow

            self.ctx.shadow = NumericsShadow(mode=opts.numerics)
        if opts.nonfinite and self.engine.name == "native":
            self.ctx.screen = True   # the native engine screens; replaced by its counters at finish
        if opts.cuda_timing and torch.cuda.is_available() and self.engine.name == "python":
            try:
                from ..timing.cuda import CudaOpTimer

                self.ctx.cuda_timer = CudaOpTimer()
            except Exception as e:
                self.ctx.rec.notes.append(f"CUDA timing unavailable: {e}")
        try:
            from .compiled import CompileCapture

            self.compile_capture = CompileCapture().install()
        except Exception as e:
            self.compile_capture = None
            self.ctx.rec.notes.append(f"torch.compile capture unavailable: {e}")
        if opts.kernels:
            try:
                from ..timing.kernels import KernelCollector

                self.kernels = KernelCollector.shared()
                self.kernels.begin_window()
            except Exception as e:
                self.kernels = None
                self.ctx.rec.notes.append(f"kernel collection unavailable: {e}")

    def _restore(self) -> None:
        """Undo modes and hooks, innermost first. Safe to call twice."""
        self.ctx.recording = False
        errors: List[BaseException] = []
        if "engine" in self._entered:
            try:
                self.engine.stop(self)
            except BaseException as e:
                errors.append(e)
        if "function" in self._entered:
            try:
                from torch.overrides import _get_current_function_mode_stack

                from .engines import exit_mode

                exit_mode(self._fmode, _get_current_function_mode_stack)
            except BaseException as e:
                errors.append(e)
        if "modules" in self._entered:
            self.ctx.modules.remove()
        self._entered = []
        # the storage tracker stays open until the tables are built (free_seq of late frees): stop() closes it
        if getattr(_local, "session", None) is self:
            _local.session = None
        if self.compile_capture is not None:
            try:
                self.compile_capture.close()
            except Exception as e:
                errors.append(e)
        if self.ctx.capture is not None:
            try:
                self.ctx.capture.close()
            except Exception as e:
                errors.append(e)
        for err in errors:
            self.ctx.rec.tracer_error("restore", err)

    def stop(self, exc: Optional[BaseException] = None) -> Trace:
        """Stop recording, restore global state, build and return the Trace.

        Everything it runs (the leak finder reading tensors' storages and ``.grad``, the device
        description, the build) runs with ``__torch_function__`` disabled: a user's TorchFunctionMode
        around the trace sees none of it, nor does a tensor subclass's handler."""
        with torch._C.DisableTorchFunction():
            return self._stop(exc)

    def _stop(self, exc: Optional[BaseException]) -> Trace:
        end = time.perf_counter_ns()
        self.wall_ns = end - self.ctx.t0 if self.ctx.t0 else 0
        self.ctx.recording = False
        self._end_cell_warnings()
        self._restore()
        if exc is not None:
            self._note_cell_exception(exc)
        try:
            self.dist.capture(end=True)
        except Exception as e:
            self.ctx.rec.tracer_error("distributed capture", e)
        from .build import build_trace

        try:
            try:
                self.engine.finish(self)
            except Exception as e:
                self.ctx.rec.tracer_error("engine finish", e)
                if self.ctx.screen is True:
                    self.ctx.screen = None
            others = [th for th in threading.enumerate() if th is not threading.current_thread() and not th.daemon]
            if others:
                self.ctx.rec.notes.append(
                    f"{len(others)} other Python thread(s) were running ({', '.join(th.name for th in others[:3])}): "
                    "ops they ran are not recorded (a trace records its own thread and autograd's workers)")
            for msg in self.ctx.op_hooks.errors:
                self.ctx.rec.tracer_error("op hook", RuntimeError(msg))
            self.trace = build_trace(self)
            _note_cell_files(self.trace, self.ctx.rec)
            self.trace._amend(compiled_ops=self.ctx.compiled_ops, origin=self.origin)
        finally:
            if self.ctx.tracker is not None:
                self.ctx.tracker.close()
            self.ctx.rec.close()
        self._write_dataset()
        _remember(self.trace, self.keep_history)
        _warn_tracer_bugs(self.trace)
        return self.trace

    def _spill_to_dataset(self) -> None:
        """The recorder spilled: write the spilled ops rows as parts now (readable while the trace
        runs). Rank and run id are fixed for this trace from here on."""
        from ..io.dataset import reserve_trace_id, write_table_parts
        from .build import decode_ops_from

        assert self.options.dataset is not None   # on_spill is set only with dataset=
        if self._ds is None:
            ident = self.dist.resolve()
            self._ds = {"ident": ident, "trace_id": reserve_trace_id(self.options.dataset, ident), "ops_written": 0,
                        "metadata": self._early_metadata(ident)}
        ds = self._ds
        was, self.ctx.recording = self.ctx.recording, False   # nothing here may be recorded
        try:
            for batch in decode_ops_from(self, ds["ops_written"]):
                write_table_parts(self.options.dataset, "ops", ds["ident"], ds["trace_id"], pa_table(batch),
                                  metadata=ds["metadata"])
                ds["ops_written"] += batch.num_rows
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

    def _write_dataset(self) -> None:
        """``dataset=DIR``: this rank's tables into the multi-rank dataset (io/dataset.py)."""
        try:
            assert self.trace is not None   # stop() built it
            ident = self._ds["ident"] if self._ds is not None else self.dist.resolve()
            md = self.trace.metadata
            self.trace._amend(distributed={**ident, "clock": self.dist.clock, "clock_end": self.dist.clock_end,
                                           "anchor_unix_ns": self.dist.anchor_unix_ns},
                              notes=md.notes + tuple(self.dist.notes))
        except Exception as e:   # describing the rank must never break the trace
            if not self.options.dataset:
                return
            self.dataset_error = e
            return
        if not self.options.dataset:
            return
        from ..io.dataset import write_trace

        try:
            early = self._ds or {}
            where = write_trace(self.trace, self.options.dataset, ident=ident, dist=self.dist,
                                trace_id=early.get("trace_id"), ops_written=early.get("ops_written", 0))
            self.trace._amend(dataset=where)
        except Exception as e:   # the trace is kept (tensorscope.last()); trace.__exit__ reports it
            self.dataset_error = e

    def _note_cell_exception(self, exc: BaseException) -> None:
        """An exception that left the traced block: recorded once (modes may have seen it already)."""
        if seen_exc(self.ctx.last_exc_key, exc):
            return
        from ..modes.source import user_traceback_location

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


def _note_cell_files(t: Trace, rec: Recorder) -> None:
    """Which source files are notebook cells, and their numbers (``Cell In[3], line 11``)."""
    try:
        from .._location import cell_files_for

        files = [v[0] for v in rec.sources.values if v is not None]
        files += [r.get("source_file") for r in rec.errors]
        cells = cell_files_for(files)
        if cells:
            t._amend(cell_files=cells)
    except Exception as e:
        rec.tracer_error("cell files", e)


def _first_collective(ctx: RecordingContext, dist: DistContext) -> Callable[[], None]:
    """The collectives probe's ``on_first``: the process group exists now (the trace may have started
    before init_process_group), so the rank identity is captured again, unrecorded."""
    def on_first() -> None:
        was, ctx.recording = ctx.recording, False
        try:
            dist.capture()
        except Exception as e:
            ctx.rec.tracer_error("distributed capture", e)
        finally:
            ctx.recording = was
    return on_first


def _collective_hook(probe: CollectiveProbe) -> OpHook:
    """Op hook: a c10d op just returned (outputs None when it raised); its start and duration come
    from its ops row when the tables are built."""
    def on_collective(seq: int, op: str, inputs: Any, outputs: Any) -> None:
        probe.observe(seq, op, inputs, None, outputs if outputs is not None else (), None, None)
    return on_collective


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


def _report_dataset_error(e: BaseException, raise_: bool) -> None:
    """A failed dataset write: ExportError after the block (the trace is kept: tensorscope.last()),
    or a warning when the block already raised (the user's exception comes first)."""
    from ..errors import ExportError

    err = e if isinstance(e, ExportError) else ExportError(
        f"could not write the trace into the dataset: {type(e).__name__}: {e} "
        "(the trace is still in memory: tensorscope.last())")
    if raise_:
        raise err
    warnings.warn(str(err), RuntimeWarning, stacklevel=3)


class NativeSession(Session):
    """The session when the native engine observes the ops: its context is a
    ``NativeRecordingContext`` (what the modes set is forwarded to the observer), and the
    function mode is the C one when it can be (``modes/function.py`` NativeFunctionMode)."""

    ctx: NativeRecordingContext

    def _context(self, rec: Recorder, op_hooks: OpHooks) -> NativeRecordingContext:
        from .engines import NativeEngine

        assert isinstance(self.engine, NativeEngine)   # new_session pairs this class with the native engine
        opts = self.options
        return NativeRecordingContext(rec, op_hooks, self.engine, want_source=opts.source, want_modules=opts.modules,
                                      track_storages=opts.storages)

    # -- the function mode in C (modes/function.py NativeFunctionMode; fnmode) ----------------------
    def _function_mode(self) -> Any:
        from .. import native
        from ..modes.function import CALL_DTYPE, NativeFunctionMode

        fm, reason = native.function_mode(CALL_DTYPE.itemsize)
        if fm is not None and not hasattr(self.ctx.ext, "fmode_state"):
            fm, reason = None, "the native engine exports no state for it (fmode_state)"
        if fm is None or fm.active():
            self.ctx.rec.notes.append(f"the function mode runs in Python: {reason if fm is None else 'another trace uses the native one'}")
            return super()._function_mode()
        self.ctx.fmode = fm   # ctx.recording is forwarded to it from here on
        return NativeFunctionMode(self.ctx, fm)

    def _restore(self) -> None:
        super()._restore()
        finish = getattr(self._fmode, "finish", None)
        if finish is not None:   # the native function mode hands its calls rows over (idempotent)
            try:
                finish()
            except Exception as e:
                self.ctx.rec.tracer_error("restore", e)

    def _setup_probes(self) -> None:
        super()._setup_probes()
        cap = self.ctx.capture
        if cap is not None and getattr(cap, "native", False):
            cap.engine = self.engine   # call_end drains the observer's per-op warnings
            try:   # the observer reads the source location of c10 errors its ops raise
                if not cap.arm_error_sites(self.engine) and cap.sites_reason not in ("ok", ""):
                    if not cap.sites_reason.startswith("TORCH_SHOW_CPP_STACKTRACES"):
                        self.ctx.rec.notes.append(f"C++ error locations unavailable: {cap.sites_reason}")
            except Exception as e:
                self.ctx.rec.notes.append(f"C++ error locations unavailable: {type(e).__name__}: {e}")


def new_session(options: TraceOptions, **kw: Any) -> Session:
    """A Session recording with the engine ``options.engine`` selects."""
    from .engines import select_engine

    choice = select_engine(options)
    cls = NativeSession if choice.name == "native" else Session
    return cls(options, engine=choice, **kw)


class trace:
    """Record every torch-level call and ATen op run inside the block.

    ``with tensorscope.trace() as t: ...`` — after the block ``t`` is the
    finished, read-only ``tensorscope.Trace`` (attribute access is
    forwarded to it). ``trace(TraceOptions(...), **keywords)``: the options
    object, keywords, or both (see ``options.py``).
    """

    def __init__(self, options: Optional[TraceOptions] = None, *, context: Optional[RunContext] = None,
                 display: Optional[DisplayOptions] = None, **keywords: Any) -> None:
        """``options``: a ``TraceOptions`` (keywords, when given too, replace its fields);
        ``context``: the ``RunContext`` (cell, source, origin), not an option; ``display``: the
        ``DisplayOptions`` this object's own display uses (``numerics_threshold=`` as a keyword
        works too). An unknown keyword is an ``OptionsError`` before anything runs."""
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

    def __exit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException], tb: Any) -> Literal[False]:
        session = self._session
        assert session is not None   # __enter__ made it
        self._trace = session.stop(ev)
        self._session = None
        if session.dataset_error is not None:
            _report_dataset_error(session.dataset_error, raise_=ev is None)
        if ev is not None:
            from ..modes.frames import clean_traceback

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
