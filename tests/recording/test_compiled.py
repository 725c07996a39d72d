"""Compiled regions: a real torch.compile (Inductor, CPU) traced with a shape change that forces a recompile.

One traced run, shared by the tests: a small MLP compiled with ``dynamic=False``,
called on a (3, 4) batch, then on a (5, 4) batch (the shape guard fails: a
recompile), each followed by ``backward``. Nothing here is hand-made: the graphs,
guards, reasons and links come from what PyTorch compiled and ran.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import tensorscope
from tensorscope import schema as S

pytestmark = [
    pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile unavailable"),
    pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
                       reason="Inductor on CPU needs a C++ compiler (g++/clang++)"),
]


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(4, 8)
        self.l2 = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x))).sum()


def _step(cm, x):
    x = x.clone().requires_grad_(True)
    loss = cm(x)
    loss.backward()
    return loss.detach(), x.grad


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    # a private Inductor/AOTAutograd cache: a cached graph keeps the stack traces (files, lines) of
    # the process that first compiled it, which may be another checkout of these tests
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor-cache"))
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = MLP()
    cm = torch.compile(m, dynamic=False)
    xa, xb = torch.randn(3, 4), torch.randn(5, 4)
    with tensorscope.trace(leaks=False) as t:
        la, ga = _step(cm, xa)
        lb, gb = _step(cm, xb)
    grads = [p.grad.clone() for p in m.parameters()]
    # the same compiled model without tracing: results must be identical bit for bit
    m.zero_grad(set_to_none=True)
    la2, ga2 = _step(cm, xa)
    lb2, gb2 = _step(cm, xb)
    grads2 = [p.grad.clone() for p in m.parameters()]
    yield dict(t=t.result, traced=(la, ga, lb, gb, grads), plain=(la2, ga2, lb2, gb2, grads2))
    torch._dynamo.reset()
    if old is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def _graphs(t):
    return t.graphs.to_pylist()


def test_results_unchanged(run):
    la, ga, lb, gb, grads = run["traced"]
    la2, ga2, lb2, gb2, grads2 = run["plain"]
    assert torch.equal(la, la2) and torch.equal(lb, lb2)
    assert torch.equal(ga, ga2) and torch.equal(gb, gb2)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2))


def test_every_graph_kind_per_compile(run):
    t = run["t"]
    assert t.graphs.schema.equals(S.GRAPHS, check_metadata=False)
    g = _graphs(t)
    cids = list(dict.fromkeys(r["compile_id"] for r in g))
    assert len(cids) == 2, cids                      # first compile and the recompile
    for cid in cids:
        kinds = {(r["kind"], r["phase"]) for r in g if r["compile_id"] == cid}
        assert {("dynamo", None), ("aot_forward", "forward"), ("aot_backward", "backward"),
                ("inductor", "forward"), ("inductor", "backward")} <= kinds, (cid, kinds)
    dyn = [r for r in g if r["kind"] == "dynamo"]
    assert all(r["frame"] == "forward" and r["source_file"] == __file__ for r in dyn)
    assert all(r["source_line"] == MLP.forward.__code__.co_firstlineno for r in dyn)
    assert all(r["compile_ns"] is not None and r["compile_ns"] > 0 for r in dyn)
    assert all(r["compiled_in_trace"] for r in g)


def test_recompile_reason_names_the_failed_guard(run):
    dyn = [r for r in _graphs(run["t"]) if r["kind"] == "dynamo"]
    assert dyn[0]["recompile_reason"] is None
    reason = dyn[1]["recompile_reason"]
    assert reason and "size mismatch" in reason and "expected 3, actual 5" in reason
    assert any(gl.startswith("TENSOR_MATCH") for gl in dyn[0]["guards"])


def test_aot_graphs_hold_aten_nodes_with_shapes(run):
    t = run["t"]
    g = _graphs(t)
    nodes = t.graph_nodes.to_pylist()
    for cid, batch in zip(list(dict.fromkeys(r["compile_id"] for r in g)), (3, 5)):
        fw = next(r for r in g if r["compile_id"] == cid and r["kind"] == "aot_forward")
        bw = next(r for r in g if r["compile_id"] == cid and r["kind"] == "aot_backward")
        fw_nodes = [n for n in nodes if n["graph_id"] == fw["graph_id"]]
        addmm = [n for n in fw_nodes if n["op"] == "aten.addmm.default"]
        assert [n["shapes"] for n in addmm] == [[[batch, 8]], [[batch, 2]]]
        assert all(n["dtypes"] == ["float32"] for n in addmm)
        assert fw["n_ops"] == sum(1 for n in fw_nodes if n["op"] not in ("input", "output"))
        assert fw["n_nodes"] == len(fw_nodes)
        assert [n["idx"] for n in fw_nodes] == list(range(len(fw_nodes)))
        bw_ops = {n["op"] for n in nodes if n["graph_id"] == bw["graph_id"]}
        assert "aten.mm.default" in bw_ops
        # user lines only (Dynamo inlines tensorscope's function mode; its frames are never reported)
        assert all(n["source_file"] in (None, __file__) for n in fw_nodes)


def test_inductor_graphs_list_their_kernels(run):
    for r in _graphs(run["t"]):
        if r["kind"] == "inductor":
            assert r["n_kernels"] == len(r["kernels"]) > 0
            assert r["code_file"]
            assert any(k.startswith("extern_kernels.") for k in r["kernels"])


def test_ops_that_ran_carry_their_graph(run):
    t = run["t"]
    g = {r["graph_id"]: r for r in _graphs(t)}
    ops = t.ops.to_pylist()
    linked = [o for o in ops if o["graph_id"] is not None]
    assert linked
    assert all(g[o["graph_id"]]["kind"] == "inductor" for o in linked)
    fw = [o for o in linked if o["phase"] == "forward"]
    bw = [o for o in linked if o["phase"] == "backward"]
    assert any(o["op"] == "aten.addmm.out" for o in fw)
    assert all(g[o["graph_id"]]["phase"] == "forward" for o in fw)
    assert bw and all(g[o["graph_id"]]["phase"] == "backward" for o in bw)
    # the two steps ran the two compiles
    assert len({g[o["graph_id"]]["compile_id"] for o in fw}) == 2
    # ops outside the compiled code (randn/clone of the test, AccumulateGrad) are not linked
    assert all(o["graph_id"] is None for o in ops if o["autograd_node"] and "AccumulateGrad" in o["autograd_node"])
    calls = t.calls.to_pylist()
    assert any(c["compiled"] and c["graph_id"] is not None for c in calls)
    assert all(c["compiled"] == (c["graph_id"] is not None) for c in calls)


def test_summary_section_and_round_trip(run, tmp_path):
    t = run["t"]
    text = t.summary().to_text()
    assert "compiled region" in text and "fused into" in text and "size mismatch" in text
    html = t.summary().to_html()
    assert "compiled region" in html and "<script" not in html
    back = tensorscope.load(t.save(tmp_path / "c"))
    assert back.graphs.to_pylist() == t.graphs.to_pylist()
    assert back.graph_nodes.num_rows == t.graph_nodes.num_rows > 0
    assert back.ops.column("graph_id").to_pylist() == t.ops.column("graph_id").to_pylist()


def test_no_capture_left_behind(run):
    from torch._logging._internal import trace_log

    from tensorscope.recording.compiled import _Handler

    assert not any(isinstance(h, _Handler) for h in trace_log.handlers)


def test_trace_without_compile_has_empty_graph_tables():
    with tensorscope.trace(leaks=False) as t:
        torch.randn(3) + 1
    assert t.graphs.num_rows == 0 and t.graph_nodes.num_rows == 0
    assert t.graphs.schema.equals(S.GRAPHS, check_metadata=False)
    assert t.ops.column("graph_id").null_count == t.ops.num_rows


def _in_fresh_process(name: str) -> bool:
    """Run test ``name`` of this file in a fresh interpreter (True: it ran there and passed).

    These tests assert that a region compiled in one trace (or before it) is not compiled again in
    the next. One cause of such recompiles was tensorscope's: the python function mode's handler
    read its per-function cache while Dynamo traced it, a guard on that cache (fixed; the last test
    below checks it). In a clean clone's fallback pass, after ~170 other tests in the same process,
    Dynamo still recompiles these regions ("Unexpected recompilation: runtime guards failed even
    though they passed during recompilation-reason analysis", torch 2.13), with a cold Inductor
    cache; with a warm one they pass in-process. Alone, in either engine, they pass; a fresh
    process keeps them exact while that order dependence is not understood.
    """
    if os.environ.get("TENSORSCOPE_TEST_ISOLATED") == name:
        return False
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{name}"],
                       env={**os.environ, "TENSORSCOPE_TEST_ISOLATED": name}, capture_output=True, text=True,
                       timeout=900, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    return True



def test_region_compiled_in_an_earlier_trace_is_still_linked():
    if _in_fresh_process("test_region_compiled_in_an_earlier_trace_is_still_linked"):
        return
    torch._dynamo.reset()
    torch.manual_seed(1)
    m = MLP()
    cm = torch.compile(m, dynamic=False)
    x = torch.randn(4, 4)
    try:
        with tensorscope.trace(leaks=False, modules=False) as first:   # no global module hooks: no recompile
            cm(x)
        with tensorscope.trace(leaks=False, modules=False) as second:
            cm(x)
        assert {r["kind"] for r in first.graphs.to_pylist()} >= {"dynamo", "inductor"}
        g = second.graphs.to_pylist()
        assert g and not any(r["compiled_in_trace"] for r in g)          # compiled earlier, only run here
        assert {r["compile_id"] for r in g} == {r["compile_id"] for r in first.graphs.to_pylist()}
        linked = [o for o in second.ops.to_pylist() if o["graph_id"] is not None]
        assert linked and all(g[o["graph_id"]]["kind"] == "inductor" for o in linked)
        assert "in an earlier trace" in second.summary().to_text()
    finally:
        torch._dynamo.reset()


def test_api_table_leaves_out_the_compilers_calls(run):
    t = run["t"]
    compiled_calls = {c["qualname"] for c in t.calls.to_pylist() if c["compiled"]}
    assert compiled_calls
    api = {r["qualname"] for r in t.api.to_pylist()}
    assert not any(q in api for q in compiled_calls if q not in
                   {c["qualname"] for c in t.calls.to_pylist() if not c["compiled"]})


def test_ops_of_a_region_show_the_compiled_function_not_generated_code(run):
    t = run["t"]
    g = {r["graph_id"]: r for r in _graphs(t)}
    linked = [o for o in t.ops.to_pylist() if o["graph_id"] is not None]
    assert all((o["source_file"], o["source_line"]) == (__file__, MLP.forward.__code__.co_firstlineno)
               for o in linked)
    assert all("torchinductor" not in (c["source_file"] or "") for c in t.calls.to_pylist())
    assert all(g[o["graph_id"]]["code_file"] for o in linked)   # the generated module is still named


def test_region_whose_compile_was_never_seen_is_explained():
    if _in_fresh_process("test_region_whose_compile_was_never_seen_is_explained"):
        return
    torch._dynamo.reset()
    from tensorscope.recording import compiled as C

    saved = dict(C._REGISTRY), dict(C._REGISTRY_BY_HASH)
    try:
        cm = torch.compile(MLP(), dynamic=False)
        x = torch.randn(4, 4)
        with tensorscope.trace(leaks=False, modules=False):
            cm(x)
        C._REGISTRY.clear()          # as if the compile had happened where no trace could see it
        C._REGISTRY_BY_HASH.clear()
        with tensorscope.trace(leaks=False, modules=False) as t:
            cm(x)
        assert t.graphs.num_rows == 0
        assert any("compiled before any trace saw it" in n for n in t.metadata["notes"])
        assert "torch._dynamo.reset()" in t.summary().to_text()
    finally:
        C._REGISTRY.clear()
        C._REGISTRY_BY_HASH.clear()
        C._REGISTRY.update(saved[0])
        C._REGISTRY_BY_HASH.update(saved[1])
        torch._dynamo.reset()


def test_traced_and_untraced_runs_share_two_cache_entries():
    """The one recompile tracing causes (Dynamo guards on the types on the torch-function mode stack):
    a region compiled untraced recompiles on its first traced run, and after that neither traced nor
    untraced runs compile anything (no per-trace guard failure: no module hooks, one mode type)."""
    if _in_fresh_process("test_traced_and_untraced_runs_share_two_cache_entries"):
        return
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    try:
        cm = torch.compile(MLP(), dynamic=False)
        x = torch.randn(4, 4)
        cm(x)                                        # compiled untraced
        with tensorscope.trace(leaks=False) as first:
            cm(x)                                    # the mode stack differs: one recompile
        reasons = [r["recompile_reason"] or "" for r in first.graphs.to_pylist()]
        assert any("check_torch_function_mode_stack" in r for r in reasons), reasons
        assert "recompiles once inside one" in first.summary().to_text()
        n = counters["stats"]["unique_graphs"]
        for _ in range(2):
            cm(x)                                    # untraced: the first entry
            with tensorscope.trace(leaks=False) as t:
                cm(x)                                # traced: the second, reused
            assert t.graphs.num_rows and not any(r["compiled_in_trace"] for r in t.graphs.to_pylist())
        assert counters["stats"]["unique_graphs"] == n
    finally:
        torch._dynamo.reset()


def test_traces_with_different_histories_reuse_the_compiled_region():
    """A region compiled in one trace runs compiled in the next ones whatever ran before it there:
    while Dynamo traces the function mode's handler, the handler reads none of the mode's state
    (the python mode read its per-function cache first, which became a guard on that cache: the
    region recompiled in a trace where a torch call came first)."""
    if _in_fresh_process("test_traces_with_different_histories_reuse_the_compiled_region"):
        return
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    try:
        cm = torch.compile(MLP(), dynamic=False)
        x = torch.randn(4, 4)
        with tensorscope.trace(leaks=False):
            cm(x)                                    # compiled here, the mode's caches empty
        n = counters["stats"]["unique_graphs"]
        for _ in range(2):
            with tensorscope.trace(leaks=False) as t:
                torch.ones(2) + 1                    # the mode has seen a call before the region
                cm(x)
            assert not any(r["compiled_in_trace"] for r in t.graphs.to_pylist())
        assert counters["stats"]["unique_graphs"] == n
    finally:
        torch._dynamo.reset()
