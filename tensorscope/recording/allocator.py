"""The CUDA caching allocator, read at a trace's start and end; its history while the trace runs (opt-in).

``AllocatorProbe`` reads ``torch.cuda.memory_stats(d)`` for every device at the start and at the
end of the trace when CUDA is initialised (it never initialises CUDA and resets no counter: the
allocator's peaks stay since the program's own last reset). With ``memory_history=True`` it turns
``torch.cuda.memory._record_memory_history`` on at the start (unless the program already records
it: then that recording is left as it is) and, at the end, takes ``torch.cuda.memory._snapshot()``
*before* turning it off again, also when the block raised (an out-of-memory error is the point).
The session runs ``stop`` from its restore path, so KeyboardInterrupt and errors restore it too.
Converting the snapshot to tables (no pickle, no frames) is ``analyses/allocator.py``'s.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

if TYPE_CHECKING:
    import pyarrow as pa

#: events the allocator keeps while we record its history (its ring buffer drops the oldest past this)
MAX_ENTRIES = 1_000_000


def _cuda() -> Any:
    """``torch.cuda`` when CUDA is initialised in this process (never initialising it), else None."""
    import torch

    try:
        return torch.cuda if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    except Exception:
        return None


class HistoryAPI(NamedTuple):
    """torch's allocator-history functions (one seam: the CPU tests hand a stand-in)."""

    record: Callable[..., None]          # torch.cuda.memory._record_memory_history
    snapshot: Callable[[], dict[str, Any]]   # torch.cuda.memory._snapshot
    is_enabled: Callable[[], bool]       # torch._C._cuda_isHistoryEnabled


def _history_api() -> Optional[HistoryAPI]:
    """The history functions when this torch has them and a CUDA device exists, else None."""
    import torch

    mem = getattr(torch.cuda, "memory", None)
    enabled = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    if not (torch.cuda.is_available() and mem is not None and enabled is not None
            and hasattr(mem, "_record_memory_history") and hasattr(mem, "_snapshot")):
        return None
    return HistoryAPI(mem._record_memory_history, mem._snapshot, enabled)


def _stats(cuda: Any) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for d in range(cuda.device_count()):
        out[d] = dict(cuda.memory_stats(d))
    return out


class AllocatorProbe:
    """One trace's reads of the caching allocator (plain values only: dicts of ints and strings)."""

    def __init__(self, history: bool) -> None:
        self.history = history
        self.start_stats: dict[int, dict[str, Any]] = {}
        self.end_stats: dict[int, dict[str, Any]] = {}
        self.snapshot: Optional[dict[str, Any]] = None
        self.enabled_by_us = False
        self.recorded_by_us = False
        self.notes: list[str] = []
        self._started = self._stopped = False
        self._api: Optional[HistoryAPI] = None

    def _read_stats(self, cuda: Any, when: str) -> dict[int, dict[str, Any]]:
        """Every device's ``memory_stats`` ({} without CUDA, or with a note when reading them failed)."""
        if cuda is None:
            return {}
        try:
            return _stats(cuda)
        except Exception as e:
            self.notes.append(f"CUDA allocator stats unavailable{when}: {type(e).__name__}: {e}")
            return {}

    def start(self) -> None:
        self._started = True
        cuda = _cuda()
        self.start_stats = self._read_stats(cuda, "")
        if not self.history:
            return
        api = self._api = _history_api()
        if api is None:
            self.notes.append("memory_history: no CUDA allocator history here (no CUDA device, or this torch "
                              "has no torch.cuda.memory._record_memory_history): nothing recorded")
            self.history = False
            return
        if cuda is None:
            self.notes.append("memory_history: CUDA was not initialised when the trace started and tensorscope "
                              "never initialises it, so no allocator history was recorded (run a CUDA op before "
                              "the traced block)")
            self.history = False
            return
        try:
            if not api.is_enabled():
                api.record(enabled="all", context=None, stacks="python", max_entries=MAX_ENTRIES)
                self.enabled_by_us = self.recorded_by_us = True
        except Exception as e:
            self.notes.append(f"memory_history: could not turn the allocator's history on: {type(e).__name__}: {e}")
            self.history = False

    def stop(self) -> None:
        """The end: the snapshot (before the history is turned off), the counters, the history restored.
        Safe to call twice; the history is turned off whatever failed before."""
        if self._stopped or not self._started:
            return
        self._stopped = True
        try:
            if self.history and self._api is not None:
                try:
                    self.snapshot = self._api.snapshot()
                except Exception as e:
                    self.notes.append(f"memory_history: snapshot failed: {type(e).__name__}: {e}")
            self.end_stats = self._read_stats(_cuda(), " at the end")
        finally:
            if self.enabled_by_us and self._api is not None:
                self.enabled_by_us = False
                self._api.record(enabled=None, context=None, stacks="python")
        if self.snapshot is not None and self.recorded_by_us:
            n = sum(len(t or ()) for t in self.snapshot.get("device_traces") or ())
            if n >= MAX_ENTRIES:
                self.notes.append(f"memory_history: the allocator kept its last {MAX_ENTRIES} events only; "
                                  "earlier ones of this trace are not in allocator_events")


def allocator_tables(probe: AllocatorProbe, tensors: pa.Table, ops: pa.Table, anchor: int) -> dict[str, pa.Table]:
    """The caching allocator's counters per device the trace touched (the ``allocator`` table),
    and with ``memory_history=True`` its snapshot joined to ``tensors`` (the allocator probe's
    contribution, recording/probes.py); ``anchor``: the rank's clock anchor (unix ns)."""
    from ..analyses.allocator import (
        allocator_rows,
        allocator_table,
        allocator_timeline,
        cuda_index,
        snapshot_tables,
        with_history,
    )

    out: dict[str, pa.Table] = {}
    if not probe.start_stats and not probe.end_stats:
        return out
    touched = [i for i in (cuda_index(d) for d in tensors.column("device").unique().to_pylist()) if i is not None]
    allocator = allocator_table(allocator_rows(probe.start_stats, probe.end_stats, touched))
    if probe.snapshot is not None:
        snap = snapshot_tables(probe.snapshot, anchor_unix_ns=anchor, tensors=tensors, ops=ops)
        out.update(snap)
        timeline = allocator_timeline(snap["allocator_events"], allocator)
        allocator = with_history(allocator, timeline, ops, tensors)
    out["allocator"] = allocator
    return out
