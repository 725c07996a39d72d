"""CUDA kernels from Kineto/CUPTI (``torch.profiler``'s backend) and their link to the op that launched them.

Role: fill the ``kernels`` table (schema.KERNELS): one row per GPU activity
(kernels, and memcpy/memset, whose names say what they are) with device,
stream, start, duration, grid/block and the ``seq`` of the ``ops`` row whose
CPU window contains the kernel's launch.

Pieces
------
``link_kernels(kernel_events, op_windows, launch_events, *, clock, window, ...)``
    Pure: ``(pyarrow.Table in the KERNELS schema, [warning strings])``.
    A kernel's CUPTI ``correlation_id`` equals that of the runtime/driver
    call that launched it (``cudaLaunchKernel``, ``cuLaunchKernelEx``,
    ``cudaMemcpyAsync``...). The launch's CPU start time, mapped onto our
    clock, falls inside exactly one op's ``[start_ns, start_ns + cpu_ns)``
    (dispatch-mode ops do not nest), which gives ``seq``. When the runtime
    event is missing, the kernel's ``linked_correlation_id`` (the external id
    Kineto pushes for the enclosing ATen op) and that op's CPU event are used.
    Timestamps are checked: a kernel must start after its launch, end after it
    starts, have non-zero timestamps (CUPTI's "no timing") and lie inside the
    cell window. A failing kernel keeps its row (name, seq, stream) with a
    null ``start_ns`` so no timeline draws it at a wrong place, and the check
    yields a warning string (the builder puts these in the trace notes).

``KernelCollector``
    Owns the Kineto session. ``KernelCollector.shared()`` is the process-wide
    one used by ``trace(kernels=True)``: ``begin_window()`` at trace start,
    ``end_window(t0_ns, ops) -> (table, notes)`` when the trace is built.
    ``keep_alive=True`` (always-on mode) keeps the session running across
    cells instead of starting and stopping Kineto per cell: every start
    re-registers CUPTI's timestamp callback, and each re-registration
    corrupts the first kernel records of the next session (pytorch#192021:
    kernels stamped before their own launch, then dropped as out of range),
    while stopping per cell also loses kernels still queued at the boundary.
    torch (<= 2.13) has no way to read Kineto's buffers without ending the
    session (``_enable_profiler`` without a new ``_prepare_profiler`` crashes,
    measured here), so a kept-alive session is *harvested* rather than
    stopped per cell: ``end_window_deferred()`` returns a ``PendingKernels``
    whose ``resolve()`` harvests once for every window still pending (and
    restarts the session), so N cells cost one restart, not N. ``flush()``
    harvests now; ``close()`` ends the session.

Clock conversion (documented because every link depends on it)
---------------------------------------------------------------
``_KinetoEvent.start_ns()`` is Unix-epoch nanoseconds: torch stamps CPU
events with its approximate clock (TSC) and converts them with
``ApproximateClockToUnixTimeConverter``; Kineto's CUPTI timestamp callback
puts GPU records on the same base. ``torch.autograd.profiler`` itself only
subtracts ``result.trace_start_ns()`` to get relative times. Our ops'
``start_ns`` are ``time.perf_counter_ns()`` (CLOCK_MONOTONIC) minus the
trace's ``t0``. We calibrate per window with two marker events
(``torch._C._profiler._RecordFunctionFast``, which is not a dispatcher op
so the dispatch mode never sees it) emitted at window begin and end with
``perf_counter_ns`` read just before and after each: the marker's Kineto
start lies in that bracket, giving two ``(kineto_ns, perf_ns)`` points; the
map is the line through them (it absorbs the REALTIME/MONOTONIC offset and
any NTP slew between the two). With one marker it is an offset; without
markers (CPU activity off) ``time.time_ns() - time.perf_counter_ns()``,
sampled in the tightest of a few brackets, is the offset.
"""
from __future__ import annotations

import bisect
import re
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import pyarrow as pa

from .. import schema as S

__all__ = [
    "KernelRecord", "LaunchRecord", "ProfilerEvents", "OpWindows", "ClockMap", "split_events", "link_kernels",
    "KernelCollector", "PendingKernels", "KinetoBackend", "cuda_kernels_unavailable_reason", "MARKER",
]

#: name prefix of our calibration markers in the Kineto trace
MARKER = "tensorscope::window"

_KERNEL_TYPES = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
_RUNTIME_TYPES = {"cuda_runtime", "cuda_driver", "privateuse1_runtime", "privateuse1_driver"}
_GRID_RE = re.compile(r'"grid"\s*:\s*\[\s*([0-9]+)\s*,\s*([0-9]+)\s*,\s*([0-9]+)\s*\]')
_BLOCK_RE = re.compile(r'"block"\s*:\s*\[\s*([0-9]+)\s*,\s*([0-9]+)\s*,\s*([0-9]+)\s*\]')


class KernelRecord(NamedTuple):
    """One GPU activity, times in the profiler's clock (Kineto ns)."""
    name: str
    device: int
    stream: int
    start_ns: int
    end_ns: int
    correlation_id: int          # CUPTI correlation id, shared with the launching runtime call
    linked_id: int = 0           # external id: correlation id of the enclosing ATen op's CPU event
    grid: Optional[Tuple[int, int, int]] = None
    block: Optional[Tuple[int, int, int]] = None
    kind: str = "kernel"         # kernel / memcpy / memset


class LaunchRecord(NamedTuple):
    """A CPU-side event that can launch GPU work (runtime/driver call, or an ATen op's CPU event)."""
    name: str
    start_ns: int
    end_ns: int
    correlation_id: int
    linked_id: int = 0
    kind: str = "runtime"        # runtime / cpu_op


class ProfilerEvents(NamedTuple):
    kernels: List[KernelRecord]
    launches: List[LaunchRecord]          # runtime / driver calls
    cpu_ops: List[LaunchRecord]           # CPU op events (fallback link through linked ids)
    markers: Dict[str, List[int]]         # our marker name -> Kineto start ns of each emission, in order


class OpWindows(NamedTuple):
    """Ops' CPU windows on the trace clock (ns since the trace's t0), sorted by start."""
    seq: List[int]
    start: List[int]
    end: List[int]

    @classmethod
    def from_ops(cls, ops) -> "OpWindows":
        """From an ``ops`` table (``seq``, ``start_ns``, ``cpu_ns``) or a ``(seq, start_ns, cpu_ns)`` triple."""
        if isinstance(ops, OpWindows):
            return ops
        if isinstance(ops, pa.Table):
            if ops.num_rows == 0:
                return cls([], [], [])
            seq = ops.column("seq").to_pylist()
            start = ops.column("start_ns").to_pylist()
            dur = ops.column("cpu_ns").to_pylist()
        else:
            seq, start, dur = (list(x) for x in ops)
        rows = sorted((s, q, (s + (d or 0))) for q, s, d in zip(seq, start, dur) if s is not None)
        return cls([r[1] for r in rows], [r[0] for r in rows], [r[2] for r in rows])

    def find(self, t: int) -> Optional[int]:
        """``seq`` of the op whose ``[start, end)`` contains ``t``, else None."""
        i = bisect.bisect_right(self.start, t) - 1
        if i >= 0 and t < self.end[i]:
            return self.seq[i]
        return None


class ClockMap:
    """Kineto ns -> trace ns (``perf_counter_ns() - t0``): a line through calibration points.

    ``points`` are ``(kineto_ns, perf_ns)`` or ``(kineto_ns, perf_ns, bracket_ns)``
    where ``bracket_ns`` is the width of the perf bracket around the marker
    (its uncertainty). A slope is fitted only when the points are far enough
    apart for the brackets to matter less than ~1 ppm; otherwise the map is an
    offset taken at the tightest point.
    """

    __slots__ = ("k0", "p0", "slope", "t0")

    def __init__(self, points: Sequence[Tuple[int, ...]], t0_ns: int = 0):
        pts = sorted((p[0], p[1], p[2] if len(p) > 2 else 0) for p in points)
        if not pts:
            raise ValueError("ClockMap needs at least one (kineto_ns, perf_ns) point")
        tight = min(pts, key=lambda p: p[2])
        self.k0, self.p0 = tight[0], tight[1]
        self.slope = 1.0
        if len(pts) >= 2:
            (ka, pa_, wa), (kb, pb, wb) = pts[0], pts[-1]
            span = kb - ka
            if span > 0 and (wa + wb) * 1_000_000 <= span:
                self.k0, self.p0 = ka, pa_
                self.slope = (pb - pa_) / span
        self.t0 = t0_ns

    @classmethod
    def from_wall_clock(cls, t0_ns: int = 0) -> "ClockMap":
        """The REALTIME - MONOTONIC offset, read in the tightest of a few brackets."""
        best = None
        for _ in range(5):
            a = time.perf_counter_ns()
            w = time.time_ns()
            b = time.perf_counter_ns()
            if best is None or b - a < best[0]:
                best = (b - a, w, (a + b) // 2)
        assert best is not None
        return cls([(best[1], best[2], best[0])], t0_ns)

    def __call__(self, kineto_ns: int) -> int:
        return int(round(self.p0 + (kineto_ns - self.k0) * self.slope)) - self.t0

    def inverse(self, perf_ns: int) -> int:
        """Absolute ``perf_counter_ns`` back to Kineto ns."""
        return int(round(self.k0 + (perf_ns - self.p0) / self.slope))

    @property
    def offset_ns(self) -> int:
        """perf_counter_ns - kineto_ns at the reference point."""
        return self.p0 - self.k0


def _ints3(m) -> Optional[Tuple[int, int, int]]:
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def _grid_block(metadata_json: str):
    # Kineto's metadata is a JSON *fragment* (no braces) and may hold non-JSON values (inf, nan): regex, not json
    if not metadata_json:
        return None, None
    return _ints3(_GRID_RE.search(metadata_json)), _ints3(_BLOCK_RE.search(metadata_json))


def split_events(events: Iterable[Any], marker_prefix: str = MARKER) -> ProfilerEvents:
    """Sort ``_KinetoEvent``-like objects (``result.events()``) into kernels, launches, CPU ops and markers."""
    kernels: List[KernelRecord] = []
    launches: List[LaunchRecord] = []
    cpu_ops: List[LaunchRecord] = []
    markers: Dict[str, List[int]] = {}
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


def _check_counts():
    return {"no_timestamps": [0, None], "before_launch": [0, None], "end_before_start": [0, None],
            "outside_window": [0, None], "no_launch": [0, None], "outside_ops": [0, None]}


_CHECK_TEXT = {
    "no_timestamps": "kernel(s) have no timestamps (CUPTI could not time them); their start/duration are null",
    "before_launch": "kernel(s) are stamped before their own launch (a corrupted CUPTI timestamp, cf. pytorch#192021); "
                     "their start is null so the timeline does not show them at a wrong place",
    "end_before_start": "kernel(s) end before they start; their start/duration are null",
    "outside_window": "kernel(s) fall outside the cell's time window; their start is null",
    "no_launch": "kernel(s) have no launch event in the profiler trace; they are not linked to an op",
    "outside_ops": "kernel(s) were launched outside every traced op (tracer probes or untraced threads); seq is null",
}


def link_kernels(kernel_events: Sequence[KernelRecord], op_windows, launch_events: Sequence[LaunchRecord], *,
                 clock: Optional[Callable[[int], int]] = None, window: Optional[Tuple[int, int]] = None,
                 cpu_ops: Sequence[LaunchRecord] = (), tolerance_ns: int = 2_000) -> Tuple[pa.Table, List[str]]:
    """Link GPU activities to ops and check their timestamps (pure function).

    kernel_events: ``KernelRecord``s (Kineto clock). op_windows: ``OpWindows``,
    an ``ops`` table or a ``(seq, start_ns, cpu_ns)`` triple, on the trace
    clock. launch_events: runtime/driver ``LaunchRecord``s (Kineto clock).
    clock: Kineto ns -> trace ns (a ``ClockMap``; identity when None).
    window: the cell's ``(start, end)`` on the trace clock, after the final
    synchronise; kernels outside it fail the check. cpu_ops: CPU op events
    for the ``linked_id`` fallback. tolerance_ns: slack of every timestamp
    check (clock conversion jitter). Returns the KERNELS table, sorted by
    start (unplaced kernels last), and human-readable warnings.
    """
    conv = clock or (lambda k: k)
    ops = OpWindows.from_ops(op_windows)
    by_corr: dict = {}
    for launch in launch_events:
        by_corr.setdefault(launch.correlation_id, launch)
    cpu_by_corr = None
    counts = _check_counts()

    def bad(what, name):
        c = counts[what]
        c[0] += 1
        if c[1] is None:
            c[1] = name

    rows: Dict[str, list] = {f: [] for f in ("seq", "name", "device", "stream", "start_ns", "dur_ns", "grid", "block", "correlation_id")}
    for k in kernel_events:
        start, end = k.start_ns, k.end_ns
        launch_t = None
        launch_start_k = None
        ln = by_corr.get(k.correlation_id) if k.correlation_id else None
        if ln is not None:
            launch_start_k = ln.start_ns
            launch_t = conv(ln.start_ns)
        elif k.linked_id:
            if cpu_by_corr is None:
                cpu_by_corr = {c.correlation_id: c for c in cpu_ops}
            op = cpu_by_corr.get(k.linked_id)
            if op is not None:
                launch_start_k = op.start_ns
                # the ATen op's CPU event sits inside our op's window; its midpoint is safely inside
                launch_t = conv((op.start_ns + op.end_ns) // 2)
        seq = ops.find(launch_t) if launch_t is not None else None
        if launch_t is None:
            bad("no_launch", k.name)
        elif seq is None:
            bad("outside_ops", k.name)
        rel_start = dur = None
        if start == 0 and end == 0:
            bad("no_timestamps", k.name)
        elif end < start:
            bad("end_before_start", k.name)
        else:
            dur = end - start
            if launch_start_k is not None and start + tolerance_ns < launch_start_k:
                bad("before_launch", k.name)
            else:
                rs = conv(start)
                if window is not None and (rs < window[0] - tolerance_ns or rs + dur > window[1] + tolerance_ns):
                    bad("outside_window", k.name)
                else:
                    rel_start = rs
        rows["seq"].append(seq)
        rows["name"].append(k.name)
        rows["device"].append(k.device)
        rows["stream"].append(k.stream)
        rows["start_ns"].append(rel_start)
        rows["dur_ns"].append(dur)
        rows["grid"].append(list(k.grid) if k.grid else None)
        rows["block"].append(list(k.block) if k.block else None)
        rows["correlation_id"].append(k.correlation_id)
    n = len(rows["name"])
    order = sorted(range(n), key=lambda i: (rows["start_ns"][i] is None, rows["start_ns"][i] or 0, i))
    cols = [pa.array([rows[f.name][i] for i in order], f.type) for f in S.KERNELS]
    table = pa.Table.from_arrays(cols, schema=S.KERNELS)
    warnings = [f"{c} {_CHECK_TEXT[what]} (e.g. {example})" for what, (c, example) in counts.items() if c]
    return table, warnings


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
    tree costs 7-20 µs per op and we need none of it.
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


def _marker(name: str, repeats: int = _MARKER_REPEATS) -> List[Tuple[int, int]]:
    """Emit ``repeats`` zero-length Kineto markers named ``name``; return each one's perf bracket.

    The first emission after a pause is slow (cold caches: ~40 µs measured
    here against ~1.5-2.5 µs warm), so the calibration uses the tightest one.
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


def _calibration_point(starts: Optional[List[int]], brackets: Optional[List[Tuple[int, int]]]):
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
        self.end_perf: Optional[List[Tuple[int, int]]] = None
        self.events: Optional[ProfilerEvents] = None
        self.result = None


class PendingKernels:
    """The kernels of one window, collected at the collector's next harvest.

    ``resolve() -> (pyarrow.Table, notes)`` harvests (once, for every pending
    window) when needed. ``ready`` tells whether it would.
    """

    def __init__(self, collector: "KernelCollector", win: _Window, t0_ns: int, op_windows: OpWindows):
        self._c = collector
        self._w = win
        self._t0 = t0_ns
        self._ops: Optional[OpWindows] = op_windows
        self._result: Optional[Tuple[pa.Table, List[str]]] = None

    @property
    def ready(self) -> bool:
        return self._result is not None or self._w.events is not None

    def resolve(self) -> Tuple[pa.Table, List[str]]:
        if self._result is None:
            if self._w.events is None:
                self._c.flush()
            assert self._ops is not None   # dropped only once the result is kept
            self._result = self._c._link_window(self._w, self._t0, self._ops)
            self._ops = None
        return self._result


class KernelCollector:
    """One Kineto session; windows (one per traced cell) are cut out of it. See the module docstring."""

    _shared: Optional["KernelCollector"] = None
    _shared_lock = threading.Lock()

    def __init__(self, *, keep_alive: bool = False, backend: Any = None, require_cuda: bool = True,
                 max_pending: int = 16):
        self.keep_alive = keep_alive
        self.reason = cuda_kernels_unavailable_reason() if require_cuda else None
        self._backend = backend if backend is not None else (KinetoBackend() if self.reason is None else None)
        self._k = 0
        self._current: Optional[_Window] = None
        self._open: List[_Window] = []        # windows whose events are still in the live session
        self.max_pending = max_pending
        self.restarts = 0
        self.notes: List[str] = []
        self._lock = threading.Lock()

    @classmethod
    def shared(cls) -> "KernelCollector":
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

    def end_window(self, t0_ns: int, ops) -> Tuple[pa.Table, List[str]]:
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

    def _link_window(self, w: _Window, t0_ns: int, ops: OpWindows) -> Tuple[pa.Table, List[str]]:
        ev = w.events
        notes: List[str] = []
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


def cuda_devices_of(ops) -> List[int]:
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
