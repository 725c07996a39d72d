"""Peaks you can trust and one classification consistent with the numbers (no timed asserts).

The classification checks give the peaks explicitly (``advise(t, peaks=...)``), far above or below
anything the machine reaches, so the label follows from the model whatever the load."""
from __future__ import annotations

import os

import pytest
import torch

import tensorscope
from tensorscope import _peaks
from tensorscope.analyses.advisor import advise_tables
from tensorscope.analyses.roofline import ROOF_SHARE
from tensorscope.errors import OptionsError
from tensorscope.options import DisplayOptions
from tests.helpers.synthetic import no_cpu_wait

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _warm_trace(fn, engine="native"):
    with tensorscope.trace(engine=engine, leaks=False):
        fn()
    with tensorscope.trace(engine=engine, leaks=False) as t:
        fn()
    return t


def _wins(t):
    return [{"ops": t.ops, "calls": t.calls, "kernels": t.kernels, "layout_changes": t.layout_changes,
             "wall_ns": t.metadata["wall_ns"], "engine": t.metadata["engine"]}]


def test_the_theoretical_bound_comes_from_the_cpu_flags_and_clock():
    flags, clock, source = _peaks._cpuinfo()
    b = _peaks.theoretical_peaks(threads=1)
    assert b["cores"] == 1 and "FMA" in b["how"]
    if "avx512f" in flags:
        assert b["per_cycle"]["float32"] == 16 * 2 * _peaks.FMA_UNITS
    elif "avx2" in flags and "fma" in flags:
        assert b["per_cycle"]["float32"] == 8 * 2 * _peaks.FMA_UNITS
    if "amx_bf16" in flags:
        assert b["per_cycle"]["bfloat16"] == _peaks.AMX_FLOP_PER_CYCLE
    if clock and b["flops"]:
        turbo = 1.0 if source.startswith("sysfs") else _peaks.TURBO_HEADROOM
        assert b["flops"]["float32"] == pytest.approx(b["per_cycle"]["float32"] * clock * turbo)
        two = _peaks.theoretical_peaks(threads=2)
        if (os.cpu_count() or 1) >= 2:
            assert two["flops"]["float32"] == pytest.approx(2 * b["flops"]["float32"])


def test_peaks_record_sizes_spread_share_and_bound_and_env_shows_them():
    p = tensorscope._peaks.machine_peaks()
    assert p["recipe"] == _peaks.RECIPE
    for dtype in p["flops"]:
        d = p["detail"][dtype]
        assert set(d["sizes"]) == {str(n) for n in _peaks.SIZES}          # the same sizes for every dtype
        assert p["flops"][dtype] == max(s["best"] for s in d["sizes"].values())
        for s in d["sizes"].values():
            assert s["reps"] >= _peaks.MIN_REPS and 0 <= s["spread"] < 1 and s["median"] <= s["best"]
    assert isinstance(p["contended"], bool) and p["cpu_share"] is not None
    text = str(tensorscope.env())
    assert "spread" in text and "theoretical" in text and "how:" in text


def test_a_group_far_below_its_roof_is_below_roof_and_one_at_it_is_compute_bound_capped_at_one():
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    t = no_cpu_wait(_warm_trace(lambda: [torch.mm(a, b) for _ in range(3)]))
    huge = {"cpu": {"flops": {"float32": 1e18}, "bytes_per_s": 1e18, "overhead_ns": None}}   # no per-op floor
    tiny = {"cpu": {"flops": {"float32": 1e6}, "bytes_per_s": 1e6, "overhead_ns": 1.0}}
    (r,) = [r for r in t.advice(peaks=huge).roofline.to_pylist() if r["name"] == "aten.mm.default"]
    assert r["bound"] == "below_roof" and r["roof_fraction"] < ROOF_SHARE
    adv = t.advice(peaks=tiny)
    (r,) = [r for r in adv.roofline.to_pylist() if r["name"] == "aten.mm.default"]
    assert r["bound"] == "compute" and r["roof_fraction"] == 1.0            # never above the roof
    assert any(f["kind"] == "compute_bound" and "100% of the cpu roof" in f["seen"] for f in adv.findings.to_pylist())


def test_amp_needs_compute_bound_fp32_gemms_and_a_faster_16_bit_gemm_of_the_same_shape():
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    t = _warm_trace(lambda: [torch.mm(a, b) for _ in range(3)])
    at_roof = {"cpu": {"flops": {"float32": 1e6}, "bytes_per_s": 1e6, "overhead_ns": 1.0}}
    shapes = []

    def faster(shape):
        shapes.append(shape)
        return ("bfloat16", 3.0, "on a GEMM of the same shape")

    out = advise_tables(_wins(t), at_roof, speedup=faster)
    kinds = out["findings"].column("kind").to_pylist()
    assert "amp" in kinds and shapes == [(1, 512, 512, 512)]
    assert kinds.index("amp") > kinds.index("compute_bound")                 # it rests on the compute-bound rows
    slower = advise_tables(_wins(t), at_roof, speedup=lambda s: ("bfloat16", 1.1, "same shape"))
    assert "amp" not in slower["findings"].column("kind").to_pylist()
    far = {"cpu": {"flops": {"float32": 1e18}, "bytes_per_s": 1e18, "overhead_ns": None}}   # below the roof: no amp
    assert "amp" not in advise_tables(_wins(t), far, speedup=faster)["findings"].column("kind").to_pylist()


def test_tiny_matmuls_are_overhead_and_never_also_amp():
    x, w = torch.randn(32, 128), torch.randn(128, 32)

    def loop():
        for _ in range(300):
            torch.mm(x, w)

    t = _warm_trace(loop)
    # at these peaks each mm's work takes ~36 ns, far under dispatching it (a 2 us floor): overhead by the model
    peaks = {"cpu": {"flops": {"float32": 1e13}, "bytes_per_s": 1e13, "overhead_ns": 2000.0}}
    out = advise_tables(_wins(t), peaks, speedup=lambda s: ("bfloat16", 5.0, "same shape"))
    kinds = out["findings"].column("kind").to_pylist()
    assert "overhead" in kinds and "amp" not in kinds and "compute_bound" not in kinds
    (r,) = [r for r in out["roofline"].to_pylist() if r["name"] == "aten.mm.default"]
    assert r["bound"] == "overhead"


def test_significance_is_a_display_option():
    with pytest.raises(OptionsError):
        DisplayOptions(min_finding_share=2.0)
    assert DisplayOptions().min_finding_share == 0.01
    x, w = torch.randn(256, 256), torch.randn(256, 256)

    def step():
        for _ in range(10):
            y = x @ w
        return y.sum().item()

    t = _warm_trace(step)
    everything = t.advice(min_share=0.0)
    assert "sync" in [f["kind"] for f in everything.findings.to_pylist()]
    strict = t.advice(min_share=1.0)        # nothing costs all of the op time: only findings without a cost floor
    assert all(f["cost_ns"] is None or f["cost_ns"] >= strict.op_ns for f in strict.findings.to_pylist())
    with pytest.raises(OptionsError):
        t.advice(min_share=-0.5)
    text = t.summary(display=DisplayOptions(min_finding_share=0.0)).to_text()
    assert "min_finding_share" in text and "Tensor.item" in text


def test_a_trace_of_an_older_schema_has_no_first_run_and_is_advised():
    t = tensorscope.load(os.path.join(TESTS, "data", "golden-schema-1.4"))
    assert "first_run" in t.ops.column_names and t.ops.column("first_run").null_count == t.ops.num_rows
    adv = t.advice()
    assert not adv.cold and adv.first_run_ns == 0


def test_first_run_is_marked_once_per_key_in_the_process_under_both_engines():
    for engine in ("native", "python"):
        x = torch.randn(7, 13)                     # a shape no other test uses
        with tensorscope.trace(engine=engine) as a:
            torch.relu(x)
            torch.relu(x)
        with tensorscope.trace(engine=engine) as b:
            torch.relu(x)
        firsts = a.ops.column("first_run").to_pylist()
        if engine == "native":
            assert firsts == [True, False]
        else:
            assert firsts == [False, False]       # seen by the native trace before, in this process
        assert b.ops.column("first_run").to_pylist() == [False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peaks_are_measured_at_several_sizes_and_bounded_by_the_spec_sheet():
    torch.cuda.init()
    p = tensorscope._peaks.machine_peaks("cuda", refresh=True)
    assert p is not None and p["flops"]["float32"] > 0
    for d in p["detail"].values():
        assert set(d["sizes"]) == {str(n) for n in _peaks.CUDA_SIZES}
    spec = _peaks.spec_sheet(torch.cuda.get_device_name())
    if spec:
        for k, v in p["flops"].items():
            if spec.get(k):
                assert v <= spec[k] * 1.05, (k, v, spec[k])   # TF32 off: float32 at most the spec's fp32
        assert p["bound"]["flops"]


def test_an_amp_finding_on_a_row_the_overhead_finding_names_is_dropped():
    """The (window, row) runs compared run against run: a shared pair drops the amp finding, the same row
    of another window or another kind of finding does not; a row inside a long run of the overhead finding
    counts, a row just past its end does not."""
    import numpy as np

    from tensorscope.analyses.advisor import _drop_amp_on
    from tensorscope.analyses.findings import Runs

    def f(kind, w, r):
        return {"kind": kind, "runs": Runs.of((np.array(w, np.int64), np.array(r, np.int64)))}

    over = f("overhead", [0, 0, 1] + [2] * 1000, [5, 2**40, 7] + list(range(100, 1100)))
    found = [f("amp", [1], [5]), f("amp", [0, 1], [9, 7]), f("compute_bound", [0], [5]), f("amp", [0], [2**40]),
             f("amp", [], []), f("amp", [2, 2], [99, 1100]), f("amp", [2], [600])]
    kept = _drop_amp_on(over, found)
    assert kept == [found[0], found[2], found[4], found[5]]
    assert _drop_amp_on(over, found[2:3]) == found[2:3]
