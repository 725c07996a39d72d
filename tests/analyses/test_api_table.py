"""The derived ``api`` table: torch-level APIs and the ATen ops they became, from real traces."""
from __future__ import annotations

import torch

import tensorscope
from tensorscope import schema as S
from tensorscope.analyses.api import api_table, surprising


def _by(t):
    out = {}
    for r in t.api.to_pylist():
        out.setdefault(r["qualname"], {})[r["op"]] = r
    return out


def test_linear_reshape_and_noop_conversions():
    lin = torch.nn.Linear(4, 8)
    x = torch.randn(3, 4)
    z = torch.randn(2, 3, 4, 5).permute(0, 2, 3, 1)
    with tensorscope.trace(leaks=False) as t:
        lin(x)
        lin(x)
        x.float()            # float32 already: no op
        x.contiguous()       # contiguous already: no op
        z.reshape(2, -1)     # permuted: a hidden copy
    assert t.api.schema.equals(S.API, check_metadata=False)
    by = _by(t)
    linear = by["torch.nn.functional.linear"]
    assert linear["aten.addmm.default"]["n_calls"] == 2
    assert linear["aten.addmm.default"]["n_ops"] == 2
    assert linear["aten.addmm.default"]["ops_per_call"] == 1.0
    assert linear["aten.addmm.default"]["core"] is True
    assert linear["aten.t.default"]["core"] is False          # aten.t is not core ATen
    assert linear["aten.addmm.default"]["no_op_calls"] == 0
    for q in ("Tensor.float", "Tensor.contiguous"):
        assert list(by[q]) == [None]
        assert by[q][None]["n_calls"] == by[q][None]["no_op_calls"] == 1
    reshape = by["Tensor.reshape"]
    assert reshape["aten.clone.default"]["hidden_copies"] == 1
    # cpu time of an (api, op) row is the sum over its ops
    ops = t.ops.to_pylist()
    calls = {c["call_id"]: c for c in t.calls.to_pylist()}
    addmm_ns = sum(o["cpu_ns"] for o in ops if o["op"] == "aten.addmm.default"
                   and calls[o["call_id"]]["qualname"] == "torch.nn.functional.linear")
    assert linear["aten.addmm.default"]["cpu_ns"] == addmm_ns
    # the table is a pure function of ops and calls
    assert api_table(t.ops, t.calls).to_pylist() == t.api.to_pylist()


def test_surprising_ranks_hidden_copies_and_summary_says_so():
    z = torch.randn(2, 3, 4, 5).permute(0, 2, 3, 1)
    x = torch.randn(8)
    with tensorscope.trace(leaks=False) as t:
        z.reshape(2, -1)
        x.float()
        torch.relu(x)
    s = surprising(t.api)
    assert s and s[0]["api"] == "Tensor.reshape" and "1 hidden copies" in s[0]["reasons"]
    assert all(a["api"] != "torch.relu" for a in s)     # one core op per call: nothing surprising
    text = t.summary().to_text()
    assert "torch API vs ATen" in text and "Tensor.reshape" in text
    assert "dispatched no ATen op" in text and "Tensor.float" in text


def test_empty_and_saved(tmp_path):
    with tensorscope.trace(leaks=False) as t:
        pass
    assert t.api.num_rows == 0 and t.api.schema.equals(S.API, check_metadata=False)
    with tensorscope.trace(leaks=False) as t:
        torch.nn.functional.gelu(torch.randn(4))
    back = tensorscope.load(t.save(tmp_path / "a"))
    assert back.api.to_pylist() == t.api.to_pylist()
    assert back.sql("select sum(n_ops) as n from api where qualname = 'torch.nn.functional.gelu'")["n"][0] >= 1


def test_calls_out_of_order_and_ops_outside_calls():
    # the table is built column-wise: call ids looked up by sorting, not by a dict per call; shuffled
    # calls, an op whose call is not in the table and an empty qualname must give the same rows
    import pyarrow as pa

    x = torch.randn(4, 4)
    with tensorscope.trace(leaks=False) as t:
        for _ in range(3):
            x = (x + 1).relu()
        x.float()                           # a call that dispatches nothing
    ref = api_table(t.ops, t.calls)
    perm = list(reversed(range(t.calls.num_rows)))
    shuffled = t.calls.take(pa.array(perm))
    assert api_table(t.ops, shuffled).equals(ref)
    # drop the first call: its ops are outside every call now and leave the table
    first = t.calls.column("call_id")[0].as_py()
    rest = t.calls.filter(pa.compute.not_equal(t.calls.column("call_id"), first))
    got = api_table(t.ops, rest)
    assert sum(got.column("n_ops").to_pylist()) == sum(ref.column("n_ops").to_pylist()) - sum(
        1 for c in t.ops.column("call_id").to_pylist() if c == first)
    # an empty qualname falls back to the call's name, as a missing one does
    q = t.calls.column("qualname").cast(pa.string())
    blank = t.calls.set_column(t.calls.schema.get_field_index("qualname"), "qualname",
                               pa.array(["" for _ in range(len(q))], pa.string()))
    names = set(api_table(t.ops, blank).column("qualname").to_pylist())
    assert names == set(t.calls.column("name").to_pylist())


def test_in_place_variants_and_one_to_one_mappings_are_not_surprising():
    """Issue 29: ``Tensor.add_ → aten.add_.Tensor`` and ``Tensor.sum → aten.sum.default`` were listed
    ("non-core ATen"); an API is surprising only when its ops do more work than its own op."""
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    with tensorscope.trace(leaks=False) as t:
        x.add_(y)
        x.sum()
        torch.mul(x, y, out=y)
        x.mean(dim=0)
    s = surprising(t.api)
    assert s == [], s
    assert "surprising expansions" not in t.summary().to_text()
    # the non-core ops are still in the table (t.api), only not findings
    assert {"aten.add_.Tensor", "aten.sum.default"} <= {r["op"] for r in t.api.to_pylist()}


def test_a_decomposition_and_an_extra_copy_are_surprising():
    x = torch.randn(32, 64)
    w = torch.randn(64)
    with tensorscope.trace(leaks=False) as t:
        torch.nn.functional.layer_norm(x.t(), (32,))   # fine: one op
        torch.cdist(x, x)                                # a decomposition into several ops per call
        x.t().contiguous()                               # the copy is contiguous()'s own op: not extra
        torch.nn.functional.normalize(x * w, dim=1)      # a few ops, no copy
    s = {a["api"]: a["reasons"] for a in surprising(t.api)}
    # cdist is one compute op and views; contiguous() copying is its own op: neither is surprising
    assert s == {}, s
    z = torch.randn(2, 3, 4, 5).permute(0, 2, 3, 1)
    with tensorscope.trace(leaks=False) as t2:
        torch.nn.functional.cosine_similarity(x, x)        # a decomposition into several compute ops
        z.flatten(1)                                       # flatten copies: a hidden copy under it
    s = {a["api"]: a["reasons"] for a in surprising(t2.api)}
    assert any("ATen ops per call" in r for r in next((v for k, v in s.items() if k.endswith("cosine_similarity")), [])), s
    assert any("hidden cop" in r for r in s.get("Tensor.flatten", [])), s
