"""The end of a trace: decode, merge what the probes contribute, the metadata.

``finish_tables(f)`` runs once per trace after the engine handed everything to the recorder and
the probes stopped (``recording/probes.py``): the buffers are decoded (``decode.py``), each probe
contributes its tables and columns in turn (:class:`probes.Decoded` shows it the decoded tables
with what earlier probes gave), and every table is built once, in its schema's order.
``metadata(f, ...)`` says how the trace was recorded. The session then builds the ``Trace`` from
both, whole. ``f`` is the caller's state as far as :class:`Finishing` names it (the session is one).
"""
from __future__ import annotations

import platform
import time
from typing import TYPE_CHECKING, Any, Optional, Protocol

import pyarrow as pa

from .. import schema as S
from ..io.pages import release as release_pages
from .columns import _Links
from .context import RecordingContext
from .decode import decode_tables
from .probes import Decoded, Probe, contribute_all
from .spilled import release_memory

if TYPE_CHECKING:
    from ..options import TraceOptions
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
    probes: list[Probe]


def finish_tables(f: Finishing) -> tuple[dict[str, Any], Optional[str], list[str]]:
    """Every recorded table of the trace (``kernels`` may be a pending value with a ``resolve()``:
    always-on cells link kernels at the next harvest), the memory-mapped ops file (or None), and
    the notes the probes add."""
    ctx = f.ctx
    tables, files = decode_tables(ctx.rec, cell=f.cell, screen=ctx.screen, links=f.links,
                                  spill_dir=f.options.spill_dir)
    if files is not None:
        release_pages(*tables.values())   # the decode's passes over the mapped files: pages back
    decoded = Decoded(ctx, tables, files)
    del tables
    contribute_all(f.probes, decoded)
    decoded.release_pages()
    built = decoded.build()
    if files is not None:
        release_memory()
        release_pages(*(t for t in built.values() if isinstance(t, pa.Table)))
    return built, files.path("ops") if files is not None and files.used else None, decoded.notes


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
        "module_roots": list(f.ctx.modules.root_classes),
        **({"tracer_op_ns": rec.own_op_ns} if rec.own_op_ns is not None else {}),
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


