"""Output fingerprints (``fingerprints=True``): what each engine records per op, checked against an
independent reference computed after the trace from the tensors themselves (torch for the
statistics, the documented hash formula for the bits), and that recording them changes nothing the
program or another mode sees. Runs under the suite's engine (TENSORSCOPE_FORCE_FALLBACK=1: python)."""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tensorscope
from tests.helpers import ROOT

_M = (1 << 64) - 1
K1, K2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}


def _mix(b, i):
    x = ((b ^ ((i * K1) & _M)) * K2) & _M
    return x ^ (x >> 31)


def reference(t):
    """The fingerprint by its definition, in plain Python over the logical (row-major) elements."""
    flat = t.contiguous().reshape(-1)
    width = flat.element_size() * 8
    bits = [b & ((1 << width) - 1) for b in flat.view(_BITS[t.dtype]).tolist()]
    h = 0
    for i, b in enumerate(bits):
        h = (h + _mix(b, i)) & _M
    v = flat.double()
    fin = torch.isfinite(v)
    good = v[fin]
    return (_mix(h, len(bits)), int((~fin).sum()), float(good.sum()), float(good.abs().sum()),
            float(good.abs().max()) if good.numel() else 0.0)


def _cases():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 3, 4, 5, generator=g)
    nan = torch.randn(3, 7, generator=g)
    nan[0, 1] = float("nan")
    nan[2, 3] = float("inf")
    return {
        "contiguous": base,
        "transposed": base.transpose(1, 3),
        "channels_last": base.to(memory_format=torch.channels_last),
        "offset slice": base[1, :, 1:3],
        "float16": (base * 1000).half(),
        "bfloat16": base.bfloat16(),
        "float64": base.double(),
        "non-finite": nan,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        # long runs (the vectorised loop and its scalar tail) with NaN/Inf inside them
        "long float16": _holes((torch.randn(1027, generator=g) * 1e3).half()),
        "long bfloat16": _holes(torch.randn(1027, generator=g).bfloat16()),
        "long float32 channels_last": _holes(torch.randn(2, 9, 5, 7, generator=g)).to(memory_format=torch.channels_last),
    }


def _holes(t):
    flat = t.view(-1)
    flat[5], flat[6], flat[-3] = float("inf"), float("nan"), -float("inf")
    return t


@pytest.mark.parametrize("name", list(_cases()))
def test_fingerprint_matches_its_definition(name):
    x = _cases()[name]
    with tensorscope.trace(fingerprints=True, leaks=False) as t:
        y = x.clone()   # preserves the layout: the row's output has x's strides
    assert y.stride() == x.stride() or not x.is_contiguous()
    ops = t.result.ops
    rows = [r for r in ops.to_pylist() if r["op"] == "aten.clone.default"]
    assert len(rows) == 1
    r = rows[0]
    want = reference(y)
    got = (r["fp_hash"], r["fp_nonfinite"], r["fp_sum"], r["fp_abs_sum"], r["fp_max_abs"])
    assert got[:2] == want[:2], (name, got, want)
    for g_, w_ in zip(got[2:], want[2:]):
        assert g_ == pytest.approx(w_, rel=1e-12, abs=1e-12), (name, got, want)


def test_the_vectorised_and_the_portable_loop_give_the_same_bits():
    """The native engine fingerprints with the best vectorised loop the CPU has (AVX-512 DQ+VL,
    else AVX2) and with a portable loop elsewhere: every case (layouts, dtypes, NaN/Inf, runs with
    and without a tail) gets the same hash and the same float64 statistics, bit for bit, from
    every path this CPU can run (each forced in turn)."""
    from tensorscope import native

    ext, why = native.engine()
    if ext is None:
        pytest.skip(f"the native engine does not build here: {why}")
    if os.environ.get("TENSORSCOPE_FORCE_FALLBACK"):
        pytest.skip("the suite runs the python engine (TENSORSCOPE_FORCE_FALLBACK)")
    cases = dict(_cases())
    g = torch.Generator().manual_seed(1)
    cases["channels_last C=16"] = _holes(torch.randn(3, 16, 5, 6, generator=g)).to(memory_format=torch.channels_last)
    for dt in (torch.float64, torch.float16, torch.bfloat16):   # runs of 8 two at a time, an odd count of them
        cases[f"channels_last C=8 {dt}"] = _holes(torch.randn(3, 8, 5, 3, generator=g).to(dt)).to(
            memory_format=torch.channels_last)
    cases["float64 wide range"] = torch.randn(999, generator=g, dtype=torch.float64) * torch.logspace(-30, 30, 999,
                                                                                                          dtype=torch.float64)
    paths = ext.set_fp_simd(True)
    if not paths:
        pytest.skip("this CPU has no AVX2: only the portable loop runs")
    assert set(paths) <= {"avx2", "avx512"}
    got = []
    try:
        for simd in (False, *paths):
            ext.set_fp_simd(simd)
            with tensorscope.trace(fingerprints=True, leaks=False, engine="native") as t:
                for x in cases.values():
                    x.clone()
            rows = [r for r in t.result.ops.to_pylist() if r["op"] == "aten.clone.default"]
            assert len(rows) == len(cases)
            got.append([(r["fp_hash"], r["fp_nonfinite"], r["fp_sum"], r["fp_abs_sum"], r["fp_max_abs"]) for r in rows])
    finally:
        ext.set_fp_simd(True)
    for path, bits in zip(paths, got[1:]):
        assert bits == got[0], path
    with pytest.raises(ValueError):
        ext.set_fp_simd("sse")


def test_fingerprints_change_nothing_the_screen_records():
    """With fingerprints on, the screen takes what a fingerprint read (the non-finite count, the
    largest magnitude) instead of reading the output again: the same non-finite rows and counts,
    and the same proofs of later ops, as with them off."""
    def program():
        x = torch.linspace(-3, 3, 8192).reshape(64, 128)
        y = x.exp().half() * 1e4          # overflows at one end: inf in a large output
        z = (x * 2).relu() + 1            # finite large outputs: proven or screened
        w = torch.where(torch.isfinite(y), y, torch.zeros_like(y)).float().sum(0)
        return y, z, w

    cols = []
    for fingerprints in (False, True):
        with tensorscope.trace(fingerprints=fingerprints, leaks=False) as t:
            outs = program()
        ops = t.result.ops
        cols.append((ops.column("op").to_pylist(), ops.column("nonfinite").to_pylist(),
                     ops.column("nonfinite_produced").to_pylist(), t.result.metadata["nonfinite_screen"]))
    assert cols[0] == cols[1]
    assert any(cols[1][1]) and torch.isinf(outs[0]).any()


def test_same_values_other_layout_same_hash_other_values_other_hash():
    x = torch.randn(4, 6)
    with tensorscope.trace(fingerprints=True, leaks=False) as t:
        a = x.clone()
        b = x.t().contiguous().t().clone()   # the same values, column-major
        c = x.clone().add_(1e-6)             # one rounding step away
    rows = {r["seq"]: r for r in t.result.ops.to_pylist()}
    fp = [r["fp_hash"] for r in rows.values() if r["op"] in ("aten.clone.default", "aten.add_.Tensor")]
    assert b.stride() != a.stride()
    assert fp[0] == reference(a)[0] == reference(b)[0]
    assert fp[-1] != fp[0] and fp[-1] == reference(c)[0]


class _Log(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _program():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    y = m(x)
    y.pow(2).mean().backward()
    return y.detach().clone(), [p.grad.clone() for p in m.parameters()]


def test_nothing_visible_to_the_program_or_a_mode():
    """The same ops reach a mode entered before the trace with fingerprints on as with them off (the
    python engine's non-finite screen dispatches its own reductions either way: not ours to hide
    here), and the program computes the same bits."""
    ref_y, ref_g = _program()
    logs, cols = [], []
    for fingerprints in (False, True):
        with _Log() as log:
            with tensorscope.trace(fingerprints=fingerprints, leaks=False) as t:
                y, g = _program()
        assert torch.equal(y, ref_y) and all(torch.equal(a, b) for a, b in zip(g, ref_g))
        logs.append(log.ops)
        cols.append(t.result.ops.column("fp_hash"))
    assert logs[0] == logs[1]   # no op of the fingerprints reached the user's mode
    assert cols[0].null_count == len(cols[0]) and cols[1].null_count < len(cols[1])


def test_fingerprints_survive_save_and_old_traces_load(tmp_path):
    with tensorscope.trace(fingerprints=True, leaks=False) as t:
        torch.randn(3, 3).mul(2)
    t.result.save(str(tmp_path / "t"))
    back = tensorscope.load(str(tmp_path / "t"))
    for c in ("fp_hash", "fp_nonfinite", "fp_sum", "fp_abs_sum", "fp_max_abs"):
        assert back.ops.column(c).to_pylist() == t.result.ops.column(c).to_pylist()
    assert str(back.ops.schema.field("fp_hash").type) == "uint64"
    old = tensorscope.load(os.path.join(ROOT, "tests", "data", "golden-schema-1.4"))
    assert old.ops.column("fp_hash").null_count == old.ops.num_rows


def test_the_two_engines_fingerprint_alike():
    """The same program under the native engine (where it builds) and the python one: every aligned
    op has the same hash (diverge finds them identical)."""
    traces = []
    for engine in ("auto", "python"):
        with tensorscope.trace(fingerprints=True, leaks=False, engine=engine) as t:
            _program()
        traces.append(t.result)
    d = tensorscope.diverge(*traces)
    f = d.facts
    # ops with no fingerprint on either side (uninitialised memory: empty) are "unknown" on both
    assert f["aligned"] == f["ops_a"] == f["ops_b"] and f["identical"] > 10, d.to_text()
    assert f["aligned"] == f["identical"] + f["unknown"] and f["diverged"] == f["close"] == 0, d.to_text()
    assert d.structure.num_rows == 0
