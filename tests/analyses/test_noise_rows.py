"""Rows flagged ``is_noise`` (eager's bookkeeping: the ``lift_fresh``/``detach_`` of ``torch.tensor``,
``detach``, ``alias``) are never the subject of a finding, in every analysis and summary section.

The native engine sees ``torch.tensor(...)``'s ``detach_`` (a binding runs it with the Python key
excluded), the python engine does not; both flag their bookkeeping rows. Where no real program
makes a noise row a candidate (a format change, a cast), the analysis is fed the real trace's table
with one real finding's row flagged ``is_noise``: the finding must go, and stays without the flag.
"""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch

import tensorscope
from tensorscope.analyses.api import surprising
from tensorscope.analyses.casts import casts
from tensorscope.analyses.layout import layout_changes
from tensorscope.analyses.memory import memory_peak
from tensorscope.analyses.nonfinite import nonfinite_verdicts
from tensorscope.errors import GuardError

ENGINES = ["native", "python"]


def _trace(engine, fn, **kw):
    if engine == "native":
        from tensorscope.recording.engines import _native_ext

        ext, reason = _native_ext(wait=True)
        if ext is None:
            pytest.skip(f"native engine unavailable: {reason}")
    kw.setdefault("leaks", False)
    with tensorscope.trace(engine=engine, **kw) as t:
        fn()
    assert t.metadata["engine"] == engine
    return t


def _noise_seqs(t):
    return {r["seq"] for r in t.ops.to_pylist() if r["is_noise"]}


def _flag_noise(ops, seq):
    """``ops`` with row ``seq`` flagged ``is_noise``."""
    col = [bool(v) or s == seq for v, s in zip(ops.column("is_noise").to_pylist(), ops.column("seq").to_pylist())]
    i = ops.column_names.index("is_noise")
    return ops.set_column(i, ops.schema.field(i), pa.array(col, pa.bool_()))


def _masked_constant():
    torch.manual_seed(0)
    s = torch.randn(8)
    return torch.where(s > 0, s, torch.tensor(float("-inf")))


@pytest.mark.parametrize("engine", ENGINES)
def test_nonfinite_names_no_bookkeeping_row(engine):
    keep = []

    def run():
        keep.append(_masked_constant())               # the example: where(mask, s, torch.tensor(-inf))
        keep.append(torch.tensor([float("inf"), 1.0]) * 2)
        keep.append(torch.log(torch.tensor([-1.0, 0.0])))   # a real producer next to them

    t = _trace(engine, run)
    noise = _noise_seqs(t)
    assert noise   # lift_fresh (both engines), detach_ (native)
    v = nonfinite_verdicts(t.ops)
    assert v and not any(r["seq"] in noise for r in v)
    assert [r["op"] for r in v if r["verdict"] == "produced"] == ["aten.log.default"]
    assert ("aten.where.self", "constant") in [(r["op"], r["verdict"]) for r in v]
    if engine == "native":   # its screen saw the lifted -inf/inf (the detach_ after the lift): a constant
        assert ("aten.mul.Tensor", "from_constant") in [(r["op"], r["verdict"]) for r in v]
    text = t.summary().to_text()
    assert "non-finite produced (first) | aten.log.default" in text
    assert "detach_" not in text and "lift_fresh" not in text


@pytest.mark.parametrize("engine", ENGINES)
def test_guard_no_nonfinite_names_no_bookkeeping_row(engine):
    with pytest.raises(GuardError) as ei:
        _trace(engine, _masked_constant, expect="no_nonfinite")
    msg = str(ei.value)
    assert "aten.where.self" in msg
    assert "detach_" not in msg and "lift_fresh" not in msg


@pytest.mark.parametrize("engine", ENGINES)
def test_guard_channels_last_names_no_bookkeeping_row(engine):
    def run():
        w = torch.nn.Parameter(torch.ones(4, 3, 3, 3))   # native: nn.Parameter's detach reads the 4-d weight first
        torch.nn.functional.conv2d(torch.ones(1, 3, 8, 8), w)

    with pytest.raises(GuardError) as ei:
        _trace(engine, run, expect="channels_last")
    msg = str(ei.value)
    assert "first: aten.convolution.default" in msg and "detach" not in msg


@pytest.mark.parametrize("engine", ENGINES)
def test_api_surprises_name_no_bookkeeping_op(engine):
    t = _trace(engine, lambda: torch.tensor([1.0, 2.0]) + torch.tensor([3.0, 4.0]))
    noise_ops = {r["op"] for r in t.ops.to_pylist() if r["is_noise"]}
    assert noise_ops
    assert set(t.api.column("op").to_pylist()) & noise_ops   # the table keeps every op an API became
    for a in surprising(t.api):
        assert not set(a["non_core"]) & noise_ops and not {op for op, _ in a["ops"]} & noise_ops
    text = t.summary().to_text()
    assert "detach_" not in text and "lift_fresh" not in text


@pytest.mark.parametrize("engine", ENGINES)
def test_memory_peak_never_named_after_a_bookkeeping_row(engine):
    keep = []
    t = _trace(engine, lambda: keep.append(torch.tensor([float("inf"), 1.0, 2.0]) * 2))
    noise = _noise_seqs(t)
    peak = memory_peak(t.memory, t.ops, t.tensors)["cpu"]
    assert peak["peak_seq"] not in noise and peak["peak_op"] == "aten.mul.Tensor"
    # bytes live before the trace and no allocation: the first rows (lift_fresh...) see the peak
    only_lift = _trace(engine, lambda: (lambda c: None)(torch.tensor([1.0, 2.0])))
    p = memory_peak(only_lift.memory, only_lift.ops, only_lift.tensors).get("cpu", {})
    assert "peak_op" not in p
    assert "lift_fresh" not in only_lift.summary().to_text()


@pytest.mark.parametrize("engine", ENGINES)
def test_layout_change_on_a_bookkeeping_row_is_no_finding(engine):
    x = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    t = _trace(engine, lambda: (x.contiguous(), x.permute(0, 2, 3, 1).reshape(2, -1)))
    lc = layout_changes(t.ops, t.calls).to_pylist()
    assert lc
    for seq in {r["seq"] for r in lc}:
        flagged = layout_changes(_flag_noise(t.ops, seq), t.calls).to_pylist()
        assert seq not in {r["seq"] for r in flagged}
        assert [r for r in flagged] == [r for r in lc if r["seq"] != seq]


@pytest.mark.parametrize("engine", ENGINES)
def test_cast_on_a_bookkeeping_row_is_no_finding(engine):
    a, b = torch.randn(4).half(), torch.randn(4)
    t = _trace(engine, lambda: ((a + b).half(), a.float()))
    cs = casts(t.ops, t.calls).to_pylist()
    assert len({r["seq"] for r in cs}) >= 2
    for seq in {r["seq"] for r in cs}:
        flagged = casts(_flag_noise(t.ops, seq), t.calls).to_pylist()
        assert seq not in {r["seq"] for r in flagged} and len(flagged) < len(cs)


@pytest.mark.parametrize("engine", ENGINES)
def test_time_outside_ops_names_the_real_op_after_a_gap_not_its_bookkeeping(engine):
    """Host time before ``torch.tensor(...)`` is named by the first op the program asked for after it
    (the ``mul``), never by the tensor's own ``lift_fresh``/``detach_``."""
    import time

    from tensorscope.analyses.idle import outside_ops

    def run():
        x = torch.ones(4) + 1
        time.sleep(0.05)                              # host work between two ops
        (x * torch.tensor(3.0)).sum()

    t = _trace(engine, run)
    noise = _noise_seqs(t)
    assert noise
    got = outside_ops(t.ops, t.calls, t.metadata["wall_ns"])
    g, before, after = got["gaps"][0]
    assert g >= 40_000_000
    assert after not in noise and before not in noise
    assert t.ops.column("op")[after].as_py() == "aten.mul.Tensor"
    assert t.ops.column("op")[before].as_py() == "aten.add.Tensor"
    text = t.summary().to_text()
    assert "before mul" in text and "lift_fresh" not in text and "detach_" not in text
