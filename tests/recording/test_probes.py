"""The probe seam (recording/probes.py): start before the engine, stop after it in reverse order
(also on KeyboardInterrupt), contribute after decoding; errors contained; each table built once."""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch

import tensorscope
from tensorscope import schema as S
from tensorscope.recording import compiled_link, decode, probes


class _Spy:
    """A probe that records what the session and finishing called, and contributes a table."""

    name = "spy"

    def __init__(self, log: list[str], fail: str = "") -> None:
        self.log = log
        self.fail = fail

    def start(self, ctx) -> None:
        self.log.append("start")
        if self.fail == "start":
            raise RuntimeError("spy start")

    def stop(self) -> None:
        self.log.append("stop")
        if self.fail == "stop":
            raise RuntimeError("spy stop")

    def contribute(self, decoded: probes.Decoded) -> probes.Contribution:
        self.log.append("contribute")
        if self.fail == "contribute":
            raise RuntimeError("spy contribute")
        if self.fail == "length":   # a column of the wrong length is refused whole
            n = decoded.table("ops").num_rows + 1
            return probes.Contribution({}, {("ops", "graph_id"): pa.array([1] * n, pa.int64())}, [])
        ops = decoded.table("ops")
        assert "graph_id" in ops.column_names   # the compiled probe, earlier in the list, contributed it
        return probes.Contribution({}, {}, [f"spy saw {ops.num_rows} ops"])


def _with_spy(monkeypatch, log, fail=""):
    real = probes.make_probes

    def make(*a, **k):
        return [*real(*a, **k), _Spy(log, fail)]
    monkeypatch.setattr(probes, "make_probes", make)


@pytest.mark.parametrize("engine", ["native", "python"])
def test_a_probe_is_started_stopped_once_and_contributes(engine, monkeypatch):
    log: list[str] = []
    _with_spy(monkeypatch, log)
    with tensorscope.trace(engine=engine) as t:
        assert log == ["start"]
        torch.ones(3) + 1
    assert log == ["start", "stop", "contribute"]
    assert f"spy saw {t.ops.num_rows} ops" in t.metadata["notes"]
    assert t.metadata.get("tracer_errors", 0) == 0, t.metadata.get("tracer_error_messages")


@pytest.mark.parametrize("engine", ["native", "python"])
def test_keyboard_interrupt_stops_every_probe_and_still_builds(engine, monkeypatch):
    log: list[str] = []
    _with_spy(monkeypatch, log)
    with pytest.raises(KeyboardInterrupt):
        with tensorscope.trace(engine=engine):
            torch.ones(3) + 1
            raise KeyboardInterrupt
    assert log == ["start", "stop", "contribute"]
    t = tensorscope.last()
    assert t.ops.num_rows >= 1
    # the autouse fixture (tests/helpers/state.py) checks no mode or hook was left behind


@pytest.mark.parametrize("fail", ["start", "stop", "contribute", "length"])
@pytest.mark.parametrize("engine", ["native", "python"])
def test_an_error_in_a_probe_is_contained(engine, fail, monkeypatch):
    log: list[str] = []
    _with_spy(monkeypatch, log, fail)
    x = torch.randn(4)
    with pytest.warns(RuntimeWarning, match="internal error"):
        import tensorscope.recording.session as session

        monkeypatch.setattr(session, "_warned_tracer_bug", False)
        with tensorscope.trace(engine=engine) as t:
            y = x * 2
    assert torch.equal(y, x * 2)
    assert log == ["start", "stop", "contribute"]   # a probe that failed is still stopped and asked
    assert t.metadata["tracer_errors"] >= 1
    assert t.ops.num_rows == 1 and t.ops.column("op").to_pylist() == ["aten.mul.Tensor"]
    if fail == "length":
        assert t.ops.column("graph_id").null_count == 1   # the compiled probe's column, not the spy's


@pytest.mark.parametrize("engine", ["native", "python"])
def test_a_failed_contribution_leaves_its_columns_null_and_the_rest_whole(engine, monkeypatch):
    def broken(*a, **k):
        raise ZeroDivisionError("link bug")

    monkeypatch.setattr(compiled_link, "link", broken)
    import tensorscope.recording.session as session

    monkeypatch.setattr(session, "_warned_tracer_bug", False)
    w = torch.randn(3, 3, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="internal error"):
        with tensorscope.trace(engine=engine) as t:
            (w @ w).sum().backward()
    assert any("compiled regions" in m for m in t.metadata["tracer_error_messages"])
    assert t.ops.schema == S.OPS and t.calls.schema == S.CALLS and t.tensors.schema == S.TENSORS
    assert t.ops.column("graph_id").null_count == t.ops.num_rows > 0
    assert t.calls.column("compiled").null_count == t.calls.num_rows > 0
    # the storages probe, later in the list, still contributed
    assert t.tensors.column("category").null_count == 0 and t.tensors.num_rows > 0


def test_decode_writes_no_column_a_probe_contributes():
    for name, cols in decode.PROBE_COLUMNS.items():
        full = S.TABLES[name]
        dec = decode.decoded_schema(name)
        assert set(cols) <= set(full.names)
        assert [n for n in full.names if n not in cols] == dec.names
        assert decode.empty_decoded(name).schema == dec
