"""The probes: everything that records beside the engine, behind one seam (:class:`Probe`).

A probe lives through three calls, made by the session (``recording/session.py``) and by finishing
(``recording/finish.py``), never by anything else::

    probe.start(ctx)               # before the engine observes, in list order, under DisableTorchFunction
    probe.stop()                   # after the engine and the modes are out, in reverse order; idempotent,
                                   # also on errors and KeyboardInterrupt: what it observed is settled here
    probe.contribute(decoded)      # once, after decoding, in list order: the tables and columns it adds

The session holds the list (``Session.probes``, made by ``make_probes``). An error in any of the three is contained: the
session and finishing count it in ``tracer_errors`` (labelled with the probe's ``name``) and go on.
What a probe contributes is a :class:`Contribution`: whole tables it owns (``graphs``, ``kernels``,
``leaks``, ``collectives``...), columns of the decoded tables (``decode.PROBE_COLUMNS``, or a
corrected decoded column), and notes. :class:`Decoded` shows each probe the decoded tables with the
columns earlier probes contributed; finishing builds every table once from them, in schema order.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Protocol, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from .._common import ipython_shell
from ..analyses.opview import take_table_rows as take_rows
from ..io.pages import release as release_pages
from ..schema import nullable_array
from .spilled import SpillFiles, mapped_table, release_memory

Column = Union[pa.Array, pa.ChunkedArray]   # a column a probe contributes

if TYPE_CHECKING:
    from ..options import TraceOptions
    from ..timing.kernels import KernelCollector
    from ..tracking.storages import LiveStorage
    from .allocator import AllocatorProbe
    from .collectives import CollectiveProbe
    from .compiled import CompileCapture
    from .context import RecordingContext
    from .engines import Engine
    from .ranks import DistContext
    from .recorder import Recorder
    from .repro_capture import InputCapture


class Contribution(NamedTuple):
    """What one probe adds to the trace."""

    tables: dict[str, Any]                      # whole tables it owns (``kernels`` may be a pending resolver)
    columns: dict[tuple[str, str], Column]      # (table, column) -> the column of that decoded table
    notes: list[str]                            # for the metadata's notes, in probe order


def nothing() -> Contribution:
    return Contribution({}, {}, [])


class Decoded:
    """The decoded tables of one trace as columns, and what the probes contributed so far.

    ``table(name)`` is a read-only view: the decoded columns and those earlier probes gave (a
    contributed column replaces the decoded one of its name). ``build()`` makes each table once,
    in its schema's order; a column no probe contributed (its probe was off or failed) is null.
    ``files``: where a spilled trace's tables are (``spilled.SpillFiles``), None when it did not
    spill; then the decoded ``ops``/``calls``/``tensors`` are memory-mapped, and ``build()`` writes
    what the probes contributed to them into files of their own too (see :meth:`build`)."""

    def __init__(self, ctx: RecordingContext, tables: dict[str, pa.Table], files: Optional[SpillFiles] = None) -> None:
        self.ctx = ctx
        self.rec = ctx.rec
        self.t0 = ctx.t0
        self.files = files
        self._columns: dict[str, dict[str, Column]] = {n: dict(zip(t.column_names, t.columns)) for n, t in tables.items()}
        self._rows = {n: t.num_rows for n, t in tables.items()}
        #: the tables decoded into files: their contributed columns are written to files at build()
        self._mapped = {n: dict(self._columns[n]) for n in tables
                        if files is not None and os.path.exists(files.path(n))}
        self.tables: dict[str, Any] = {}
        self.notes: list[str] = []
        self._in_files: dict[tuple[str, str], Column] = {}   # (table, column) -> written by write_column

    def write_column(self, name: str, col: str, blocks: Callable[[], Iterable[pa.Array]]) -> Optional[Column]:
        """Column ``col`` of the memory-mapped table ``name``, written to a file of its own as
        ``blocks()`` computes it and read back memory-mapped (no array of every row in memory);
        contributed, ``build()`` keeps it where it is. None when ``name`` is not mapped."""
        if name not in self._mapped or self.files is None:
            return None
        sub = pa.schema([S.TABLES[name].field(col)])
        t = self.files.write(f"{name}-{col}", sub, lambda: (pa.RecordBatch.from_arrays([a], schema=sub) for a in blocks()))
        self._in_files[(name, col)] = out = t.column(0)
        return out

    def table(self, name: str) -> pa.Table:
        cols = self._columns.get(name)
        if cols is None:
            t: pa.Table = self.tables[name]
            return t
        return pa.Table.from_arrays(list(cols.values()), names=list(cols))

    def get(self, name: str) -> Optional[pa.Table]:
        return self.table(name) if name in self._columns or name in self.tables else None

    def add(self, c: Contribution) -> None:
        for (name, col), arr in c.columns.items():
            if len(arr) != self._rows[name]:
                raise ValueError(f"a contributed {name}.{col} has {len(arr)} rows, the table {self._rows[name]}")
        for (name, col), arr in c.columns.items():
            self._columns[name][col] = arr
            if self._in_files.get((name, col)) is arr:   # already in its file: kept as the decoded columns are
                self._mapped[name][col] = arr
        self.tables.update(c.tables)
        self.notes.extend(c.notes)

    def release_pages(self) -> None:
        """A spilled trace: the file pages the last pass read from the mapped tables go back (io/pages.py)."""
        if self.files is not None:
            release_pages(*(c for cols in self._columns.values() for c in cols.values()),
                          *(t for t in self.tables.values() if isinstance(t, pa.Table)))

    def build(self) -> dict[str, Any]:
        """Every table, once, in its schema's order. A memory-mapped (spilled) table keeps its
        decoded columns where they are; the columns probes contributed to it are written, batch by
        batch, into ``<name>-contributed.arrow`` beside it and read back memory-mapped, and a column
        nobody contributed is null chunk by chunk (one shared all-null array per chunk length), so
        the built table holds next to nothing in anonymous memory."""
        out: dict[str, Any] = {}
        for name, cols in self._columns.items():
            schema, n = S.TABLES[name], self._rows[name]
            if name in self._mapped and self.files is not None:
                out[name] = mapped_table(name, schema, n, cols, self._mapped[name], self.files)
                continue
            out[name] = pa.Table.from_arrays([cols[f.name] if f.name in cols else pa.nulls(n, f.type) for f in schema],
                                             schema=schema)
        out.update(self.tables)
        return out


class Probe(Protocol):
    """Something that records beside the engine (see the module docstring)."""

    #: the label of its contained errors in ``tracer_error_messages``
    name: str

    def start(self, ctx: RecordingContext) -> None: ...

    def stop(self) -> None: ...

    def contribute(self, decoded: Decoded) -> Contribution: ...


# -- the probes ------------------------------------------------------------------------------------------

class DistProbe:
    """The rank identity and clock (``ranks.DistContext``): read before any mode, again at the end."""

    name = "distributed capture"

    def __init__(self, dist: DistContext) -> None:
        self.dist = dist
        self._rec: Optional[Recorder] = None

    def start(self, ctx: RecordingContext) -> None:
        self._rec = ctx.rec
        self.dist.capture()   # before any mode: a clock ping-pong here is seen by no one

    def stop(self) -> None:
        rec, self._rec = self._rec, None
        if rec is None:
            return
        try:
            self.dist.capture(end=True)
        except Exception as e:
            rec.tracer_error("distributed capture", e)

    def contribute(self, decoded: Decoded) -> Contribution:
        return nothing()   # the metadata's ``distributed`` (the session: Session._distributed)


class CaptureProbe:
    """The warning/error capture (``native.open_capture()``) on ``ctx.capture``."""

    name = "warnings capture"

    def __init__(self, options: TraceOptions) -> None:
        self.options = options
        self._ctx: Optional[RecordingContext] = None

    def start(self, ctx: RecordingContext) -> None:
        self._ctx = ctx
        try:
            from .. import native

            ctx.capture = native.open_capture(native=self.options.native, cpp_errors=self.options.cpp_errors)
        except Exception as e:
            ctx.capture = None
            ctx.rec.notes.append(f"warning/error capture unavailable: {type(e).__name__}: {e}")

    def stop(self) -> None:
        if self._ctx is not None and self._ctx.capture is not None:
            self._ctx.capture.close()

    def contribute(self, decoded: Decoded) -> Contribution:
        return nothing()   # its rows are errors rows (the recorder's)


class ShadowProbe:
    """``numerics=``: the NumericsShadow on ``ctx.shadow`` (its rows are the ops' num_* columns)."""

    name = "numerics shadow"

    def __init__(self, mode: Union[bool, str]) -> None:
        self.mode = mode   # options.numerics: True or a mode name

    def start(self, ctx: RecordingContext) -> None:
        from .engines.python.shadow import NumericsShadow

        ctx.shadow = NumericsShadow(mode=self.mode)

    def stop(self) -> None:
        pass

    def contribute(self, decoded: Decoded) -> Contribution:
        return nothing()


class EngineProbes:
    """The engine's own per-op probes (``Engine.setup_probes``): the non-finite screen, the CUDA
    timer, fingerprints, C++ error sites. Stopping settles them into the recorder (the timer's
    event pairs, the screen's device counts), which the ops decode reads."""

    name = "engine probes"

    def __init__(self, engine: Engine, options: TraceOptions) -> None:
        self.engine = engine
        self.options = options
        self._ctx: Optional[RecordingContext] = None

    def start(self, ctx: RecordingContext) -> None:
        self._ctx = ctx
        self.engine.setup_probes(ctx, self.options)   # never raises: a probe it cannot make is a note

    def stop(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            return
        rec = ctx.rec
        if ctx.cuda_timer is not None:
            try:
                rec.cuda_ns.update(ctx.cuda_timer.resolve())
            except Exception as e:
                rec.tracer_error("cuda timer resolve", e)
        if ctx.screen is not None:
            try:
                rec.nonfinite.update(ctx.screen.finish())
            except Exception as e:
                rec.tracer_error("non-finite screen finish", e)

    def contribute(self, decoded: Decoded) -> Contribution:
        return nothing()   # the decoded ops' cuda_ns, nonfinite*, fp_* columns


class CompiledProbe:
    """torch.compile's structured-trace records (``compiled.CompileCapture``); at the end the
    ``graphs``/``graph_nodes`` tables and the ops' and calls' ``graph_id`` (``compiled_link.link``)."""

    name = "compiled regions"

    def __init__(self) -> None:
        self.capture: Optional[CompileCapture] = None   # None when it could not be installed

    def start(self, ctx: RecordingContext) -> None:
        try:
            from .compiled import CompileCapture

            self.capture = CompileCapture().install()
        except Exception as e:
            self.capture = None
            ctx.rec.notes.append(f"torch.compile capture unavailable: {e}")

    def stop(self) -> None:
        if self.capture is not None:
            self.capture.close()

    def contribute(self, decoded: Decoded) -> Contribution:
        from .compiled_link import link

        records = list(self.capture.records) if self.capture is not None else []
        # with or without records: calls from code compiled in earlier traces link to those graphs
        tables, columns = link(records, decoded.table("ops"), decoded.table("calls"), decoded.rec.notes)
        return Contribution(tables, columns, [])


class KernelsProbe:
    """``kernels=True``: the shared Kineto collector's window around the trace (``timing/kernels.py``)."""

    name = "kernels"

    def __init__(self, enabled: bool, deferred: bool) -> None:
        self.enabled = enabled
        self.deferred = deferred   # always-on cells: link kernels at the next harvest, not per cell
        self.collector: Optional[KernelCollector] = None

    def start(self, ctx: RecordingContext) -> None:
        if not self.enabled:
            return   # the kernels table is empty
        try:
            from ..timing.kernels import KernelCollector

            self.collector = KernelCollector.shared()
            self.collector.begin_window()
        except Exception as e:
            self.collector = None
            ctx.rec.notes.append(f"kernel collection unavailable: {e}")

    def stop(self) -> None:
        pass   # the window ends at contribute(), against the decoded ops

    def contribute(self, decoded: Decoded) -> Contribution:
        if self.collector is None:
            return Contribution({"kernels": S.empty("kernels")}, {}, [])
        ops = decoded.table("ops")
        try:
            if self.deferred and self.collector.available:
                from ..timing.kernels import cuda_devices_of

                pending = self.collector.end_window_deferred(decoded.t0, ops, cuda_devices_of(ops))
                if pending is not None:
                    return Contribution({"kernels": pending}, {}, [])   # the Trace resolves it on first read
            table, notes = self.collector.end_window(decoded.t0, ops)
            return Contribution({"kernels": table}, {}, list(notes))
        except Exception as e:
            decoded.rec.tracer_error("kernels", e)
            return Contribution({"kernels": S.empty("kernels")}, {}, [f"kernel collection failed: {e}"])


class CollectivesProbe:
    """The ``collectives`` table: an op hook on the c10d namespaces (both engines hand those ops to
    ``ctx.op_hooks``); its first collective captures the rank identity again."""

    name = "collectives"

    def __init__(self, dist: DistContext) -> None:
        self.dist = dist
        self.probe: Optional[CollectiveProbe] = None

    def start(self, ctx: RecordingContext) -> None:
        from .collectives import NAMESPACES, CollectiveProbe

        self.probe = CollectiveProbe(on_first=_first_collective(ctx, self.dist))
        ctx.op_hooks.add(NAMESPACES, self.probe.on_op)

    def stop(self) -> None:
        if self.probe is not None:   # on_first holds the context, which holds the probe (its op hook)
            self.probe.on_first = None

    def contribute(self, decoded: Decoded) -> Contribution:
        from .collectives import CollectiveProbe

        probe = self.probe if self.probe is not None else CollectiveProbe()
        return Contribution({"collectives": probe.table(decoded.t0, decoded.table("ops"))}, {}, [])


class InputsProbe:
    """``capture=``: the chosen ops' arguments for ``t.repro()`` (``repro_capture.InputCapture``)."""

    name = "captures"

    def __init__(self, options: TraceOptions) -> None:
        self.options = options
        self.inputs: Optional[InputCapture] = None

    def start(self, ctx: RecordingContext) -> None:
        from .repro_capture import NAMESPACES, InputCapture

        self.inputs = InputCapture(self.options.capture, self.options.capture_bytes)
        ctx.op_hooks.add(NAMESPACES, self.inputs.hook)
        hooks = ctx.op_hooks
        hooks.before.append(self.inputs.before)   # python engine: written args, before the op
        hooks.written = self.inputs.written       # native engine: the same, copied in C++
        hooks.written_limit = self.options.capture_bytes
        hooks.written_seqs = self.inputs.seqs or None
        hooks.written_namespaces = frozenset(NAMESPACES)

    def stop(self) -> None:
        pass

    def contribute(self, decoded: Decoded) -> Contribution:
        if self.inputs is None:
            return nothing()
        return Contribution({"captures": self.inputs.table()}, {}, list(self.inputs.notes))


class StoragesProbe:
    """What the storage tracker (``ctx.tracker``) knows at the end: the ``leaks`` table, and the
    ``tensors`` column ``category`` (with the ``alloc_seq``/``alloc_op`` of buffers made for an
    op's ``out=``; ``address`` is decoded with the storage records). Each step is contained on its own, in this order: the leak
    finder reads the decoded allocation columns, the categories read the leaks."""

    name = "storages"

    def __init__(self, options: TraceOptions) -> None:
        self.leaks = options.leaks
        self._ctx: Optional[RecordingContext] = None

    def start(self, ctx: RecordingContext) -> None:
        self._ctx = ctx

    def stop(self) -> None:
        pass   # the tracker stays open until the tables are built (free_seq of late frees): the session closes it

    def contribute(self, decoded: Decoded) -> Contribution:
        rec = decoded.rec
        tensors = decoded.table("tensors")
        columns: dict[tuple[str, str], Column] = {}
        try:
            leaks = self._leaks_table(decoded.ctx, tensors)
        except Exception as e:
            rec.tracer_error("leaks", e)
            leaks = S.empty("leaks")
        try:
            columns.update(_categories(decoded, tensors, leaks))
        except Exception as e:
            rec.tracer_error("memory categories", e)
        return Contribution({"leaks": leaks}, columns, [])

    def _leaks_table(self, ctx: RecordingContext, tensors: pa.Table) -> pa.Table:
        tracker = ctx.tracker
        if tracker is None or not self.leaks:
            return S.empty("leaks")
        try:
            from ..tracking.leaks import leak_table
            from ..tracking.storages import LiveStorage
        except ImportError:
            return S.empty("leaks")
        live = tracker.live_created()
        if not live:
            return S.empty("leaks")
        # only the live storages' rows, and only the columns a record needs (the whole table as Python
        # objects cost ~1 ms per 300 storages)
        cols = ("nbytes", "device", "dtype", "shape", "alloc_seq", "alloc_op", "cell", "source_file", "source_line")
        t = take_rows(tensors.select(list(cols)), [sid for sid, _ref in live]).to_pydict()
        ptrs = ctx.rec.tensors.values("ptr", [sid for sid, _ref in live]).tolist()
        records: list[LiveStorage] = []
        for i, (sid, ref) in enumerate(live):
            row = {k: t[k][i] for k in cols}
            records.append(LiveStorage(
                storage_id=sid, ref=ref, data_ptr=int(ptrs[i]), nbytes=row["nbytes"], device=row["device"],
                dtype=row["dtype"], shape=tuple(row["shape"] or ()), alloc_seq=row["alloc_seq"],
                alloc_op=row["alloc_op"], cell=row["cell"], source_file=row["source_file"],
                source_line=row["source_line"]))
        import torch

        with torch._C.DisableTorchFunction():   # the search reads tensor attributes: invisible to user modes
            return leak_table(records, shell=ipython_shell())


def _categories(decoded: Decoded, tensors: pa.Table, leaks: pa.Table) -> dict[tuple[str, str], Column]:
    """The ``category`` column (analyses/memory_categories.py), from the lifetimes and the
    model/optimizer state alive now (tracking/state.py): read once, here, never per op; with the
    ``alloc_seq``/``alloc_op`` of buffers compiled code made for an op's ``out=`` moved there."""
    from ..analyses.memory_categories import Lifetimes, categorize, category_blocks, made_by_out_argument

    out: dict[tuple[str, str], Column] = {}
    if tensors.num_rows == 0:
        return out
    ops = decoded.table("ops")
    calls = decoded.get("calls")
    lt = Lifetimes(tensors, ops, calls)   # one pass over the ops for every step below
    rows, seqs = made_by_out_argument(tensors, ops, lt)
    if len(rows):   # buffers compiled code made for an op's out=: made there, not before the trace
        lt.move_alloc(rows, seqs)   # categorize reads the moved alloc_seq from here
        # (compiled regions only: the whole column)
        alloc = np.array(pc.fill_null(tensors.column("alloc_seq"), -1).to_numpy(), dtype=np.int64)
        alloc[rows] = seqs
        op_names = take_rows(ops.select(["op"]), np.maximum(alloc, 0)).column(0).combine_chunks()
        out[("tensors", "alloc_seq")] = nullable_array(alloc, alloc < 0)
        out[("tensors", "alloc_op")] = pc.if_else(pa.array(alloc >= 0), op_names, pa.nulls(len(alloc), op_names.type))
        tensors = tensors.set_column(tensors.schema.get_field_index("alloc_seq"), "alloc_seq",
                                     out[("tensors", "alloc_seq")])
        tensors = tensors.set_column(tensors.schema.get_field_index("alloc_op"), "alloc_op",
                                     out[("tensors", "alloc_op")])
    known: dict[int, str] = {}
    ctx = decoded.ctx
    tracker = ctx.tracker
    if tracker is not None:
        from ..tracking.leaks.roots import user_objects
        from ..tracking.state import find_optimizers, state_storages

        alive = lt.rows_where("free_seq", lambda f: f < 0)   # the storages never freed
        live = dict(zip(ctx.rec.tensors.values("ptr", alive).tolist(), alive.tolist()))
        modules = ctx.modules.roots() if ctx.modules is not None else []
        objs = user_objects(ipython_shell())
        try:
            optimizers = find_optimizers(objs)
        finally:
            objs.clear()
        known = state_storages(modules, optimizers, live)
        del modules, optimizers
    graph_held: list[int] = []
    opt_held: list[int] = []
    if leaks.num_rows:
        for sid, kind in zip(leaks.column("storage_id").to_pylist(), leaks.column("holder_kind").to_pylist()):
            if sid is None:
                continue
            if kind == "autograd_graph":
                graph_held.append(sid)
            elif kind == "optimizer_state":
                opt_held.append(sid)
    first = tensors.column(0)   # a spilled trace's categories go to a file a decoded chunk at a time
    lengths = [len(c) for c in first.chunks] if isinstance(first, pa.ChunkedArray) else None
    cat = decoded.write_column("tensors", "category", lambda: category_blocks(
        tensors, ops, calls, known, graph_held, opt_held, lifetimes=lt, lengths=lengths))
    out[("tensors", "category")] = cat if cat is not None else categorize(
        tensors, ops, calls, known, graph_held, opt_held, lifetimes=lt)
    return out


class AllocatorStatsProbe:
    """The CUDA caching allocator (``allocator.AllocatorProbe``): its counters at start and end, its
    history with ``memory_history=True``; at the end the ``allocator*`` tables (analyses/allocator.py),
    joined to ``tensors`` by ``address``. Started last (its history records the block, not the
    probes' setup), so stopped first."""

    name = "allocator"

    def __init__(self, history: bool, dist: DistContext) -> None:
        from .allocator import AllocatorProbe

        self.probe: AllocatorProbe = AllocatorProbe(history=history)
        self.dist = dist

    def start(self, ctx: RecordingContext) -> None:
        self.probe.start()

    def stop(self) -> None:
        self.probe.stop()   # the snapshot before its history is turned off (an OOM in the block included)

    def contribute(self, decoded: Decoded) -> Contribution:
        tables: dict[str, Any] = {}
        try:
            from .allocator import allocator_tables

            tables = allocator_tables(self.probe, decoded.table("tensors"), decoded.table("ops"),
                                      int(getattr(self.dist, "anchor_unix_ns", 0) or 0))
        except Exception as e:
            decoded.rec.tracer_error("CUDA allocator", e)
        return Contribution(tables, {}, list(self.probe.notes))


def make_probes(options: TraceOptions, engine: Engine, dist: DistContext, *, deferred_kernels: bool) -> list[Probe]:
    """The probes of one trace, in start order (and contribution order; stopped in reverse)."""
    probes: list[Probe] = [DistProbe(dist), CaptureProbe(options)]
    if options.numerics:
        probes.append(ShadowProbe(options.numerics))
    probes += [EngineProbes(engine, options), CompiledProbe(),   # the engine's after the capture
               KernelsProbe(bool(options.kernels), deferred_kernels), CollectivesProbe(dist)]
    if options.capture is not None:
        probes.append(InputsProbe(options))
    probes += [StoragesProbe(options), AllocatorStatsProbe(options.memory_history, dist)]
    return probes


def contribute_all(probes: Iterable[Probe], decoded: Decoded) -> None:
    """Every probe's contribution merged into ``decoded``, in order; a probe that raises is counted
    in ``tracer_errors`` and contributes nothing."""
    for p in probes:
        if decoded.files is not None:
            release_memory()   # a spilled trace: what decoding and the previous probe freed goes back first
            decoded.release_pages()   # and the pages the previous pass read of the mapped tables
        try:
            decoded.add(p.contribute(decoded))
        except Exception as e:
            decoded.rec.tracer_error(p.name, e)


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
