"""Non-finite screen and numerics shadow mode: verdicts, exact counts, no effect on the program, cost."""
from __future__ import annotations

import math

import pytest
import torch

import tensorscope
from tensorscope.recording.engines.python.numerics import NonfiniteScreen, count_nonfinite, screen_finite
from tensorscope.recording.engines.python.shadow import NumericsShadow, rel_errors

aten = torch.ops.aten


def _op_rows(t, op=None):
    return [r for r in t.ops.to_pylist() if op is None or r["op"] == op]


def _nf(t, op):
    rows = _op_rows(t, op)
    assert rows, f"{op} not in {[r['op'] for r in t.ops.to_pylist()]}"
    return [(r["nonfinite"], r["nonfinite_produced"]) for r in rows]


# ----------------------------------------------------------------------------------------------
# non-finite screen

def test_fp32_to_fp16_overflow_counts_exactly_the_values_from_65520_as_produced():
    x = torch.tensor([1.0, 65504.0, 65519.0, 65519.99, 65520.0, 70000.0, -65520.0, -1e9, 3.0])
    with tensorscope.trace() as t:
        h = x.half()
        y = h * 1               # a later op only propagates
        z = h[:4] * 1           # a finite slice: nothing to report
    expected = int((x.abs() >= 65520).sum())
    assert expected == 4 and int(torch.isinf(h).sum()) == 4
    assert _nf(t, "aten._to_copy.default") == [(4, True)]
    assert _nf(t, "aten.mul.Tensor") == [(4, False), (0, None)]


def test_fp16_sum_of_70000_ones_overflows_in_the_result_not_the_accumulator():
    with tensorscope.trace() as t:
        ones = torch.ones(70000, dtype=torch.float16)
        s = ones.sum()
        s32 = ones.sum(dtype=torch.float32)
    assert math.isinf(s.item()) and s32.item() == 70000.0
    assert _nf(t, "aten.ones.default") == [(0, None)]
    assert _nf(t, "aten.sum.default") == [(1, True), (0, None)]


def test_large_finite_values_are_not_reported():
    big16 = torch.full((1000,), 60000.0, dtype=torch.float16)    # sum would overflow float16
    big32 = torch.full((1000,), 3e38)                            # sum overflows float32
    with tensorscope.trace() as t:
        big16 * 1
        big32 * 1
    assert [r["nonfinite"] for r in _op_rows(t, "aten.mul.Tensor")] == [0, 0]


def test_nan_and_both_infinities_are_counted():
    x = torch.randn(5000)
    x[[3, 10, 4000]] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    assert not screen_finite(x) and count_nonfinite(x) == 3
    assert not screen_finite(x.half()) and count_nonfinite(x.half()) == 3
    assert not screen_finite(x.bfloat16()) and count_nonfinite(x.bfloat16()) == 3
    small = torch.tensor([[1.0, float("nan")], [2.0, 3.0]])
    assert not screen_finite(small) and count_nonfinite(small) == 1
    assert screen_finite(torch.randn(3, 4, 5)) and screen_finite(torch.tensor(2.0)) and screen_finite(torch.empty(0))
    c = torch.tensor([1 + 1j, complex(float("inf"), 0)])
    assert not screen_finite(c) and count_nonfinite(c) == 1


def test_division_by_zero_is_produced_and_later_ops_propagate():
    a = torch.tensor([1.0, 0.0, 2.0])
    with tensorscope.trace() as t:
        b = a / 0           # inf, nan, inf
        c = b.exp()
        d = torch.nan_to_num(c)
    assert _nf(t, "aten.div.Tensor") == [(3, True)]
    assert _nf(t, "aten.exp.default") == [(3, False)]
    assert _nf(t, "aten.nan_to_num.default") == [(0, None)]
    text = t.summary().to_text()
    assert "non-finite produced (first) | aten.div.Tensor" in text


def test_inplace_ops_judge_the_written_tensor_before_the_op():
    with tensorscope.trace() as t:
        a = torch.ones(8)
        a.mul_(1e30).mul_(1e30)          # the second mul_ overflows: produced
        a.mul_(2)                         # a already holds inf: propagated
        b = torch.full((4,), float("inf"))
        b.zero_()                         # writes zeros: finite
    assert _nf(t, "aten.mul_.Tensor") == [(0, None), (8, True), (8, False)]
    assert _nf(t, "aten.zero_.default") == [(0, None)]


def test_inplace_on_a_tensor_from_before_the_trace_is_screened_before_the_op():
    ext_bad = torch.tensor([1.0, float("nan")])
    ext_ok = torch.tensor([1.0, 2.0])
    with tensorscope.trace() as t:
        ext_bad.add_(1)
        ext_ok.div_(0)
    assert _nf(t, "aten.add_.Tensor") == [(1, False)]
    assert _nf(t, "aten.div_.Tensor") == [(2, True)]


def test_memo_avoids_the_pre_screen_for_tensors_the_trace_produced():
    s = NonfiniteScreen()
    x = torch.randn(100)
    y = aten.relu.default(x)
    assert s.post(0, aten.relu.default, (x,), {}, (y,), None) is None
    st = s.pre(aten.mul_.Scalar, (y, 2.0), {}, True)
    assert s.n_pre_screened == 0 and st is not None and st[0] is False
    aten.mul_.Scalar(y, 2.0)
    assert s.post(1, aten.mul_.Scalar, (y, 2.0), {}, (y,), st) is None
    # a write the screen did not see (the version counter moved): screened again
    y[0] = float("inf")
    st = s.pre(aten.mul_.Scalar, (y, 1.0), {}, True)
    assert s.n_pre_screened == 1 and st[0] is True
    aten.mul_.Scalar(y, 1.0)
    assert s.post(2, aten.mul_.Scalar, (y, 1.0), {}, (y,), st) == (1, False)


def test_nonfinite_python_scalars_count_as_inputs():
    x = torch.randn(4)
    m = torch.tensor([True, False, True, False])
    with tensorscope.trace() as t:
        y = x.masked_fill(m, float("-inf"))
        y.softmax(0)
    assert _nf(t, "aten.masked_fill.Scalar") == [(2, False)]
    assert _nf(t, "aten._softmax.default") == [(0, None)]


def test_no_nonfinite_option_turns_the_screen_off():
    with tensorscope.trace(nonfinite=False) as t:
        torch.tensor([1.0]) / 0
    assert all(r["nonfinite"] is None and r["nonfinite_produced"] is None for r in _op_rows(t))


def test_views_and_integers_are_not_screened():
    x = torch.tensor([1.0, float("inf")])
    with tensorscope.trace() as t:
        x.view(2, 1)
        x[1:]
        torch.arange(3) + 1
    s = NonfiniteScreen()
    s.post(0, aten.view.default, (x, [2, 1]), {}, (x.view(2, 1),), None)
    assert s.n_screened == 0
    assert all(r["nonfinite"] in (None, 0) for r in _op_rows(t))


def test_deferred_device_path_gives_the_same_verdicts(monkeypatch):
    """The CUDA path (device buffer, one read at the end), driven with CPU tensors."""
    def body():
        ext = torch.tensor([1.0, float("nan"), 3.0])
        with tensorscope.trace() as t:
            a = torch.tensor([1.0, 65519.0, 70000.0, -1e6]).half()   # produced (2)
            b = a * 2                                                  # propagated
            c = torch.ones(8)
            c.mul_(1e30).mul_(1e30)                                    # in-place: produced, then
            c.mul_(2)                                                  # propagated
            ext.add_(1)                                                # external, propagated
            torch.ones(3) / 0                                          # produced
            torch.zeros(4).masked_fill(torch.tensor([1, 0, 0, 0]).bool(), float("inf"))
        return [(r["op"], r["nonfinite"], r["nonfinite_produced"]) for r in t.ops.to_pylist()]

    immediate = body()
    monkeypatch.setattr(NonfiniteScreen, "defer_cpu", True)
    deferred = body()
    assert deferred == immediate
    assert sum(1 for _, n, p in immediate if n) == 7


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine/CI)")
def test_cuda_flags_are_read_once_at_the_end():
    dev = "cuda"
    with tensorscope.trace() as t:
        a = torch.tensor([1.0, 65519.0, 70000.0], device=dev).half()
        b = a * 2
        c = torch.ones(8, device=dev)
        c.mul_(1e30).mul_(1e30)
    assert _nf(t, "aten._to_copy.default") == [(1, True)]
    assert _nf(t, "aten.mul.Tensor") == [(1, False)]
    assert _nf(t, "aten.mul_.Scalar") == [(0, None), (8, True)]


def test_screen_changes_nothing():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8)

    def run():
        torch.manual_seed(1)
        out = m(torch.nn.functional.dropout(x, 0.5))
        out.sum().backward()
        g = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        return out.detach(), g, torch.get_rng_state()

    ref = run()
    with tensorscope.trace(numerics=True) as t:
        got = run()
    assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    assert torch.equal(ref[2], got[2])
    assert t.ops.num_rows > 10


def _screen_cases(n):
    """The probe calls the dispatch mode makes for relu, add and an in-place mul on ``n`` elements."""
    torch.manual_seed(0)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(n).to(dt)
        y = torch.randn(n).to(dt)
        one = torch.ones(n, dtype=dt)         # repeated in-place multiplies must stay finite
        yield dt, [(aten.relu.default, (x,), False), (aten.add.Tensor, (x, y), False),
                   (aten.mul_.Tensor, (x, one), True)]


def _run_screen(s, func, args, inplace):
    st = s.pre(func, args, {}, True) if inplace else None     # the order the dispatch mode calls them in
    o = func(*args)
    return s.post(0, func, args, {}, (o,), st)


def test_screen_takes_the_cheap_path_on_1m_finite_elements():
    # screen-vs-op cost ratios are measured by benchmarks/probes.py (no timing asserted here); what must
    # hold is that finite data never falls through to the exact count, and that an in-place target an
    # earlier op screened is not screened again
    for dt, cases in _screen_cases(1 << 20):
        s = NonfiniteScreen()
        for func, args, inplace in cases:
            s.post(0, func, args, {}, (func(*args),), None)    # fills the memo for the in-place case
            for _ in range(3):
                assert _run_screen(s, func, args, inplace) is None, (dt, func)
        assert s.n_screened > 0 and s.n_fired == 0 and s.n_pre_screened == 0, dt


def test_screen_counts_a_non_finite_value_in_1m_elements_exactly():
    # the other side of the cheap path above: one NaN among 1M elements is found and counted
    x = torch.randn(1 << 20)
    x[12345] = float("nan")
    s = NonfiniteScreen()
    assert _run_screen(s, aten.relu.default, (x,), False) == (1, False)
    assert s.n_fired == 1


# ----------------------------------------------------------------------------------------------
# numerics shadow mode

def test_bf16_matmul_error_matches_a_hand_computed_reference():
    torch.manual_seed(0)
    a = torch.randn(64, 48).bfloat16()
    b = torch.randn(48, 32).bfloat16()
    with tensorscope.trace(numerics=True) as t:
        c = a @ b
    ref = a.float() @ b.float()
    diff = c.float() - ref
    want_rel = (torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(ref)).item()
    want_max = diff.abs().max().item()
    (r,) = _op_rows(t, "aten.mm.default")
    assert want_rel > 1e-4        # bf16 output rounding is visible
    assert r["num_rel_err"] == pytest.approx(want_rel, rel=1e-6)
    assert r["num_max_abs_err"] == pytest.approx(want_max, rel=1e-6)


def test_numerics_off_by_default_and_fp32_ops_untouched_in_fp32_mode():
    a = torch.randn(8, 8)
    with tensorscope.trace() as off:
        a @ a
    assert all(r["num_rel_err"] is None for r in _op_rows(off))
    with tensorscope.trace(numerics="fp32") as t:
        a @ a
    assert all(r["num_rel_err"] is None for r in _op_rows(t))


def test_fp64_mode_compares_float32_ops_against_float64():
    torch.manual_seed(0)
    a = torch.randn(100000)
    with tensorscope.trace(numerics="fp64") as t:
        s = a.cumsum(0)
    (r,) = _op_rows(t, "aten.cumsum.default")
    ref = a.double().cumsum(0)
    want = (torch.linalg.vector_norm(s.double() - ref) / torch.linalg.vector_norm(ref)).item()
    assert r["num_rel_err"] == pytest.approx(want, rel=1e-6) and 0 < want < 1e-3


def test_ops_above_the_threshold_are_listed_with_their_place():
    with tensorscope.trace(numerics=True, numerics_threshold=1e-3) as t:
        ones = torch.ones(70000, dtype=torch.float16)
        s = ones.sum()                                 # inf against 70000: infinite error
        h = torch.randn(100).half()
        h * 2                                          # exact in any precision
    (r,) = _op_rows(t, "aten.sum.default")
    assert r["num_rel_err"] == math.inf
    assert _op_rows(t, "aten.mul.Tensor")[0]["num_rel_err"] == 0.0
    text = t.summary().to_text()
    assert "numerics error | aten.sum.default" in text
    assert "test_numerics.py" in text


def test_seeded_and_inplace_ops_are_skipped_and_say_so():
    torch.manual_seed(0)
    h = torch.randn(16).half()
    with tensorscope.trace(numerics=True) as t:
        torch.nn.functional.dropout(h, 0.5)
        h.clone().add_(1)
    assert all(r["num_rel_err"] is None for r in _op_rows(t) if "dropout" in r["op"] or "bernoulli" in r["op"]
               or r["op"] == "aten.add_.Tensor")
    sh = NumericsShadow("fp32")
    r = sh.compare(0, aten.native_dropout.default, (h, 0.5, True), {}, aten.native_dropout.default(h, 0.5, True))
    assert r is None and sh.skipped == {"aten.native_dropout.default": 1}
    assert sh.skip_reasons["aten.native_dropout.default"] == "nondeterministic_seeded"
    md = t.metadata.get("numerics")
    if md is not None:      # recorded by the trace builder
        assert any("bernoulli" in k or "dropout" in k for k in md["skipped"])
        assert "nondeterministic_seeded" in t.summary().to_text()


def test_rel_errors_handles_infinities():
    ref = torch.tensor([1.0, float("inf"), 2.0], dtype=torch.float64)
    assert rel_errors(torch.tensor([1.0, float("inf"), 2.0]), ref) == (0.0, 0.0)
    rel, mx = rel_errors(torch.tensor([1.0, float("inf"), float("inf")]), ref)
    assert rel == math.inf and mx == math.inf


def test_ops_that_overwrite_their_target_do_not_read_it():
    with tensorscope.trace() as t:
        g = torch.empty(1000)              # garbage: maybe NaN, never screened
        g.copy_(torch.full((1000,), float("inf")))
        e = torch.empty(8)
        e.fill_(float("nan"))              # the user's NaN
        f = torch.empty(4)
        f.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0])).div_(0)
    assert _nf(t, "aten.copy_.default") == [(1000, False), (0, None)]
    assert _nf(t, "aten.fill_.Scalar") == [(8, False)]
    assert _nf(t, "aten.div_.Tensor") == [(4, True)]


def test_low_precision_dtype_arguments_are_widened_in_the_reference():
    x = torch.ones(70000)
    with tensorscope.trace(numerics="fp64") as t:
        s = x.sum(dtype=torch.float16)       # float32 input, float16 result: inf
    (r,) = _op_rows(t, "aten.sum.default")
    assert math.isinf(s.item()) and r["num_rel_err"] == math.inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_native_screen_counts_exactly_across_blocks_and_strides(dtype):
    # the engine's vectorised count works in blocks of 2^20 values and on strided rows: non-finite
    # values at the edges of blocks, in a transposed view and in a gapped slice are all counted
    n = (1 << 20) + 37
    x = torch.zeros(n, dtype=dtype)
    for i in (0, 1, (1 << 20) - 1, 1 << 20, n - 1):
        x[i] = float("inf")
    x[5] = float("nan")
    x[(1 << 20) + 3] = float("-inf")
    m = torch.zeros(64, 48, dtype=dtype)
    m[3, 5] = m[63, 47] = m[0, 0] = m[0, 1] = float("nan")
    with tensorscope.trace(leaks=False, engine="auto") as t:
        a = x * 1                          # contiguous, over a block boundary
        b = m.t() * 1                      # a permuted output keeps the strides of its input
        c = m[::2, 1::3].contiguous() * 1  # one of the four lands in the gapped slice (the copy counts it)
    assert int((~torch.isfinite(a)).sum()) == 7 and _nf(t, "aten.mul.Tensor")[0] == (7, False)
    assert _nf(t, "aten.mul.Tensor")[1] == (4, False) and int((~torch.isfinite(b)).sum()) == 4
    assert int((~torch.isfinite(c)).sum()) == 1
    assert _nf(t, "aten.clone.default") == [(1, False)] and _nf(t, "aten.mul.Tensor")[2] == (1, False)


@pytest.mark.parametrize("engine", ["native", "python"])
def test_screen_counts_dense_permuted_and_gapped_outputs_exactly(engine):
    # a dense output in another dim order (channels_last, a transpose) is counted as one run over
    # its span, from its storage offset; a gapped out= target only where it is written
    x = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
    x[0, 1, 2, 3] = float("inf")
    x[1, 2, 3, 4] = float("nan")
    buf = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
    buf[0].fill_(float("nan"))             # outside the written half: never counted
    gap = torch.full((4, 10), float("inf"))
    with tensorscope.trace(leaks=False, engine=engine) as t:
        a = x * 2                          # channels_last output
        torch.mul(x[1], 2, out=buf[1])     # a dense target at a storage offset
        torch.add(torch.ones(4, 5), 1, out=gap[:, ::2])   # every other column written, the rest inf
    assert a.is_contiguous(memory_format=torch.channels_last)
    assert _nf(t, "aten.mul.Tensor") == [(2, False)]
    assert _nf(t, "aten.mul.out") == [(1, False)]
    assert _nf(t, "aten.add.out") == [(0, None)]
