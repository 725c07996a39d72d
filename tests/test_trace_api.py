"""The library API and the ops/calls/tensors columns, on real torch programs."""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch

import tensorscope
from tensorscope import schema as S


def rows(t, **where):
    out = []
    for r in t.ops.to_pylist():
        if all((r[k] == v) if not callable(v) else v(r[k]) for k, v in where.items()):
            out.append(r)
    return out


def one(t, op):
    rs = rows(t, op=op)
    assert rs, f"{op} not in {[r['op'] for r in t.ops.to_pylist()]}"
    return rs[0]


def test_tables_exist_with_contract_schemas():
    x = torch.randn(3)
    with tensorscope.trace() as t:
        x + 1
    for name, schema in S.TABLES.items():
        tab = t.tables[name]
        assert isinstance(tab, pa.Table)
        assert tab.schema.equals(schema, check_metadata=False), name
    contract = ("seq cell op namespace overload tags phase autograd_node call_id module source_file source_line "
                "in_shapes in_strides in_dtypes in_devices in_formats out_shapes out_strides out_dtypes out_devices "
                "out_formats out_alias is_view inplace hidden_copy flops bytes_read bytes_written start_ns cpu_ns "
                "cuda_ns error_id").split()
    assert set(contract) <= set(t.ops.column_names)
    assert t.kernels.num_rows == 0 and t.kernels.schema.equals(S.KERNELS, check_metadata=False)
    assert tensorscope.last() is t.result


def test_op_identity_shapes_and_source_line():
    x = torch.randn(4, 3)
    w = torch.randn(3, 5)
    with tensorscope.trace() as t:
        y = x @ w  # line A
        z = y.relu()
    import inspect

    line_a = inspect.currentframe().f_lineno - 4
    mm = one(t, "aten.mm.default")
    assert mm["namespace"] == "aten" and mm["overload"] == "default"
    assert mm["in_shapes"] == [[4, 3], [3, 5]] and mm["out_shapes"] == [[4, 5]]
    assert mm["in_strides"] == [[3, 1], [5, 1]] and mm["out_strides"] == [[5, 1]]
    assert mm["in_dtypes"] == ["float32", "float32"] and mm["out_devices"] == ["cpu"]
    assert mm["flops"] == 2 * 4 * 3 * 5
    assert mm["bytes_read"] == (12 + 15) * 4 and mm["bytes_written"] == 20 * 4
    assert mm["source_file"] == __file__ and mm["source_line"] == line_a
    assert mm["phase"] == "forward" and mm["autograd_node"] is None
    relu = one(t, "aten.relu.default")
    assert relu["source_line"] == line_a + 1
    assert relu["flops"] is None            # no formula: null, not 0
    assert relu["seq"] == mm["seq"] + 1
    assert "core" in relu["tags"] or "pointwise" in relu["tags"]
    assert relu["cpu_ns"] > 0 and relu["start_ns"] >= mm["start_ns"] + mm["cpu_ns"]
    call = t.calls.to_pylist()[mm["call_id"]]
    assert call["name"] in ("matmul", "__matmul__") and call["source_line"] == line_a
    assert call["first_seq"] == mm["seq"] and call["n_ops"] >= 1


def test_module_paths_modulelist_moduledict_and_backward_linking():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
            self.heads = torch.nn.ModuleDict({"cls": torch.nn.Linear(4, 2)})

        def forward(self, x):
            for b in self.blocks:
                x = b(x).relu()
            return self.heads["cls"](x)

    net = Net()
    x = torch.randn(3, 4)
    with tensorscope.trace() as t:
        net(x).sum().backward()
    fwd = rows(t, op="aten.addmm.default", phase="forward")
    assert [r["module"] for r in fwd] == ["blocks.0", "blocks.1", "heads.cls"]
    relu = rows(t, op="aten.relu.default")
    assert relu[0]["module"] == "<Net>"      # ops in the root's own forward
    bwd = rows(t, phase="backward", op="aten.mm.default")
    assert bwd, "backward mm ops recorded"
    for r in bwd:
        assert r["autograd_node"] == "AddmmBackward0"
        assert r["fwd_seq"] is not None
        f = t.ops.to_pylist()[r["fwd_seq"]]
        assert f["op"] == "aten.addmm.default"
        assert r["module"] == f["module"] and r["source_line"] == f["source_line"]
    assert {r["module"] for r in bwd} == {"blocks.0", "blocks.1", "heads.cls"}
    assert t.calls.filter(pa.compute.equal(t.calls.column("name"), "backward")).num_rows == 1


def test_views_inplace_and_out_variants():
    x = torch.randn(4, 4)
    out = torch.empty(4, 4)
    with tensorscope.trace() as t:
        v = x.t()
        x.add_(1)
        torch.add(x, 1, out=out)
        e = x[:, :1].expand(4, 4)
        g = x[::2]
    tr = one(t, "aten.t.default")
    assert tr["is_view"] and tr["out_alias"] == [0] and not tr["inplace"]
    assert tr["in_storages"] == tr["out_storages"]
    assert tr["out_formats"] == ["strided"]
    add_ = one(t, "aten.add_.Tensor")
    assert add_["inplace"] and add_["out_alias"] == [0] and not add_["is_view"]
    add_out = one(t, "aten.add.out")
    assert add_out["inplace"] and add_out["out_alias"] == [1]
    ex = one(t, "aten.expand.default")
    assert ex["out_formats"] == ["expanded"] and ex["out_strides"] == [[4, 0]]
    sl = rows(t, op="aten.slice.Tensor")[-1]
    assert sl["out_formats"] == ["gapped"] and sl["out_strides"] == [[8, 1]]
    assert t.tensors.num_rows >= 2


def test_channels_last_and_size1_ambiguity():
    conv = torch.nn.Conv2d(3, 8, 3, padding=1).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    one_ch = torch.randn(2, 1, 4, 4)      # C == 1: contiguous and channels_last at once
    with tensorscope.trace() as t:
        y = conv(x)
        z = one_ch + 1
    c = one(t, "aten.convolution.default")
    assert c["in_formats"][0] == "channels_last" and c["out_formats"] == ["channels_last"]
    assert c["out_ambiguous"] == [False]
    a = one(t, "aten.add.Tensor")
    assert a["in_ambiguous"][0] is True and a["in_formats"][0] == "contiguous"


def test_hidden_copies_reshape_contiguous_and_noop_conversions():
    x = torch.randn(4, 6)
    cl = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    with tensorscope.trace() as t:
        a = x.t().reshape(-1)           # copy
        b = x.reshape(-1)               # view
        c = x.t().contiguous()          # copy
        d = x.contiguous()              # no-op: no ATen op at all
        e = x.float()                   # no-op
        f = cl.reshape(2, 3, 16)        # channels_last merging H,W: still a copy? (C is not innermost)
        g = cl.flatten(1)               # copy
    hc = rows(t, hidden_copy=True)
    assert len(hc) >= 2
    first = hc[0]
    assert first["op"] == "aten.clone.default" and first["bytes_written"] == 24 * 4
    calls = {r["call_id"]: r for r in t.calls.to_pylist()}
    names = [calls[r["call_id"]]["name"] for r in hc]
    assert "reshape" in names and "contiguous" in names and "flatten" in names
    # no-op conversions: the torch-level calls are recorded, with no ATen op
    noop = [c for c in t.calls.to_pylist() if c["name"] in ("contiguous", "float") and c["n_ops"] == 0]
    assert len(noop) == 2
    view_reshape = [r for r in rows(t, op="aten.view.default") if calls[r["call_id"]]["name"] == "reshape"]
    assert view_reshape and not any(r["hidden_copy"] for r in view_reshape)


def test_inference_mode_undecomposed_ops():
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with tensorscope.trace() as t:
        with torch.inference_mode():
            y = lin(x)
            z = x.t().reshape(-1)
    ops = [r["op"] for r in t.ops.to_pylist()]
    assert any(o.startswith("aten.linear") or o.startswith("aten.addmm") for o in ops)
    assert any(r["hidden_copy"] for r in t.ops.to_pylist()), "undecomposed reshape copy is a hidden copy"


def test_mixed_dtypes_recorded_per_input():
    a = torch.randn(4, dtype=torch.float16)
    b = torch.randn(4, dtype=torch.float32)
    with tensorscope.trace() as t:
        c = a + b
    r = one(t, "aten.add.Tensor")
    assert r["in_dtypes"] == ["float16", "float32"] and r["out_dtypes"] == ["float32"]


def test_noise_calls_filtered_and_detach_marked():
    x = torch.randn(3, requires_grad=True)
    with tensorscope.trace() as t:
        s = x.shape
        n = x.size(0) + x.dim()
        y = x.detach()
        repr(x)
    names = [c["name"] for c in t.calls.to_pylist()]
    assert "size" not in names and "dim" not in names and "__get__" not in names and "__repr__" not in names
    det = one(t, "aten.detach.default")
    assert det["is_noise"] is True


def test_autocast_state_on_calls():
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with tensorscope.trace() as t:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lin(x)
    lin_calls = [c for c in t.calls.to_pylist() if c["name"] == "linear"]
    assert lin_calls and lin_calls[0]["autocast"] == "cpu:bfloat16"


def test_nested_trace_raises_clear_error():
    with tensorscope.trace():
        with pytest.raises(tensorscope.errors.TraceActiveError, match="already recording"):
            with tensorscope.trace():
                pass


def test_unknown_option_is_a_clear_error():
    with pytest.raises(tensorscope.errors.OptionsError, match="unknown trace option"):
        tensorscope.trace(bogus=1)


def test_df_and_sql():
    x = torch.randn(8, 8)
    with tensorscope.trace() as t:
        for _ in range(3):
            x = x + 1
    df = t.df("ops")
    assert len(df) == 3 and df["seq"].tolist() == [0, 1, 2]
    res = t.sql("select op, count(*)::BIGINT as n, sum(cpu_ns)::BIGINT as ns from ops group by op")
    assert res["op"].tolist() == ["aten.add.Tensor"] and int(res["n"][0]) == 3
    assert int(res["ns"][0]) == int(df["cpu_ns"].sum())
    arrow = t.sql("select count(*) as n from calls", arrow=True)
    assert arrow.column("n")[0].as_py() == 3


def test_torch_compile_region_runs_compiled_and_is_flagged():
    torch._dynamo.reset()

    def f(a):
        return (a.sin() + a.cos()).sum()

    cf = torch.compile(f, backend="eager")
    x = torch.randn(16)
    expected = f(x)
    with tensorscope.trace() as t:
        y = cf(x)
    assert torch.equal(y, expected)
    assert t.ops.num_rows >= 1
    # the compiled frame was not permanently skipped: a second call outside tracing still works
    assert torch.equal(cf(x), expected)


def test_repr_mimebundle_is_self_contained_and_escaped():
    class Evil(torch.nn.Module):
        def forward(self, x):
            return x * 2

    m = torch.nn.Sequential()
    m.add_module("<script>alert(1)</script>", Evil())
    x = torch.randn(2)
    with tensorscope.trace() as t:
        m(x)
    b = t._repr_mimebundle_()
    assert "text/plain" in b and "text/html" in b
    html = b["text/html"]
    assert "<script>" not in html and "http://" not in html and "https://" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html      # the module name is shown, escaped


def test_deferred_table_resolves_once_on_first_read():
    # always-on kernel collection hands the Trace a pending kernels table (no GPU here: a stand-in)
    from tensorscope._trace import Trace

    calls = []

    class Pending:
        def resolve(self):
            calls.append(1)
            return S.empty("kernels"), ["harvested later"]

    t = Trace({"kernels": Pending()}, {"notes": []})
    assert calls == []
    assert t.kernels.num_rows == 0 and t.kernels.num_rows == 0
    assert calls == [1] and t.metadata["notes"] == ["harvested later"]


def test_flops_match_flop_counter_mode():
    from torch.utils.flop_counter import FlopCounterMode

    conv = torch.nn.Conv2d(3, 4, 3)
    lin = torch.nn.Linear(8, 5)

    def prog():
        a = torch.randn(6, 7) @ torch.randn(7, 3)
        b = torch.bmm(torch.randn(2, 3, 4), torch.randn(2, 4, 5))
        c = torch.baddbmm(torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(2, 4, 5))
        d = lin(torch.randn(2, 8))
        e = conv(torch.randn(1, 3, 8, 8))
        (d.sum() + e.sum()).backward()

    with FlopCounterMode(display=False) as fc:
        prog()
    with tensorscope.trace() as t:
        prog()
    ours = sum(v for v in t.ops.column("flops").to_pylist() if v)
    assert ours == fc.get_total_flops()


def test_nested_and_sparse_inputs_are_recorded_not_dropped():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
        sp = torch.randn(3, 3).relu().to_sparse()
    with tensorscope.trace() as t:
        nt.relu()
        sp * 2
    ops = t.ops.to_pylist()
    assert ops[0]["op"] == "aten.relu.default" and ops[0]["in_formats"] == ["non_strided"]
    assert any(r["in_formats"] == ["non_strided"] for r in ops[1:])
    assert t.metadata["tracer_errors"] == 0
