"""The end of a trace: the probes' last results, the decoded tables completed, the metadata.

``finish_tables(f)`` runs once per trace after the engine handed everything to the recorder:
the probes resolve (CUDA event pairs, the non-finite screen), the buffers are decoded
(``decode.py``), compiled regions are linked (``compiled_link.py``), kernels are collected, the
leak finder and the memory categories run, and the collectives table is built. ``metadata(f, ...)``
says how the trace was recorded. The session then builds the ``Trace`` from both, whole.
``f`` is the caller's state as far as :class:`Finishing` names it (the session is one).
"""
from __future__ import annotations

import platform
import time
from typing import TYPE_CHECKING, Any, Optional, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from .._common import ipython_shell
from ..schema import nullable_array
from .columns import _Links
from .context import RecordingContext
from .decode import decode_tables

if TYPE_CHECKING:
    from ..options import TraceOptions
    from ..timing.kernels import KernelCollector
    from .allocator import AllocatorProbe
    from .collectives import CollectiveProbe
    from .engines import EngineChoice


class Finishing(Protocol):
    """What finishing a trace reads of the session that recorded it."""

    ctx: RecordingContext
    options: TraceOptions
    cell: Optional[int]
    cell_source: Optional[str]
    origin: str
    engine_choice: EngineChoice
    wall_ns: int
    links: _Links
    kernels: Optional[KernelCollector]
    deferred_kernels: bool
    compile_capture: Any
    collectives: CollectiveProbe
    inputs: Any   # repro_capture.InputCapture of capture=, or None
    allocator: AllocatorProbe
    dist: Any   # ranks.DistContext: anchor_unix_ns, the trace start on the unix clock


def finish_tables(f: Finishing) -> tuple[dict[str, Any], Optional[str], list[str]]:
    """Every recorded table of the trace (``kernels`` may be a pending value with a ``resolve()``:
    always-on cells link kernels at the next harvest), the memory-mapped ops file (or None), and
    the notes the steps here add."""
    rec = f.ctx.rec
    ctx = f.ctx
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
    tables, ops_file = decode_tables(rec, cell=f.cell, screen=ctx.screen, links=f.links,
                                     spill_dir=f.options.spill_dir)
    notes: list[str] = []
    try:
        from .compiled_link import attach

        cap = f.compile_capture
        tables = attach(list(cap.records) if cap is not None else [], tables, rec.notes)
    except Exception as e:
        rec.tracer_error("compiled regions", e)
    kernels, knotes = _kernels_table(f, tables["ops"])
    tables["kernels"] = kernels
    notes.extend(knotes)
    try:
        tables["leaks"] = _leaks_table(f, tables["tensors"])
    except Exception as e:
        rec.tracer_error("leaks", e)
        tables["leaks"] = S.empty("leaks")
    try:
        tables["tensors"] = _with_categories(f, tables)
    except Exception as e:
        rec.tracer_error("memory categories", e)
    try:
        tables["tensors"] = _with_addresses(f, tables["tensors"])
    except Exception as e:
        rec.tracer_error("storage addresses", e)
    tables["collectives"] = f.collectives.table(ctx.t0, tables.get("ops"))
    if f.inputs is not None:
        try:
            tables["captures"] = f.inputs.table()
            notes.extend(f.inputs.notes)
        except Exception as e:
            rec.tracer_error("captures", e)
    try:
        tables.update(_allocator_tables(f, tables))
    except Exception as e:
        rec.tracer_error("CUDA allocator", e)
    notes.extend(f.allocator.notes)
    return tables, ops_file, notes


def _with_addresses(f: Finishing, tensors: pa.Table) -> pa.Table:
    """``tensors`` with its ``address`` column: each storage's data pointer, which the trackers of both
    engines keyed it by (``tracker.ptrs``; fake tensors' keys are not addresses: null)."""
    tracker = f.ctx.tracker
    n = tensors.num_rows
    if tracker is None or n == 0:
        return tensors
    ptrs = list(tracker.ptrs[:n])
    try:
        arr = np.asarray(ptrs, dtype=np.int64)
    except OverflowError:
        return tensors
    if len(arr) < n:
        arr = np.concatenate([arr, np.zeros(n - len(arr), np.int64)])
    col = nullable_array(arr, arr <= 0)
    return tensors.set_column(tensors.schema.get_field_index("address"), S.TENSORS.field("address"), col)


def _allocator_tables(f: Finishing, tables: dict[str, Any]) -> dict[str, pa.Table]:
    """The CUDA caching allocator's view (analyses/allocator.py): its counters per device the trace
    touched, and with ``memory_history=True`` its snapshot joined to ``tensors``."""
    from ..analyses.allocator import (
        allocator_rows,
        allocator_table,
        allocator_timeline,
        cuda_index,
        snapshot_tables,
        with_history,
    )

    probe = f.allocator
    out: dict[str, pa.Table] = {}
    if not probe.start_stats and not probe.end_stats:
        return out
    tensors = tables["tensors"]
    touched = [i for i in (cuda_index(d) for d in tensors.column("device").unique().to_pylist()) if i is not None]
    allocator = allocator_table(allocator_rows(probe.start_stats, probe.end_stats, touched))
    if probe.snapshot is not None:
        anchor = int(getattr(f.dist, "anchor_unix_ns", 0) or 0)
        snap = snapshot_tables(probe.snapshot, anchor_unix_ns=anchor, tensors=tensors, ops=tables["ops"])
        out.update(snap)
        timeline = allocator_timeline(snap["allocator_events"], allocator)
        allocator = with_history(allocator, timeline, tables["ops"], tensors)
    out["allocator"] = allocator
    return out


def _with_categories(f: Finishing, tables: dict[str, pa.Table]) -> pa.Table:
    """``tensors`` with its ``category`` column (analyses/memory_categories.py), from the lifetimes and
    the model/optimizer state alive now (tracking/state.py): read once, here, never per op."""
    from ..analyses.memory_categories import Lifetimes, categorize, made_by_out_argument

    tensors = tables["tensors"]
    if tensors.num_rows == 0:
        return tensors
    lt = Lifetimes(tensors, tables["ops"])   # the columns every step below reads, converted once
    rows, seqs = made_by_out_argument(tensors, tables["ops"], lt)
    if len(rows):   # buffers compiled code made for an op's out=: made there, not before the trace
        alloc = lt.alloc   # categorize reads the moved alloc_seq from here
        alloc[rows] = seqs
        op_names = tables["ops"].column("op").take(pa.array(np.maximum(alloc, 0)))
        alloc_op = pc.if_else(pa.array(alloc >= 0), op_names, pa.nulls(len(alloc), op_names.type))
        tensors = tensors.set_column(tensors.schema.get_field_index("alloc_seq"), S.TENSORS.field("alloc_seq"),
                                     nullable_array(alloc, alloc < 0))
        tensors = tensors.set_column(tensors.schema.get_field_index("alloc_op"), S.TENSORS.field("alloc_op"),
                                     alloc_op)
    known: dict[int, str] = {}
    tracker = f.ctx.tracker
    if tracker is not None:
        from ..tracking.leaks.roots import user_objects
        from ..tracking.state import find_optimizers, state_storages

        ptrs = tracker.ptrs
        alive = np.nonzero(lt.free < 0)[0]
        live = {int(ptrs[i]): i for i in alive[alive < len(ptrs)].tolist()}
        modules = f.ctx.modules.roots() if f.ctx.modules is not None else []
        objs = user_objects(ipython_shell())
        try:
            optimizers = find_optimizers(objs)
        finally:
            objs.clear()
        known = state_storages(modules, optimizers, live)
        del modules, optimizers
    lk = tables.get("leaks")
    graph_held: list[int] = []
    opt_held: list[int] = []
    if lk is not None and lk.num_rows:
        for sid, kind in zip(lk.column("storage_id").to_pylist(), lk.column("holder_kind").to_pylist()):
            if sid is None:
                continue
            if kind == "autograd_graph":
                graph_held.append(sid)
            elif kind == "optimizer_state":
                opt_held.append(sid)
    col = categorize(tensors, tables["ops"], tables.get("calls"), known, graph_held, opt_held, lifetimes=lt)
    return tensors.set_column(tensors.schema.get_field_index("category"), S.TENSORS.field("category"), col)




def _kernels_table(f: Finishing, ops: pa.Table) -> tuple[pa.Table, list[str]]:
    if f.kernels is None:
        return S.empty("kernels"), []
    try:
        if f.deferred_kernels and f.kernels.available:
            from ..timing.kernels import cuda_devices_of

            pending = f.kernels.end_window_deferred(f.ctx.t0, ops, cuda_devices_of(ops))
            if pending is not None:
                return pending, []   # the Trace resolves it when the table is first read
        return f.kernels.end_window(f.ctx.t0, ops)
    except Exception as e:
        f.ctx.rec.tracer_error("kernels", e)
        return S.empty("kernels"), [f"kernel collection failed: {e}"]


def _leaks_table(f: Finishing, tensors: pa.Table) -> pa.Table:
    if f.ctx.tracker is None or not f.options.leaks:
        return S.empty("leaks")
    try:
        from ..tracking.leaks import leak_table
        from ..tracking.storages import LiveStorage
    except ImportError:
        return S.empty("leaks")
    live = f.ctx.tracker.live_created()
    if not live:
        return S.empty("leaks")
    # only the live storages' rows, and only the columns a record needs (the whole table as Python
    # objects cost ~1 ms per 300 storages)
    cols = ("nbytes", "device", "dtype", "shape", "alloc_seq", "alloc_op", "cell", "source_file", "source_line")
    t = tensors.select(list(cols)).take(pa.array([sid for sid, _ref in live], pa.int64())).to_pydict()
    records: list[Any] = []   # tracking.storages.LiveStorage
    for i, (sid, ref) in enumerate(live):
        row = {k: t[k][i] for k in cols}
        records.append(LiveStorage(
            storage_id=sid, ref=ref, data_ptr=f.ctx.tracker.ptrs[sid], nbytes=row["nbytes"], device=row["device"],
            dtype=row["dtype"], shape=tuple(row["shape"] or ()), alloc_seq=row["alloc_seq"], alloc_op=row["alloc_op"],
            cell=row["cell"], source_file=row["source_file"], source_line=row["source_line"]))
    import torch

    with torch._C.DisableTorchFunction():   # the search reads tensor attributes: invisible to user modes
        return leak_table(records, shell=ipython_shell())


_DEVICE: Optional[dict[str, Any]] = None


def _device_description() -> dict[str, Any]:
    """env() once per process, hidden from every mode and profiler (it runs a probe op)."""
    global _DEVICE
    if _DEVICE is not None:
        if not _DEVICE.get("peaks"):
            # measured since the first trace (tensorscope.env(), an advice): the cache read is cheap
            try:
                from .._peaks import all_peaks

                _DEVICE["peaks"] = all_peaks(measure=False) or None
            except Exception:
                pass
        return dict(_DEVICE)

    def describe() -> dict[str, Any]:
        import torch
        from torch.utils._python_dispatch import _disable_current_modes

        from .._env import env

        with _disable_current_modes(), torch._C.DisableTorchFunction():
            return env(init_cuda=False).to_dict()   # never create a CUDA context just to describe it

    try:
        from .engines import unobserved

        _DEVICE = unobserved(describe)
    except Exception as e:
        return {"error": str(e)}
    return dict(_DEVICE)


def metadata(f: Finishing, ops_rows: int, notes: list[str], **extra: Any) -> dict[str, Any]:
    """The trace's metadata (``TraceMetadata`` fields) as a dict; ``extra``: fields the caller knows
    (``distributed``...)."""
    import torch

    from .._version import __version__

    rec = f.ctx.rec
    device = _device_description()
    cap = f.ctx.capture
    engine = f.engine_choice
    cell_files = _cell_files(f)
    native = None
    try:
        from .. import native as _native

        native = dict(_native.status())
        native["used"] = bool(getattr(cap, "native", False))
    except Exception:
        pass
    return {
        "schema_version": S.SCHEMA_VERSION,
        "tensorscope_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "created_unix_ns": time.time_ns(),
        "device": device,
        "options": f.options,   # the TraceOptions itself: TraceMetadata keeps it typed
        "cell": f.cell,
        "cell_source": f.cell_source,
        "wall_ns": f.wall_ns,
        "n_ops": ops_rows,
        "n_calls": rec.n_calls,
        "spilled_rows": rec.n_spilled,
        "tracer_errors": rec.n_tracer_errors,
        "tracer_error_messages": list(rec.tracer_errors),
        "native": native,
        # which engine recorded the ops, and why (the summary shows the reason when it is the fallback)
        "engine": engine.name,
        "engine_reason": engine.reason,
        "opaque_ops": f.ctx.opaque_ops,
        "compiled_ops": f.ctx.compiled_ops,
        "origin": f.origin,
        "cell_files": cell_files,
        # [precision integration] probe counters: non-finite screen, numerics shadow (skips and why)
        "nonfinite_screen": f.ctx.screen.report() if f.ctx.screen is not None else None,
        "numerics": f.ctx.shadow.report() if f.ctx.shadow is not None else None,
        "notes": list(rec.notes) + list(notes),
        **extra,
    }


def _cell_files(f: Finishing) -> Optional[dict[str, Any]]:
    """Which source files are notebook cells, and their numbers (``Cell In[3], line 11``)."""
    rec = f.ctx.rec
    try:
        from .._location import cell_files_for

        files = [v[0] for v in rec.sources.values if v is not None]
        files += [r.get("source_file") for r in rec.errors]
        return cell_files_for(files) or None
    except Exception as e:
        rec.tracer_error("cell files", e)
        return None


