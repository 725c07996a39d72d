"""CUDA kernels from Kineto/CUPTI (``torch.profiler``'s backend): collecting and decoding them.

Fills the ``kernels`` table (one row per GPU activity, linked to the ``ops.seq`` that launched
it). This module owns the profiler session and turns its events into records:
``KernelCollector`` (``shared()``, ``begin_window``, ``end_window``, ``end_window_deferred`` ->
``PendingKernels``, ``flush``, ``close``), ``KinetoBackend`` and ``split_events``. Linking the
records to the ops and the clock map are ``timing/kernel_link.py`` (pure).

Rules and details (always-on harvesting, clock calibration): docs/development/timing.md
"""
from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable
from typing import Any, NamedTuple, Optional

import pyarrow as pa

from .. import schema as S
from .kernel_link import ClockMap, KernelRecord, LaunchRecord, OpWindows, link_kernels

__all__ = [
    "ProfilerEvents", "split_events", "KernelCollector", "PendingKernels", "KinetoBackend",
    "cuda_kernels_unavailable_reason", "MARKER",
]

#: name prefix of our calibration markers in the Kineto trace
MARKER = "tensorscope::window"

_KERNEL_TYPES = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
_RUNTIME_TYPES = {"cuda_runtime", "cuda_driver", "privateuse1_runtime", "privateuse1_driver"}
_GRID_RE = re.compile(r'"grid"\s*:\s*\[\s*([0-9]+)\s*,\s*([0-9]+)\s*,\s*([0-9]+)\s*\]')
_BLOCK_RE = re.compile(r'"block"\s*:\s*\[\s*([0-9]+)\s*,\s*([0-9]+)\s*,\s*([0-9]+)\s*\]')


class ProfilerEvents(NamedTuple):
    """What one profiler window gave: kernels, the launches (runtime/driver calls) and CPU op events
    that link them to ops, and our markers' timestamps for the clock calibration."""

    kernels: list[KernelRecord]
    launches: list[LaunchRecord]          # runtime / driver calls
    cpu_ops: list[LaunchRecord]           # CPU op events (fallback link through linked ids)
    markers: dict[str, list[int]]         # our marker name -> Kineto start ns of each emission, in order


def _ints3(m) -> Optional[tuple[int, int, int]]:
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def _grid_block(metadata_json: str):
    # Kineto's metadata is a JSON *fragment* (no braces) and may hold non-JSON values (inf, nan): regex, not json
    if not metadata_json:
        return None, None
    return _ints3(_GRID_RE.search(metadata_json)), _ints3(_BLOCK_RE.search(metadata_json))


def split_events(events: Iterable[Any], marker_prefix: str = MARKER) -> ProfilerEvents:
    """Sort ``_KinetoEvent``-like objects (``result.events()``) into kernels, launches, CPU ops and markers."""
    kernels: list[KernelRecord] = []
    launches: list[LaunchRecord] = []
    cpu_ops: list[LaunchRecord] = []
    markers: dict[str, list[int]] = {}
    for e in events:
        try:
            at = str(e.activity_type()).lower()
            name = e.name()
            kind = _KERNEL_TYPES.get(at)
            if kind is not None:
                grid = block = None
                if kind == "kernel":
                    grid, block = _grid_block(e.metadata_json())
                kernels.append(KernelRecord(name, int(e.device_index()), int(e.device_resource_id()), int(e.start_ns()),
                                            int(e.end_ns()), int(e.correlation_id()), int(e.linked_correlation_id()),
                                            grid, block, kind))
            elif at in _RUNTIME_TYPES:
                launches.append(LaunchRecord(name, int(e.start_ns()), int(e.end_ns()), int(e.correlation_id()),
                                             int(e.linked_correlation_id()), "runtime"))
            elif name.startswith(marker_prefix):
                markers.setdefault(name, []).append(int(e.start_ns()))
            elif at in ("cpu_op", "user_annotation") and not e.is_async():
                cpu_ops.append(LaunchRecord(name, int(e.start_ns()), int(e.end_ns()), int(e.correlation_id()), 0, "cpu_op"))
        except Exception:  # one malformed event must not cost the whole table
            continue
    return ProfilerEvents(kernels, launches, cpu_ops, markers)


def cuda_kernels_unavailable_reason() -> Optional[str]:
    """Why kernels cannot be collected here, or None when they can."""
    try:
        import torch
    except Exception as e:  # pragma: no cover - torch is a dependency
        return f"torch unavailable: {e}"
    if not torch.cuda.is_available():
        return "CPU-only: no CUDA device (torch.cuda.is_available() is False), so the kernels table is empty"
    try:
        from torch.autograd import _supported_activities
        from torch.profiler import ProfilerActivity

        if ProfilerActivity.CUDA not in _supported_activities():
            return "this torch build's profiler has no CUDA activity (Kineto built without CUPTI)"
    except Exception as e:
        return f"torch.profiler unavailable: {e}"
    return None


class KinetoBackend:
    """The Kineto session through torch's low-level profiler calls (no Python post-processing).

    ``stop()`` returns ``result.events()`` raw: torch.profiler's FunctionEvent
    tree costs microseconds per op to build and we need none of it.
    """

    def __init__(self, *, cuda: bool = True, cpu: bool = True):
        self.cuda = cuda
        self.cpu = cpu
        self.running = False
        self._cfg: Any = None    # torch's ProfilerConfig and activity set, while running
        self._acts: Any = None

    def start(self) -> None:
        import torch
        from torch.autograd import _enable_profiler, _prepare_profiler
        from torch.autograd import profiler as ap

        if torch.autograd._profiler_enabled():
            raise RuntimeError("another torch.profiler session is active; tensorscope does not start a second one")
        # torch builds the config (activities, experimental config, trace id) the same way it does for itself
        prof = ap.profile(use_device="cuda" if self.cuda else None, use_cpu=self.cpu, use_kineto=True,
                          record_shapes=False)
        self._cfg = prof.config(create_trace_id=True)
        self._acts = prof.kineto_activities
        _prepare_profiler(self._cfg, self._acts)
        getattr(ap, "_run_on_profiler_start", lambda: None)()
        _enable_profiler(self._cfg, self._acts)
        self.running = True

    def stop(self) -> list:
        from torch.autograd import _disable_profiler
        from torch.autograd import profiler as ap

        if not self.running:
            return []
        self.running = False
        result = _disable_profiler()
        getattr(ap, "_run_on_profiler_stop", lambda: None)()
        return list(result.events()) if result is not None else []


_MARKER_REPEATS = 3


def _marker(name: str, repeats: int = _MARKER_REPEATS) -> list[tuple[int, int]]:
    """Emit ``repeats`` zero-length Kineto markers named ``name``; return each one's perf bracket.

    The first emission after a pause is slow (cold caches: an order of magnitude slower than
    a warm one), so the calibration uses the tightest bracket.
    """
    import torch

    rf = getattr(torch._C._profiler, "_RecordFunctionFast", None)
    out = []
    perf = time.perf_counter_ns
    for _ in range(repeats):
        a = perf()
        if rf is not None:
            r = rf(name)
            r.__enter__()
            r.__exit__(None, None, None)
        else:  # older torch: the record_function enter/exit calls (emitted outside the modes' recording)
            h = torch.autograd._record_function_with_args_enter(name)
            torch.autograd._record_function_with_args_exit(h)
        out.append((a, perf()))
    return out


def _calibration_point(starts: Optional[list[int]], brackets: Optional[list[tuple[int, int]]]):
    """(kineto_ns, perf_mid, width) of the tightest marker emission, or None."""
    if not starts or not brackets or len(starts) != len(brackets):
        return None
    i = min(range(len(brackets)), key=lambda j: brackets[j][1] - brackets[j][0])
    a, b = brackets[i]
    return (starts[i], (a + b) // 2, b - a)


class _Window:
    __slots__ = ("k", "begin_name", "end_name", "begin_perf", "end_perf", "events", "result")

    def __init__(self, k: int, begin_perf):
        self.k = k
        self.begin_name = f"{MARKER}#{k}:begin"
        self.end_name = f"{MARKER}#{k}:end"
        self.begin_perf = begin_perf
        self.end_perf: Optional[list[tuple[int, int]]] = None
        self.events: Optional[ProfilerEvents] = None
        self.result = None


class PendingKernels:
    """The kernels of one window, collected at the collector's next harvest.

    ``resolve() -> (pyarrow.Table, notes)`` harvests (once, for every pending
    window) when needed. ``ready`` tells whether it would.
    """

    def __init__(self, collector: KernelCollector, win: _Window, t0_ns: int, op_windows: OpWindows):
        self._c = collector
        self._w = win
        self._t0 = t0_ns
        self._ops: Optional[OpWindows] = op_windows
        self._result: Optional[tuple[pa.Table, list[str]]] = None

    @property
    def ready(self) -> bool:
        return self._result is not None or self._w.events is not None

    def resolve(self) -> tuple[pa.Table, list[str]]:
        if self._result is None:
            if self._w.events is None:
                self._c.flush()
            assert self._ops is not None   # dropped only once the result is kept
            self._result = self._c._link_window(self._w, self._t0, self._ops)
            self._ops = None
        return self._result


class KernelCollector:
    """One Kineto session; windows (one per traced cell) are cut out of it. See the module docstring."""

    _shared: Optional[KernelCollector] = None
    _shared_lock = threading.Lock()

    def __init__(self, *, keep_alive: bool = False, backend: Any = None, require_cuda: bool = True,
                 max_pending: int = 16):
        self.keep_alive = keep_alive
        self.reason = cuda_kernels_unavailable_reason() if require_cuda else None
        self._backend = backend if backend is not None else (KinetoBackend() if self.reason is None else None)
        self._k = 0
        self._current: Optional[_Window] = None
        self._open: list[_Window] = []        # windows whose events are still in the live session
        self.max_pending = max_pending
        self.restarts = 0
        self.notes: list[str] = []
        self._lock = threading.Lock()

    @classmethod
    def shared(cls) -> KernelCollector:
        """The process-wide collector (so always-on cells share one session)."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    @property
    def available(self) -> bool:
        return self.reason is None and self._backend is not None

    @property
    def running(self) -> bool:
        return bool(self._backend is not None and self._backend.running)

    def start(self) -> None:
        """Start the Kineto session if it is not running (idempotent)."""
        if not self.available or self.running or self._backend is None:
            return
        self._backend.start()

    # -- windows -------------------------------------------------------------------
    def begin_window(self) -> None:
        """Open the window of one traced cell (called before the trace's ``t0``)."""
        if not self.available:
            return
        with self._lock:
            self.start()
            self._k += 1
            w = _Window(self._k, None)
            w.begin_perf = _marker(w.begin_name)
            self._current = w

    def _close_current(self, devices: Iterable[int] = ()) -> Optional[_Window]:
        w, self._current = self._current, None
        if w is None:
            return None
        _synchronize(devices)   # every kernel of the cell has finished before the end marker
        w.end_perf = _marker(w.end_name)
        self._open.append(w)
        return w

    def end_window_deferred(self, t0_ns: int, ops, devices: Iterable[int] = ()) -> Optional[PendingKernels]:
        """Close the current window; its kernels are linked at the next harvest. None if no window is open."""
        if not self.available:
            return None
        with self._lock:
            w = self._close_current(devices)
            if w is None:
                return None
            pending = PendingKernels(self, w, t0_ns, OpWindows.from_ops(ops))
            too_many = len(self._open) >= self.max_pending
        if too_many or not self.keep_alive:
            self.flush()
        return pending

    def end_window(self, t0_ns: int, ops) -> tuple[pa.Table, list[str]]:
        """Builder entry point: ``(kernels table, notes)`` for the trace that started at ``t0_ns``
        (``perf_counter_ns()``; ``ops`` times are relative to it), harvested now."""
        if not self.available:
            return S.empty("kernels"), [self.reason or "kernel collection unavailable"]
        pending = self.end_window_deferred(t0_ns, ops, cuda_devices_of(ops))
        if pending is None:
            return S.empty("kernels"), ["kernel collection: no window was open for this trace"]
        return pending.resolve()

    # -- harvest -------------------------------------------------------------------
    def flush(self) -> None:
        """Read every GPU record so far and hand it to the pending windows; restart if kept alive."""
        with self._lock:
            if not self._open or self._backend is None:
                return
            opened, self._open = self._open, []
            current = self._current
            try:
                events = self._backend.stop()
            except Exception as e:
                self.notes.append(f"kernel collection: reading the profiler failed: {type(e).__name__}: {e}")
                events = []
            parsed = split_events(events)
            for w in opened:
                w.events = parsed
            if current is not None:
                # the window still recording lost its begin marker with that session: start it afresh
                self._current = None
            if self.keep_alive or current is not None:
                try:
                    self._backend.start()
                    self.restarts += 1
                    if current is not None:
                        current.begin_perf = _marker(current.begin_name)
                        self._current = current
                except Exception as e:
                    self.notes.append(f"kernel collection: restarting the profiler failed: {type(e).__name__}: {e}")

    def close(self) -> None:
        """Harvest what is pending and end the session (``%tensorscope off``)."""
        self.keep_alive = False
        self.flush()
        if self._backend is not None and self._backend.running:
            try:
                self._backend.stop()
            except Exception:
                pass
        if KernelCollector._shared is self:
            KernelCollector._shared = None

    def _link_window(self, w: _Window, t0_ns: int, ops: OpWindows) -> tuple[pa.Table, list[str]]:
        ev = w.events
        notes: list[str] = []
        if ev is None:
            return S.empty("kernels"), ["kernel collection: the window was never harvested"]
        pb = _calibration_point(ev.markers.get(w.begin_name), w.begin_perf)
        pe = _calibration_point(ev.markers.get(w.end_name), w.end_perf)
        pts = [p for p in (pb, pe) if p is not None]
        clock = ClockMap(pts, t0_ns) if pts else ClockMap.from_wall_clock(t0_ns)
        if not pts:
            notes.append("kernel timeline: no calibration markers in the profiler trace; used the wall-clock offset")
        # this window's share of the session: activities whose launch lies between its markers
        lo = hi = None
        if w.begin_perf:
            lo = ev.markers[w.begin_name][0] if ev.markers.get(w.begin_name) else clock.inverse(w.begin_perf[0][0])
        if w.end_perf:
            hi = ev.markers[w.end_name][-1] if ev.markers.get(w.end_name) else clock.inverse(w.end_perf[-1][1])
        launches = ev.launches
        by_corr = {ln.correlation_id: ln for ln in launches}
        mine = []
        for k in ev.kernels:
            ln = by_corr.get(k.correlation_id)
            t = ln.start_ns if ln is not None else k.start_ns
            if (lo is None or t >= lo) and (hi is None or t <= hi):
                mine.append(k)
        window = (clock(lo), clock(hi)) if (lo is not None and hi is not None) else None
        table, warns = link_kernels(mine, ops, launches, clock=clock, window=window, cpu_ops=ev.cpu_ops)
        if table.num_rows == 0:
            notes.append("no CUDA kernels ran in this trace")
        return table, notes + warns


def cuda_devices_of(ops) -> list[int]:
    """CUDA device indexes named in an ops table's device columns (so only those are synchronised)."""
    out = set()
    if isinstance(ops, pa.Table) and ops.num_rows:
        import pyarrow.compute as pc

        for col in ("in_devices", "out_devices"):
            if col in ops.column_names:
                for d in pc.unique(pc.list_flatten(ops.column(col))).to_pylist():
                    if d and d.startswith("cuda"):
                        _, _, idx = d.partition(":")
                        out.add(int(idx) if idx else 0)
    return sorted(out)


def _synchronize(devices: Iterable[int]) -> None:
    try:
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return
        devs = set(devices)
        devs.add(torch.cuda.current_device())
        for d in sorted(devs):
            torch.cuda.synchronize(d)
    except Exception:
        pass  # a sticky user error: the window closes anyway and the checks flag late kernels
