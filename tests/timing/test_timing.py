"""Timing: CPU op times against the cell's wall time, CUDA event-pair bookkeeping, kernel linking.

No GPU here or in CI. The CUDA event tests inject a fake event class (they
mock CUDA because no device is present: they test our bookkeeping, not the
driver). The kernel tests use a *real* Kineto CPU session (real markers,
real ATen op events, real clock conversion) and add synthetic kernel and
launch events where a GPU would have produced them. Tests that need a real
device are skipped with a reason.
"""
from __future__ import annotations

import time

import pyarrow as pa
import pytest
import torch

import tensorscope
from tensorscope import schema as S
from tensorscope.timing import kernels as K
from tensorscope.timing.cuda import CudaOpTimer
from tensorscope.timing.kernel_link import ClockMap, KernelRecord, LaunchRecord, OpWindows, link_kernels
from tensorscope.timing.kernels import KernelCollector, KinetoBackend, split_events

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine/CI)")


# ---------------------------------------------------------------------------------------------
# CPU time per op
# ---------------------------------------------------------------------------------------------

def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5))


def test_cpu_op_times_fit_in_the_wall_time_of_the_trace():
    m = _model()
    x = torch.randn(2, 3, 8, 8)
    m(x).sum().backward()           # warm: first calls initialise kernels lazily
    w0 = time.perf_counter_ns()
    with tensorscope.trace() as t:
        m(x).sum().backward()
        time.sleep(0.1)             # a gap with no op: must not be charged to any op
        torch.relu(x)
    outer = time.perf_counter_ns() - w0
    ops = t.ops.to_pydict()
    wall = t.metadata["wall_ns"]
    assert 0 < wall <= outer
    assert len(ops["seq"]) > 10
    starts, durs = ops["start_ns"], ops["cpu_ns"]
    assert all(s is not None and s >= 0 for s in starts)
    assert all(d is not None and d >= 0 for d in durs)
    # ops are flat (a dispatch mode never sees nested ops): in order and non-overlapping
    for i in range(1, len(starts)):
        assert starts[i] >= starts[i - 1] + durs[i - 1]
    assert starts[-1] + durs[-1] <= wall
    assert sum(durs) <= wall
    # the sleep shows up as a gap before the last op (relu), not inside an op (time.sleep sleeps at
    # least that long: a lower bound that holds on any machine; how long an op takes is no test's business)
    assert starts[-1] - (starts[-2] + durs[-2]) >= 100_000_000
    assert ops["cuda_ns"] == [None] * len(starts)       # no CUDA: null, never 0


# ---------------------------------------------------------------------------------------------
# CUDA event pairs (mocked CUDA: no device here)
# ---------------------------------------------------------------------------------------------

class FakeStream:
    """A GPU stream as a clock: work enqueued on it advances its time."""

    def __init__(self, sid):
        self.sid = sid
        self.now_ns = 0

    def run(self, ns):
        self.now_ns += ns


class FakeEvent:
    created = 0

    def __init__(self):
        FakeEvent.created += 1
        self.t = None
        self.stream = None

    def record(self, stream):
        self.t = stream.now_ns
        self.stream = stream

    def elapsed_time(self, other):
        if self.t is None or other.t is None:
            raise RuntimeError("event not recorded")
        return (other.t - self.t) / 1e6   # ms, as torch.cuda.Event does


class FakeTensor:
    def __init__(self, device):
        self.is_cuda = device is not None
        self._d = device

    def get_device(self):
        return self._d if self._d is not None else -1


class FakeCuda:
    def __init__(self):
        self.streams = {0: FakeStream(7), 1: FakeStream(13)}
        self.current = {0: self.streams[0], 1: self.streams[1]}
        self.syncs = []
        self.capturing = False
        self.fail_sync = False

    def timer(self, **kw):
        FakeEvent.created = 0
        return CudaOpTimer(event_factory=FakeEvent, current_stream=lambda d: self.current[d],
                           synchronize=self.sync, is_capturing=lambda d: self.capturing, **kw)

    def sync(self, d):
        if self.fail_sync:
            raise RuntimeError("CUDA error: device-side assert triggered")
        self.syncs.append(d)


def test_cuda_pairs_resolve_once_with_one_synchronize_per_device():
    cu = FakeCuda()
    timer = cu.timer()
    a, b = FakeTensor(0), FakeTensor(1)
    for seq, (t, ns) in enumerate([(a, 1000), (a, 2500), (b, 400), (a, 7)]):
        tok = timer.begin_for(seq, [FakeTensor(None), t])
        cu.streams[t.get_device()].run(ns)          # the op's kernels
        timer.end(tok)
        assert cu.syncs == []                        # never synchronises per op
    assert timer.pending == 4
    out = timer.resolve()
    assert out == {0: 1000, 1: 2500, 2: 400, 3: 7}
    assert sorted(cu.syncs) == [0, 1]                # one per device used
    assert timer.pending == 0 and timer.resolve() == {}


def test_cuda_cpu_only_inputs_are_not_timed_but_device_kwarg_is():
    cu = FakeCuda()
    timer = cu.timer()
    assert timer.begin_for(0, [FakeTensor(None), FakeTensor(None)]) is None
    assert timer.begin_for(1, []) is None
    tok = timer.begin_for(2, [], {"device": torch.device("cuda", 1)})   # factory op: torch.zeros(device="cuda:1")
    assert tok is not None and tok[4] == 1
    cu.streams[1].run(50)
    timer.end(tok)
    assert timer.resolve() == {2: 50}


def test_cuda_end_is_recorded_on_the_ops_stream_even_if_the_current_stream_changed():
    cu = FakeCuda()
    timer = cu.timer()
    side = FakeStream(99)
    tok = timer.begin(0, 0)                 # op starts on stream 7
    cu.current[0] = side                    # something inside switched the current stream
    side.run(10_000_000)                    # unrelated work on the side stream
    cu.streams[0].run(300)
    timer.end(tok)
    tok2 = timer.begin(1, 0)                # the next op runs on the side stream
    side.run(40)
    timer.end(tok2)
    out = timer.resolve()
    assert out == {0: 300, 1: 40}


def test_cuda_op_that_raised_before_end_has_no_time_and_others_survive():
    cu = FakeCuda()
    timer = cu.timer()
    t0 = timer.begin(0, 0)
    cu.streams[0].run(100)
    timer.end(t0)
    timer.begin(1, 0)                        # raised: end never ran
    t2 = timer.begin(2, 0)
    cu.streams[0].run(5)
    timer.end(t2)
    bad = timer.begin(3, 0)
    bad[2] = FakeEvent()                     # an end event that was never recorded
    out = timer.resolve()
    assert out == {0: 100, 2: 5}
    assert any("no CUDA time" in n for n in timer.notes)


def test_cuda_failed_synchronize_gives_no_times_and_no_exception():
    cu = FakeCuda()
    timer = cu.timer()
    tok = timer.begin(0, 0)
    timer.end(tok)
    cu.fail_sync = True
    assert timer.resolve() == {}
    assert "device-side assert" in timer.notes[-1]


def test_cuda_nothing_recorded_while_capturing_a_graph_and_begin_never_raises():
    cu = FakeCuda()
    timer = cu.timer()
    cu.capturing = True
    assert timer.begin(0, 0) is None

    class Broken:
        @property
        def is_cuda(self):
            raise RuntimeError("wrapper subclass without device")

    cu.capturing = False
    assert timer.begin_for(1, [Broken()]) is None
    assert timer.notes and "begin failed" in timer.notes[-1]


def test_cuda_events_are_recycled_across_resolves_and_bounded():
    cu = FakeCuda()
    timer = cu.timer(max_pending=3)
    for _round in range(3):
        for seq in range(5):
            timer.end(timer.begin_for(seq, [FakeTensor(0)]))
        timer.resolve()
    # 3 pairs per round at most (max_pending), and round 2+ reuse round 1's events
    assert FakeEvent.created == 6
    assert any("not timed" in n for n in timer.notes)


@needs_cuda
def test_cuda_real_device_op_times():
    x = torch.randn(256, 256, device="cuda")
    with tensorscope.trace() as t:
        (x @ x).relu().sum()
    cuda_ns = t.ops.column("cuda_ns").to_pylist()
    assert all(v is not None and v >= 0 for v in cuda_ns)


# ---------------------------------------------------------------------------------------------
# kernel linking: pure function on synthetic records
# ---------------------------------------------------------------------------------------------

def _ops_windows():
    # seq: [start, end) on the trace clock
    return OpWindows.from_ops(([0, 1, 2], [1_000, 5_000, 20_000], [3_000, 10_000, 1_000]))


def test_link_kernels_by_correlation_with_clock_offset_and_checks():
    off = 10**15          # Kineto ns = trace ns + off
    clock = lambda k: k - off  # noqa: E731
    launches = [LaunchRecord("cudaLaunchKernel", off + 2_000, off + 2_500, 101),
                LaunchRecord("cudaLaunchKernel", off + 6_000, off + 6_400, 102),
                LaunchRecord("cuLaunchKernelEx", off + 14_000, off + 14_300, 103),
                LaunchRecord("cudaMemcpyAsync", off + 20_500, off + 20_700, 104),
                LaunchRecord("cudaLaunchKernel", off + 30_000, off + 30_100, 105)]
    ks = [KernelRecord("gemm", 0, 7, off + 3_000, off + 9_000, 101, grid=(4, 1, 1), block=(128, 1, 1)),
          KernelRecord("relu", 0, 7, off + 9_000, off + 9_500, 102),
          KernelRecord("late_stamp", 0, 13, off + 10_000, off + 10_200, 103),       # before its launch
          KernelRecord("Memcpy DtoH", 0, 7, off + 21_000, off + 22_000, 104, kind="memcpy"),
          KernelRecord("probe", 0, 7, off + 30_500, off + 30_600, 105),             # launched between ops
          KernelRecord("notime", 0, 7, 0, 0, 106),                                 # CUPTI: no timestamps
          KernelRecord("outside", 0, 7, off + 10**9, off + 10**9 + 5, 102)]
    table, warns = link_kernels(ks, _ops_windows(), launches, clock=clock, window=(0, 1_000_000))
    assert table.schema == S.KERNELS
    rows = {r["name"]: r for r in table.to_pylist()}
    assert rows["gemm"]["seq"] == 0 and rows["gemm"]["start_ns"] == 3_000 and rows["gemm"]["dur_ns"] == 6_000
    assert rows["gemm"]["grid"] == [4, 1, 1] and rows["gemm"]["block"] == [128, 1, 1]
    assert rows["relu"]["seq"] == 1 and rows["relu"]["stream"] == 7
    assert rows["late_stamp"]["seq"] == 1 and rows["late_stamp"]["start_ns"] is None
    assert rows["Memcpy DtoH"]["seq"] == 2 and rows["Memcpy DtoH"]["grid"] is None
    assert rows["probe"]["seq"] is None and rows["probe"]["start_ns"] == 30_500
    assert rows["notime"]["start_ns"] is None and rows["notime"]["dur_ns"] is None and rows["notime"]["seq"] is None
    assert rows["outside"]["start_ns"] is None
    # placed kernels first, in start order
    starts = table.column("start_ns").to_pylist()
    placed = [s for s in starts if s is not None]
    assert placed == sorted(placed) and starts[:len(placed)] == placed
    text = " | ".join(warns)
    for frag in ("stamped before their own launch", "no timestamps", "outside the cell's time window",
                 "no launch event", "outside every traced op"):
        assert frag in text, frag


def test_link_kernels_falls_back_to_the_linked_aten_op_event():
    cpu_ops = [LaunchRecord("aten::addmm", 5_200, 9_800, 77, kind="cpu_op")]
    ks = [KernelRecord("gemm", 0, 7, 9_000, 9_900, 555, linked_id=77)]
    table, warns = link_kernels(ks, _ops_windows(), [], cpu_ops=cpu_ops)
    assert table.column("seq").to_pylist() == [1]
    assert warns == []


def test_link_kernels_empty_inputs():
    table, warns = link_kernels([], ([], [], []), [])
    assert table.num_rows == 0 and table.schema == S.KERNELS and warns == []


def test_op_windows_from_a_real_ops_table_and_clock_map():
    w = OpWindows.from_ops(pa.table({"seq": [0, 1], "start_ns": [10, 30], "cpu_ns": [5, 5]}, ))
    assert w.find(12) == 0 and w.find(15) is None and w.find(34) == 1 and w.find(9) is None
    c = ClockMap([(1000, 50, 2)], t0_ns=20)
    assert c(1000) == 30 and c(1010) == 40 and c.inverse(60) == 1010
    # far-apart tight points: a slope is fitted (a 100 ppm clock rate difference)
    c2 = ClockMap([(0, 0, 2), (10**10, 10**10 + 10**6, 2)])
    assert c2(5 * 10**9) == 5 * 10**9 + 5 * 10**5
    # close points: jitter would dominate, offset only
    c3 = ClockMap([(0, 0, 2000), (10**6, 10**6 + 500, 2000)])
    assert c3.slope == 1.0


class FakeKinetoEvent:
    """Duck-typed ``_KinetoEvent`` for GPU activities a CPU machine cannot produce."""

    def __init__(self, name, at, start, end, corr, linked=0, device=0, stream=7, meta=""):
        self._v = dict(name=name, at=at, start=start, end=end, corr=corr, linked=linked, device=device,
                       stream=stream, meta=meta)

    def name(self): return self._v["name"]
    def activity_type(self): return self._v["at"]
    def start_ns(self): return self._v["start"]
    def end_ns(self): return self._v["end"]
    def correlation_id(self): return self._v["corr"]
    def linked_correlation_id(self): return self._v["linked"]
    def device_index(self): return self._v["device"]
    def device_resource_id(self): return self._v["stream"]
    def metadata_json(self): return self._v["meta"]
    def is_async(self): return False


def test_split_events_reads_kineto_shaped_events_and_grid_block_fragments():
    meta = ('"queued": 0, "device": 0, "context": 1, "stream": 7, "correlation": 9, "registers per thread": 32, '
            '"shared memory": 0, "blocks per SM": inf, "warps per SM": nan, "grid": [80, 2, 1], "block": [256, 1, 1], '
            '"est. achieved occupancy %": 0')
    evs = [FakeKinetoEvent("ampere_sgemm", "kernel", 100, 200, 9, linked=3, meta=meta),
           FakeKinetoEvent("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 50, 90, 8),
           FakeKinetoEvent("cudaLaunchKernel", "cuda_runtime", 40, 45, 9, linked=3),
           FakeKinetoEvent(K.MARKER + "#1:begin", "cpu_op", 10, 10, 1),
           FakeKinetoEvent(K.MARKER + "#1:begin", "cpu_op", 12, 12, 2),
           FakeKinetoEvent("aten::mm", "cpu_op", 30, 60, 3)]
    ev = split_events(evs)
    assert [k.name for k in ev.kernels] == ["ampere_sgemm", "Memcpy HtoD (Pageable -> Device)"]
    assert ev.kernels[0].grid == (80, 2, 1) and ev.kernels[0].block == (256, 1, 1)
    assert ev.kernels[1].kind == "memcpy" and ev.kernels[1].grid is None
    assert [ln.name for ln in ev.launches] == ["cudaLaunchKernel"]
    assert ev.markers == {K.MARKER + "#1:begin": [10, 12]}
    assert [c.name for c in ev.cpu_ops] == ["aten::mm"]


# ---------------------------------------------------------------------------------------------
# kernel linking on a recorded (real) Kineto CPU session
# ---------------------------------------------------------------------------------------------

class GpuLikeBackend(KinetoBackend):
    """A real Kineto CPU session; on stop, a fake GPU adds one kernel per mm/addmm/convolution CPU event.

    The kernel's launch (a runtime event) sits in the middle of the real ATen
    op event and the kernel starts 3 µs later, all on Kineto's real clock, so
    linking must go through the real calibration markers to find our op.
    """

    GPU_OPS = ("aten::addmm", "aten::mm", "aten::convolution")

    def __init__(self, corrupt_first=False):
        super().__init__(cuda=False, cpu=True)
        self.corrupt_first = corrupt_first
        self.made = []

    def stop(self):
        events = super().stop()
        extra = []
        corr = 1_000_000
        cands = [e for e in events if e.name() in self.GPU_OPS and e.activity_type() == "cpu_op"]
        # under a dispatch mode the profiler sees each op twice (the Python-mode entry and the real kernel
        # call inside it); only the innermost one launches GPU work
        inner = [e for e in cands if not any(o is not e and e.start_ns() <= o.start_ns() and o.end_ns() <= e.end_ns()
                                             for o in cands)]
        for e in inner:
            corr += 1
            mid = (e.start_ns() + e.end_ns()) // 2
            kstart = mid + 3_000
            if self.corrupt_first and not self.made:
                kstart = e.start_ns() - 10**8        # the pytorch#192021 symptom
            extra.append(FakeKinetoEvent("cudaLaunchKernel", "cuda_runtime", mid, mid + 500, corr,
                                         linked=e.correlation_id()))
            extra.append(FakeKinetoEvent(f"kernel_for_{e.name()}", "kernel", kstart, kstart + 2_000, corr,
                                         linked=e.correlation_id(), meta='"grid": [1, 2, 3], "block": [32, 1, 1]'))
            self.made.append(e.name())
        return events + extra


@pytest.fixture
def cpu_collector(monkeypatch):
    made = []

    def factory(**kw):
        c = KernelCollector(backend=GpuLikeBackend(**kw), require_cuda=False)
        made.append(c)
        monkeypatch.setattr(KernelCollector, "shared", classmethod(lambda cls: c))
        return c

    yield factory
    for c in made:
        c.close()


def test_kernels_link_to_their_ops_through_a_real_kineto_session(cpu_collector):
    c = cpu_collector()
    m = _model()
    x = torch.randn(2, 3, 8, 8)
    with tensorscope.trace(kernels=True) as t:
        m(x).sum().backward()
    k = t.kernels
    assert k.schema == S.KERNELS
    assert k.num_rows == len(c._backend.made) >= 3          # conv fwd, addmm fwd, mm(s) in backward
    ops = {r["seq"]: r["op"] for r in t.ops.select(["seq", "op"]).to_pylist()}
    for r in k.to_pylist():
        assert r["seq"] is not None, r
        want = r["name"].replace("kernel_for_aten::", "")
        assert ops[r["seq"]].split(".")[1] in (want, "convolution", "convolution_backward"), (r, ops[r["seq"]])
        assert r["grid"] == [1, 2, 3]
        assert 0 <= r["start_ns"] <= t.metadata["wall_ns"]
        op = t.ops.filter(pa.compute.equal(t.ops.column("seq"), r["seq"])).to_pylist()[0]
        # the kernel starts 3 µs after a launch in the middle of the op (calibration error is a few µs)
        assert op["start_ns"] - 20_000 <= r["start_ns"] <= op["start_ns"] + op["cpu_ns"] + 20_000
    assert not any("kernel" in n and "stamped" in n for n in t.metadata["notes"])


def test_a_kernel_stamped_before_its_launch_becomes_a_warning_not_a_wrong_bar(cpu_collector):
    cpu_collector(corrupt_first=True)
    m = torch.nn.Linear(8, 8)
    with tensorscope.trace(kernels=True) as t:
        m(torch.randn(4, 8))
    k = t.kernels.to_pylist()
    assert len(k) == 1 and k[0]["start_ns"] is None and k[0]["seq"] is not None
    assert any("stamped before their own launch" in n for n in t.metadata["notes"])


def test_keep_alive_collector_harvests_many_windows_with_one_restart():
    c = KernelCollector(backend=GpuLikeBackend(), require_cuda=False, keep_alive=True)
    try:
        pendings = []
        for _ in range(3):
            c.begin_window()
            t0 = time.perf_counter_ns()
            a = torch.randn(16, 16)
            s = time.perf_counter_ns()
            a @ a
            e = time.perf_counter_ns()
            pendings.append(c.end_window_deferred(t0, ([0], [s - t0], [e - s])))
        assert c.running and not any(p.ready for p in pendings) and c.restarts == 0
        results = [p.resolve() for p in pendings]
        assert c.restarts == 1 and c.running
        for table, notes in results:
            # each window got exactly its own kernel, linked to its one op
            assert table.column("seq").to_pylist() == [0], notes
            assert table.column("start_ns").null_count == 0
    finally:
        c.close()
    assert not c.running


def test_cpu_only_collector_gives_an_empty_table_and_a_note():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the CPU-only path does not apply")
    c = KernelCollector()
    assert not c.available and "CPU-only" in c.reason
    c.begin_window()
    table, notes = c.end_window(0, S.empty("ops"))
    assert table.num_rows == 0 and table.schema == S.KERNELS
    assert notes and "CPU-only" in notes[0]
    with tensorscope.trace(kernels=True) as t:
        torch.ones(2) + 1
    assert t.kernels.num_rows == 0
    assert any("CPU-only" in n for n in t.metadata["notes"])


@needs_cuda
def test_real_cuda_kernels_are_collected_and_linked():
    x = torch.randn(128, 128, device="cuda")
    with tensorscope.trace(kernels=True) as t:
        (x @ x).relu()
    k = t.kernels
    assert k.num_rows >= 2
    assert k.column("seq").null_count < k.num_rows
