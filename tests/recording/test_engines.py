"""The two recording engines against each other, and against tools that watch the same program.

Each workload is traced with ``engine="python"`` (the TorchDispatchMode, the
oracle) and ``engine="native"`` (the RecordFunction observer) from the same
seed, and the tables are compared column by column. Differences we keep, and
why (every one is normalised by a helper below, nothing else is):

1. ``aten.detach`` rows the python engine's own mode causes (autograd saves
   outputs through the interpreter when a Python mode is on: after relu/
   sigmoid in forward, and inside their backward nodes) are dropped before
   comparing. AccumulateGrad's detach and a user's ``.detach()`` are real and
   present in both.
2. ``seq`` is renumbered after 1.; ``fwd_seq`` and storage/seq references are
   compared through that renumbering. ``seq_nr`` is a process-wide counter
   (two runs differ) and not compared; its forward claim rule is the parity
   engineer's (python engine) -- the native engine claims a node only when the
   op created one.
3. ``start_ns``/``cpu_ns`` are times.
4. Storage ids are compared after renaming by first appearance (a composite
   the observer sees whole, e.g. ``linear``, is not a row and registers
   nothing, so numbering matches; the renaming only guards the order in which
   two inputs of one op are first met).
5. ``free_seq`` of the ``tensors`` table is compared for null-ness only: the
   native engine dates a free by sweeping its live storages (exact for recent
   temporaries, at most a few dozen ops late for long-lived ones); the python
   engine's weakref callback dates it exactly.
6. ``errors``: errors raised in the autograd layer (leaf in-place) have an op
   row under the native engine (the observer sits above autograd), none under
   python. A kernel's c10 error has the same C++ type and source location under
   both (python: the hooks' pybind11 translator; native: the hooks' stack-trace
   fetcher read by the observer while the error unwinds).
7. ``aten.detach``/``detach_`` that a binding runs with the dispatch-mode stack
   stashed (``nn.Parameter()``'s ``_make_subclass``, ``torch.tensor()``) are
   real eager ops that torch.profiler sees too; no dispatch mode can see them,
   so only the native engine records them (flagged ``is_noise`` like every
   detach). They are matched out before comparing.
8. Custom autograd Functions: the forward ops inside ``Function.forward`` run
   with grad off and create no node, so under the native engine they claim no
   ``seq_nr`` and the backward ops' ``fwd_seq``/module/source come from their
   own call. The python engine's old claim rule (first op after the node
   wins) is being fixed by the parity work; until it lands the comparison of
   that workload is an expected failure (checked, not assumed).
9. Ops torch marks unobserved (``profiler._record_function_enter_new`` from
   ``record_function`` in ``optimizer.step``) fire no RecordFunction event:
   only the python engine has them (torch.profiler does not show them either).
10. Until the parity fix (decompose only when eager would) lands, the python
   engine decomposes ``silu_backward`` although eager runs its CPU kernel; the
   conv workload is then an expected failure (checked, not assumed).
"""
from __future__ import annotations

import sys
import threading
import warnings

import pytest
import torch

import tensorscope
from tests.helpers.native_helpers import TEST_OPS_CPP


def _native_available():
    from tensorscope.recording.engines import _native_ext

    ext, reason = _native_ext(wait=True)
    return ext is not None, reason


@pytest.fixture(scope="module", autouse=True)
def _need_native():
    import os

    ok, reason = _native_available()
    if not ok:
        if os.environ.get("TENSORSCOPE_REQUIRE_NATIVE") == "1" and "FORCE_FALLBACK" not in reason:
            pytest.fail(f"TENSORSCOPE_REQUIRE_NATIVE=1 but the native engine is unavailable: {reason}")
        pytest.skip(f"native engine unavailable: {reason}")


OPS_SKIPPED = {"seq", "seq_nr", "start_ns", "cpu_ns", "cuda_ns", "fwd_seq", "in_storages", "out_storages",
               "error_id", "num_rel_err", "num_max_abs_err", "first_run", "probe_ns"}   # compared through mappings, or times (first_run: process state)


def _trace(engine, fn, **opts):
    opts.setdefault("leaks", False)
    with tensorscope.trace(engine=engine, **opts) as t:
        fn()
    assert t.metadata["engine"] == engine, t.metadata.get("engine_reason")
    assert t.metadata["tracer_errors"] == 0, t.metadata["tracer_error_messages"]
    return t


_DETACH = ("aten.detach.default", "aten.detach_.default")


def _user_detach(row, calls):
    cid = row["call_id"]
    return cid is not None and calls[cid]["name"] in ("detach", "detach_")


def _mode_detach(row, calls):
    """A detach row the python engine's own mode caused (difference 1)."""
    return (row["op"] == "aten.detach.default" and row["autograd_node"] != "torch::autograd::AccumulateGrad"
            and not _user_detach(row, calls))


def _align(tp, tn):
    """Both engines' rows, minus the detach rows one engine sees and the other cannot (differences 1
    and 7), matched greedily; any other difference in the op sequence fails."""
    pcalls, ncalls = tp.calls.to_pylist(), tn.calls.to_pylist()
    prows, nrows = tp.ops.to_pylist(), tn.ops.to_pylist()
    pr, nr = [], []
    i = j = 0
    while i < len(prows) or j < len(nrows):
        a = prows[i] if i < len(prows) else None
        b = nrows[j] if j < len(nrows) else None
        if a is not None and b is not None and a["op"] == b["op"]:
            pr.append(a)
            nr.append(b)
            i += 1
            j += 1
        elif a is not None and _mode_detach(a, pcalls):
            i += 1
        elif b is not None and b["op"] in _DETACH and not _user_detach(b, ncalls):
            j += 1
        elif a is not None and a["namespace"] == "profiler":
            i += 1   # difference 9
        else:
            ctx = lambda rows, k: [r["op"] for r in rows[max(0, k - 3):k + 3]]  # noqa: E731
            raise AssertionError(f"op sequences differ at python row {i} / native row {j}: "
                                 f"{ctx(prows, i)} vs {ctx(nrows, j)}")
    return pr, {r["seq"]: k for k, r in enumerate(pr)}, nr, {r["seq"]: k for k, r in enumerate(nr)}


def _storage_names(rows):
    names = {}
    for r in rows:
        for sid in list(r["in_storages"]) + list(r["out_storages"]):
            if sid is not None and sid >= 0 and sid not in names:
                names[sid] = len(names)
    return names


def compare(tp, tn):
    """Assert the python-engine trace ``tp`` and the native one ``tn`` agree (see the module docstring)."""
    assert tp.ops.column_names == tn.ops.column_names
    compared = [c for c in tp.ops.column_names if c not in OPS_SKIPPED]   # every other column, new ones too
    pr, pseq, nr, nseq = _align(tp, tn)
    for col in compared:
        a = [r[col] for r in pr]
        b = [r[col] for r in nr]
        assert a == b, f"ops.{col} differs: " + str([(i, pr[i]["op"], x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y][:5])
    fa = [pseq.get(r["fwd_seq"]) if r["fwd_seq"] is not None else None for r in pr]
    fb = [nseq.get(r["fwd_seq"]) if r["fwd_seq"] is not None else None for r in nr]
    assert fa == fb, "fwd_seq differs"
    ps, ns = _storage_names(pr), _storage_names(nr)
    for side in ("in_storages", "out_storages"):
        a = [[ps.get(s, -1) for s in r[side]] for r in pr]
        b = [[ns.get(s, -1) for s in r[side]] for r in nr]
        assert a == b, f"ops.{side} differs"
    assert [r["error_id"] is None for r in pr] == [r["error_id"] is None for r in nr]
    # calls: the same function mode under both engines
    cp, cn = tp.calls.to_pylist(), tn.calls.to_pylist()
    assert [(c["name"], c["module"], c["source_line"], c["depth"], c["autocast"], c["error_id"] is None) for c in cp] == \
           [(c["name"], c["module"], c["source_line"], c["depth"], c["autocast"], c["error_id"] is None) for c in cn]
    # tensors: the storages the ops saw, renamed
    tp_t = {ps[r["storage_id"]]: r for r in tp.tensors.to_pylist() if r["storage_id"] in ps}
    tn_t = {ns[r["storage_id"]]: r for r in tn.tensors.to_pylist() if r["storage_id"] in ns}
    assert set(tp_t) == set(tn_t)
    for k in tp_t:
        a, b = tp_t[k], tn_t[k]
        for col in ("nbytes", "device", "dtype", "shape", "alloc_op", "module", "source_line"):
            assert a[col] == b[col], (col, a, b)
        assert (a["alloc_seq"] is None) == (b["alloc_seq"] is None)
        assert (a["free_seq"] is None) == (b["free_seq"] is None), (a, b)
        if a["alloc_seq"] is not None:
            assert pseq.get(a["alloc_seq"]) == nseq.get(b["alloc_seq"])
    # errors and warnings
    ep, en = tp.errors.to_pylist(), tn.errors.to_pylist()
    key = lambda e: (e["kind"], e["py_type"], e["message"], e["op"], e["call_id"], e["count"])  # noqa: E731
    assert sorted(map(key, ep), key=str) == sorted(map(key, en), key=str)
    cpp = lambda e: (e["message"], e["op"], e["cpp_type"], e["cpp_file"], e["cpp_line"], e["cpp_function"],  # noqa: E731
                     e["native"])
    assert sorted((cpp(e) for e in ep if e["kind"] == "exception"), key=str) == \
           sorted((cpp(e) for e in en if e["kind"] == "exception"), key=str)
    for e in en:
        if e["kind"] == "warning" and e["native"]:
            match = [x for x in ep if x["kind"] == "warning" and x["message"] == e["message"]]
            assert match and (match[0]["cpp_file"], match[0]["cpp_line"]) == (e["cpp_file"], e["cpp_line"])
    return pr, nr


def both(fn, **opts):
    tp = _trace("python", fn, **opts)
    tn = _trace("native", fn, **opts)
    return tp, tn, compare(tp, tn)


# ---------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------
def test_mlp_forward_backward():
    def run():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        loss = torch.nn.functional.cross_entropy(m(torch.randn(5, 8)), torch.tensor([0, 1, 2, 3, 0]))
        loss.backward()
        opt.step()

    tp, tn, (pr, nr) = both(run)
    assert any(r["phase"] == "backward" for r in nr) and any(r["op"] == "aten.addmm.default" for r in nr)
    assert any(_mode_detach(r, tp.calls.to_pylist()) for r in tp.ops.to_pylist())   # difference 1 was there


def test_conv_net_channels_last_forward_backward():
    def run():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.SiLU(),
                                torch.nn.MaxPool2d(2), torch.nn.Conv2d(8, 4, 3), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 2 * 2, 3)).to(memory_format=torch.channels_last)
        x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
        m(x).square().mean().backward()

    tp = _trace("python", run)
    tn = _trace("native", run)
    nr = tn.ops.to_pylist()
    ops = [r["op"] for r in nr]
    # eager runs silu_backward's CPU kernel: it stays one op (not its composite's sigmoid/mul)
    assert "aten.silu_backward.default" in ops
    assert "channels_last" in [f for r in nr for f in r["out_formats"]]
    assert any(r["flops"] for r in nr if r["op"] == "aten.convolution_backward.default")
    if "aten.silu_backward.default" not in tp.ops.column("op").to_pylist():
        pytest.xfail("python engine decomposes silu_backward (difference 10)")
    compare(tp, tn)


def test_autocast_bf16():
    def run():
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(torch.randn(4, 8))
            z = torch.relu(y) @ torch.randn(8, 2)
        z.float().sum()

    tp, tn, (pr, nr) = both(run)
    assert "bfloat16" in [d for r in nr for d in r["out_dtypes"]]


# -- what autocast and autograd dispatch inside another op, and live bytes (eager referees both: -----
# tests/recording/test_eager_referee.py checks the native engine against torch.profiler's events) ----
def test_autocast_casts_inside_non_composite_ops():
    x, w = torch.randn(8, 16), torch.randn(16, 8)
    a, b = torch.randn(4, 4), torch.randn(4, 4, dtype=torch.bfloat16)

    def run():
        with torch.autocast("cpu", torch.bfloat16):
            torch.mm(x, w)
            torch.cat([a, b])

    tp, tn, (pr, nr) = both(run)
    ops = [r["op"] for r in nr]
    assert ops == ["aten._to_copy.default"] * 2 + ["aten.mm.default", "aten._to_copy.default", "aten.cat.default"]
    assert nr[2]["in_dtypes"] == ["bfloat16", "bfloat16"] and nr[2]["out_dtypes"] == ["bfloat16"]
    for t in (tp, tn):
        assert t.casts.column("kind").to_pylist() == ["autocast"] * 3


@pytest.mark.parametrize("grad", ["enabled", "no_grad", "inference_mode"])
@pytest.mark.parametrize("block", ["nn", "hf"])
def test_autocast_gpt2_like_block_casts_and_dtypes(block, grad):
    from tests.recording.test_eager_referee import GPT2Block, HFGPT2Block

    torch.manual_seed(0)
    m = torch.nn.Sequential(*(GPT2Block() if block == "nn" else HFGPT2Block() for _ in range(2)))
    x = torch.randn(2, 8, 32)
    ctx = {"enabled": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[grad]

    def run():
        with ctx(), torch.autocast("cpu", torch.bfloat16):
            m(x)

    tp, tn, (pr, nr) = both(run)   # every column, in_dtypes included
    n = [r["op"] for r in nr].count("aten._to_copy.default")
    assert n >= 8 and n == [r["op"] for r in pr].count("aten._to_copy.default")
    strip = lambda t: [{k: v for k, v in c.items() if k != "seq"} for c in t.casts.to_pylist()]  # noqa: E731
    assert strip(tp) == strip(tn)   # seq: the python engine's detach rows shift it (difference 2)
    assert tn.casts.column("kind").to_pylist().count("autocast") == n


@pytest.mark.parametrize("act", ["hardswish", "relu"])
def test_inplace_activation_under_grad_clone_is_a_row(act):
    f = getattr(torch.nn.functional, act)

    def run():
        torch.manual_seed(0)
        p = torch.randn(32, 32, requires_grad=True)
        f(p * 2, inplace=True).sum().backward()

    tp, tn, (pr, nr) = both(run)
    ops = [r["op"] for r in nr]
    assert ops.count("aten.clone.default") == (1 if act == "hardswish" else 0)
    if act == "hardswish":
        i = ops.index("aten.clone.default")
        assert ops[i + 1] == "aten.hardswish_.default" and nr[i]["bytes_written"] == 32 * 32 * 4
        # the clone's time is its own row's, not folded into hardswish_'s
        assert nr[i + 1]["start_ns"] >= nr[i]["start_ns"] + nr[i]["cpu_ns"]


def _peak(t):
    from tensorscope.analyses.memory import memory_peak

    return memory_peak(t.memory)["cpu"]["peak_bytes"]


def _live(t):
    return t.memory.column("live_bytes").to_pylist()


def test_peak_live_bytes_equal_in_both_engines_and_predict():
    from tests.recording.test_eager_referee import BasicBlock

    a = torch.randn(256, 1024, requires_grad=True)   # 1 MiB

    def relu_step(a):
        torch.relu(a * 2)

    torch.manual_seed(0)
    block = BasicBlock()
    x = torch.randn(2, 8, 8, 8)

    def block_step(m, x):
        m(x).sum().backward()
        m.zero_grad(set_to_none=True)

    for fn, args, expect in ((relu_step, (a,), 3 * 2 ** 20), (block_step, (block, x), None)):
        fn(*args)
        tp, tn, _ = both(lambda fn=fn, args=args: fn(*args))
        pred = tensorscope.predict(fn, *args)
        assert _peak(tp) == _peak(tn) == _peak(pred), (fn.__name__, _peak(tp), _peak(tn), _peak(pred))
        if expect is not None:
            assert _peak(tn) == expect   # relu's input a * 2 dies when relu returns: live while it runs
        # the same timeline, op for op (the python engine's extra detach rows repeat the live bytes
        # of the op before them)
        pr, _, nr, _ = _align(tp, tn)
        lp, ln = _live(tp), _live(tn)
        assert [lp[r["seq"]] for r in pr] == [ln[r["seq"]] for r in nr]


def test_inference_mode():
    def run():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))
        with torch.inference_mode():
            y = m(torch.randn(3, 8)).reshape(24).flatten()
            y.view(4, 6).t().contiguous()

    tp, tn, (pr, nr) = both(run)
    ops = [r["op"] for r in nr]
    # composites arrive decomposed, under both engines
    assert "aten.linear.default" not in ops and "aten.addmm.default" in ops


def test_inplace_and_out_ops():
    def run():
        x = torch.ones(4, 4)
        out = torch.empty(4, 4)
        x.add_(1).mul_(2)
        torch.add(x, 1, out=out)
        torch.mul(x, x, out=out)
        x.relu_()
        x.clamp_(max=3.0)

    tp, tn, (pr, nr) = both(run)
    assert all(r["inplace"] for r in nr if r["op"].endswith(("_.Tensor", ".out", "relu_.default")))


def test_views_and_splits():
    def run():
        x = torch.arange(24.0).reshape(4, 6)
        a, b = x.split(3, dim=1)
        c = x.chunk(2)
        x.t().unsqueeze(0).expand(2, 6, 4)
        x[1:, ::2].contiguous()
        torch.cat([a, b], 1).unbind(0)
        x.transpose(0, 1).reshape(24)   # a hidden copy

    tp, tn, (pr, nr) = both(run)
    assert any(r["hidden_copy"] for r in nr)
    assert any(r["is_view"] and r["out_alias"] == [0, 0] for r in nr)   # split: two outputs on one storage


def _functorch_case(name):
    from torch.func import grad, jacrev, vjp, vmap

    torch.manual_seed(0)
    x, w = torch.randn(5, 3), torch.randn(3)

    def f(a):
        return (a * w).sin().sum()

    if name == "vmap":
        return lambda: vmap(lambda a: (a * w).sum())(x)
    if name == "vmap_linear":
        return lambda: vmap(lambda a: torch.nn.functional.linear(a, torch.ones(4, 3)).softmax(-1))(x)
    if name == "vmap_inplace":
        return lambda: vmap(lambda a: a.mul_(2).relu())(x.clone())
    if name == "grad":
        return lambda: grad(f)(w)
    if name == "jacrev":
        return lambda: jacrev(lambda a: (a * w).sin())(w)
    if name == "vjp":
        return lambda: vjp(lambda a: a.sin() * 2, w)[1](torch.ones(3))
    assert name == "vmap_of_grad"
    return lambda: vmap(grad(f))(x)


@pytest.mark.parametrize("name", ["vmap", "vmap_linear", "vmap_inplace", "grad", "jacrev", "vjp", "vmap_of_grad"])
def test_functorch_transforms_record_the_physical_ops(name):
    """Under torch.func transforms both engines record what runs: the batched ops on physical shapes
    (a Python dispatch mode sits below functorch's keys; the native engine makes a transform's
    logical op transparent), and results are bitwise those of the untraced program."""
    fn = _functorch_case(name)
    ref = fn()
    got = []
    tp, tn, (pr, nr) = both(lambda: got.append(fn()))
    for g in got:
        for a, b in zip(torch.utils._pytree.tree_leaves(ref), torch.utils._pytree.tree_leaves(g)):
            assert torch.equal(a, b) and a.dtype == b.dtype
    rows = [(r["op"], [tuple(s) for s in r["in_shapes"]], [tuple(s) for s in r["out_shapes"]]) for r in nr]
    assert rows == [(r["op"], [tuple(s) for s in r["in_shapes"]], [tuple(s) for s in r["out_shapes"]]) for r in pr]
    if name == "vmap":   # the batched ops, not the per-sample ones
        assert rows == [("aten.mul.Tensor", [(5, 3), (3,)], [(5, 3)]), ("aten.sum.dim_IntList", [(5, 3)], [(5,)])]
    if name == "vmap_of_grad":
        assert ("aten.cos.default", [(5, 3)], [(5, 3)]) in rows
        assert [r["phase"] for r in nr].count("backward") == 5
    if name == "jacrev":   # the backward ran under vmap over the basis
        assert ("aten.mul.Tensor", [(3, 3), (3,)], [(3, 3)]) in rows


def test_kernel_that_raises():
    def run():
        a, b = torch.randn(3), torch.randn(4)
        try:
            a + b
        except RuntimeError:
            pass
        a * 2

    tp, tn, (pr, nr) = both(run)
    bad = [r for r in nr if r["error_id"] is not None]
    assert [r["op"] for r in bad] == ["aten.add.Tensor"] and bad[0]["out_shapes"] == []
    err = tn.errors.to_pylist()[bad[0]["error_id"]]
    assert err["seq"] == bad[0]["seq"] and err["op"] == "aten.add.Tensor"
    # the C++ side under both engines (compare() checks they agree)
    assert err["cpp_type"] == "c10::Error" and err["native"] is True
    assert err["cpp_file"].endswith(".h") or err["cpp_file"].endswith(".cpp")
    assert err["cpp_line"] > 0 and err["cpp_function"]


KERNEL_ERRORS = {
    # case: (program, Python type, c10 type, op)
    "matmul": (lambda: torch.randn(2, 3) @ torch.randn(4, 5), RuntimeError, "c10::Error", "aten.mm.default"),
    "index": (lambda: torch.ones(3).index_select(0, torch.tensor([7])), IndexError, "c10::IndexError",
              "aten.index_select.default"),
    "not_implemented": (lambda: torch.ones(2) & torch.ones(2), NotImplementedError, "c10::NotImplementedError",
                        "aten.bitwise_and.Tensor"),
    "linalg": (lambda: torch.linalg.inv(torch.zeros(2, 2)), torch.linalg.LinAlgError, "c10::LinAlgError",
               "aten._linalg_check_errors.default"),
    "cat": (lambda: torch.cat([torch.ones(2), torch.ones(2, 2)]), RuntimeError, "c10::Error", "aten.cat.default"),
}


@pytest.mark.parametrize("case", sorted(KERNEL_ERRORS))
def test_kernel_error_type_and_location(case):
    import traceback

    fn, py_type, c10_type, op = KERNEL_ERRORS[case]

    def raised(f):
        try:
            f()
        except py_type as e:
            return type(e), str(e), [(fr.filename, fr.lineno, fr.name) for fr in traceback.extract_tb(e.__traceback__)]
        raise AssertionError("did not raise")

    untraced = raised(fn)
    seen = []

    def run():
        seen.append(raised(fn))
        torch.ones(2) * 2

    tp, tn, _ = both(run)
    # the user's exception is the untraced one under both engines: type, message, traceback frames
    assert seen == [untraced, untraced]
    for t in (tp, tn):
        [err] = [e for e in t.errors.to_pylist() if e["kind"] == "exception"]
        assert (err["cpp_type"], err["op"], err["native"]) == (c10_type, op, True)
        assert err["message"] == untraced[1]
        assert err["cpp_file"] and err["cpp_line"] > 0 and err["cpp_function"]
    # and both engines agree on every field (compare() above checked it too)
    key = ("py_type", "cpp_type", "message", "cpp_file", "cpp_line", "cpp_function", "op", "source_line", "native")
    [ep] = [{k: e[k] for k in key} for e in tp.errors.to_pylist() if e["kind"] == "exception"]
    [en] = [{k: e[k] for k in key} for e in tn.errors.to_pylist() if e["kind"] == "exception"]
    assert ep == en


def test_repeated_kernel_error_recorded_each_time():
    """One row per raise: a freed exception's id taken by the next equal one (a loop) is a new
    exception, not the one an enclosing call sees again."""
    def run():
        for _ in range(4):
            try:
                torch.ones(3).index_select(0, torch.tensor([7]))
            except IndexError:
                pass

    tp, tn, _ = both(run)
    for t in (tp, tn):
        errs = [e for e in t.errors.to_pylist() if e["kind"] == "exception"]
        assert [e["op"] for e in errs] == ["aten.index_select.default"] * 4
        assert len({e["call_id"] for e in errs}) == 4 and all(e["cpp_line"] for e in errs)


def test_kernel_error_with_errors_on_another_thread():
    """Sites are remembered per thread: errors raised meanwhile on an untraced thread never
    describe the traced thread's error, and theirs are unchanged."""
    stop = threading.Event()
    msgs = set()

    def worker():
        while not stop.is_set():
            try:
                torch.randn(2, 3) @ torch.randn(4, 5)
            except RuntimeError as e:
                msgs.add(str(e))

    th = threading.Thread(target=worker)
    th.start()
    try:
        with tensorscope.trace(engine="native", leaks=False) as t:
            for _ in range(20):
                try:
                    torch.ones(3).index_select(0, torch.tensor([7]))
                except IndexError:
                    pass
    finally:
        stop.set()
        th.join(30)
    errs = [e for e in t.errors.to_pylist() if e["kind"] == "exception"]
    assert len(errs) == 20 and msgs == {"mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"}
    assert {(e["cpp_type"], e["op"], e["cpp_file"].rsplit("/", 1)[-1]) for e in errs} == \
        {("c10::IndexError", "aten.index_select.default", "TensorAdvancedIndexing.cpp")}


def test_cpp_warnings_per_op():
    from tensorscope import native

    ops = native.load_test_ops(TEST_OPS_CPP)

    def run():
        x = torch.randn(3)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            y = ops.warn(x, "plain")
            y = ops.warn(y, "twice")
            ops.warn(y, "deprecation")
            torch.relu(y)

    tp, tn, (pr, nr) = both(run)
    w = [e for e in tn.errors.to_pylist() if e["kind"] == "warning"]
    assert len(w) == 4 and all(e["native"] and e["cpp_file"].endswith("test_ops.cpp") for e in w)
    warn_rows = [r["seq"] for r in nr if r["op"].startswith("tensorscope_test.warn")]
    assert sorted(e["seq"] for e in w) == [warn_rows[0], warn_rows[1], warn_rows[1], warn_rows[2]]


def test_custom_autograd_function():
    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 3 * x * x * g

    def run():
        torch.manual_seed(0)
        x = torch.randn(4, requires_grad=True)
        Cube.apply(x).sum().backward()

    tp = _trace("python", run)
    tn = _trace("native", run)
    compare(tp, tn)
    assert any(r["autograd_node"] == "CubeBackward" for r in tn.ops.to_pylist())


def test_other_thread_is_not_recorded_by_either():
    def worker():
        torch.randn(7, 7).exp()

    def run():
        th = threading.Thread(target=worker)
        th.start()
        th.join()
        torch.randn(3).sin()

    tp, tn, (pr, nr) = both(run)
    assert [7, 7] not in [s for r in nr for s in r["out_shapes"]]


def test_thread_alive_at_the_end_is_noted():
    stop = threading.Event()
    th = threading.Thread(target=stop.wait, name="busy-worker")
    th.start()
    try:
        t = _trace("native", lambda: torch.randn(3).sin())
    finally:
        stop.set()
        th.join()
    assert any("busy-worker" in n and "not recorded" in n for n in t.metadata["notes"])


# ---------------------------------------------------------------------------
# engine selection
# ---------------------------------------------------------------------------
def test_auto_is_native_and_numerics_switches_to_python():
    with tensorscope.trace(leaks=False) as t:
        torch.randn(3).exp()
    assert t.metadata["engine"] == "native"
    with tensorscope.trace(leaks=False, numerics="fp32") as t:
        torch.randn(3).exp()
    assert t.metadata["engine"] == "python" and "numerics" in t.metadata["engine_reason"]


def test_forced_fallback(monkeypatch):
    monkeypatch.setenv("TENSORSCOPE_FORCE_FALLBACK", "1")
    with tensorscope.trace(engine="native", leaks=False) as t:
        torch.randn(3).exp()
    assert t.metadata["engine"] == "python" and "TENSORSCOPE_FORCE_FALLBACK" in t.metadata["engine_reason"]
    text = t._repr_mimebundle_()["text/plain"]
    assert "python engine" in text and "TENSORSCOPE_FORCE_FALLBACK" in text


def test_bad_engine_name():
    with pytest.raises(tensorscope.errors.OptionsError, match="engine"):
        tensorscope.trace(engine="cuda")


def test_native_tracer_bug_never_reaches_user_code(monkeypatch):
    from tensorscope.recording import engines, session

    def broken(self, sess):
        raise ZeroDivisionError("tracer bug")

    monkeypatch.setattr(engines.NativeEngine, "finish", broken)
    monkeypatch.setattr(session, "_warned_tracer_bug", False)
    x = torch.randn(3)
    with pytest.warns(RuntimeWarning, match="internal error"):
        with tensorscope.trace(engine="native", leaks=False) as t:
            y = x * 2
    assert torch.equal(y, x * 2) and t.metadata["tracer_errors"] >= 1


# ---------------------------------------------------------------------------
# nothing visible changes (native engine)
# ---------------------------------------------------------------------------
def test_linalg_composites_bitwise_equal_to_eager():
    torch.manual_seed(0)
    a = torch.randn(6, 6)

    def f():
        return [torch.linalg.svdvals(a), torch.linalg.matrix_norm(a, ord=2), torch.linalg.cond(a),
                torch.linalg.eigvalsh(a + a.t())]

    ref = f()
    with tensorscope.trace(engine="native", leaks=False):
        got = f()
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


def _program():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.SiLU(), torch.nn.Linear(6, 2))
    m(torch.randn(3, 6)).sum().backward()
    return m


class _LogDispatch(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.log.append(str(func))
        return func(*args, **(kwargs or {}))


class _LogFunction(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.log.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode_cls", [_LogDispatch, _LogFunction])
@pytest.mark.parametrize("inside", [False, True])
def test_user_modes_see_what_they_see_without_us(mode_cls, inside):
    with mode_cls() as plain:
        _program()
    if inside:
        with tensorscope.trace(engine="native", leaks=False):
            with mode_cls() as seen:
                _program()
    else:
        with mode_cls() as seen:
            with tensorscope.trace(engine="native", leaks=False):
                _program()
    assert seen.log == plain.log


class _CountFunction(torch.overrides.TorchFunctionMode):
    """Every call a user's TorchFunctionMode sees, by qualified name (``getset_descriptor.__get__``
    is a tensor attribute read, ``TensorBase.untyped_storage`` a storage read)."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.log.append(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def _mlp_program(keep):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)

    def run():
        y = m(x)
        loss = y.square().mean()
        loss.backward()
        keep.append((y, loss))   # alive at the end: the leak finder reads their storages and graph
    return m, run


def _conv_program(keep):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.SiLU(),
                            torch.nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)

    def run():
        y = m(x)
        loss = y.square().mean()
        loss.backward()
        keep.append((y, loss))   # alive at the end: the leak finder reads their storages and graph
    return m, run


@pytest.mark.parametrize("program", [_mlp_program, _conv_program])
@pytest.mark.parametrize("engine", ["native", "python"])
@pytest.mark.parametrize("inside", [False, True])
def test_user_function_mode_sees_only_the_program(program, engine, inside):
    """A default trace (leak finder on, non-finite screen on) is invisible to a user's function mode
    entered around it or inside it: exactly the calls of the untraced program, in order."""
    keep = []
    m, run = program(keep)
    with _CountFunction() as plain:
        run()
    if inside:
        with tensorscope.trace(engine=engine) as t:
            with _CountFunction() as seen:
                run()
    else:
        with _CountFunction() as seen:
            with tensorscope.trace(engine=engine) as t:
                run()
    assert t.metadata["engine"] == engine
    assert t.metadata["tracer_errors"] == 0, t.metadata["tracer_error_messages"]
    assert t.ops.num_rows > 0 and len(plain.log) > 0
    assert t.leaks is not None   # the leak finder ran and read the tensors alive at the end
    assert seen.log == plain.log


@pytest.mark.parametrize("inside", [False, True])
def test_flop_counter_and_debug_mode_unchanged(inside):
    from torch.utils._debug_mode import DebugMode
    from torch.utils.flop_counter import FlopCounterMode

    for make, read in ((lambda: FlopCounterMode(display=False), lambda m: m.get_total_flops()),
                       (DebugMode, lambda m: m.debug_string())):
        with make() as plain:
            _program()
        if inside:
            with tensorscope.trace(engine="native", leaks=False):
                with make() as seen:
                    _program()
        else:
            with make() as seen:
                with tensorscope.trace(engine="native", leaks=False):
                    _program()
        assert read(seen) == read(plain)


def _profiled_ops(prof):
    return sorted((e.key, e.count) for e in prof.key_averages() if e.key.startswith("aten::"))


@pytest.mark.parametrize("engine", ["native", "python"])
@pytest.mark.parametrize("inside", [False, True])
def test_profiler_sees_the_same_ops_and_coexists(engine, inside):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as plain:
        _program()
    if inside:
        with tensorscope.trace(engine=engine, leaks=False) as t:
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as seen:
                _program()
    else:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as seen:
            with tensorscope.trace(engine=engine, leaks=False) as t:
                _program()
    assert t.ops.num_rows > 0
    if engine == "native":   # the python engine's dispatch mode adds its own detach rows for the profiler
        assert _profiled_ops(seen) == _profiled_ops(plain)


def test_native_engine_results_bitwise_equal_and_no_extra_detach():
    ref = _program()
    with _LogDispatch() as outer:
        with tensorscope.trace(engine="native", leaks=False):
            got = _program()
    for p, q in zip(ref.parameters(), got.parameters()):
        assert torch.equal(p.grad, q.grad)
    with _LogDispatch() as plain:
        _program()
    assert outer.log.count("aten.detach.default") == plain.log.count("aten.detach.default")


def test_nonfinite_screen_native_invisible_and_correct():
    def run():
        x = torch.tensor([1.0, 0.0, -1.0])
        y = torch.log(x)            # produces -inf and nan
        z = y * 2                   # propagates
        w = torch.ones(3)
        w.add_(z)                   # in-place: target was finite, z was not
        torch.exp(torch.zeros(2))

    with _LogDispatch() as plain:
        run()
    with _LogDispatch() as seen:
        with tensorscope.trace(engine="native", leaks=False) as tn:
            run()
    assert seen.log == plain.log   # no sum/item/isfinite dispatched by the screen
    tp = _trace("python", run)
    compare(tp, tn)
    rows = {r["op"]: r for r in tn.ops.to_pylist()}
    assert rows["aten.log.default"]["nonfinite"] == 2 and rows["aten.log.default"]["nonfinite_produced"]
    assert rows["aten.mul.Tensor"]["nonfinite"] == 2 and not rows["aten.mul.Tensor"]["nonfinite_produced"]
    assert rows["aten.exp.default"]["nonfinite"] == 0


def test_leaks_and_storages_with_native_engine():
    keep = []

    def run():
        a = torch.randn(100)
        keep.append(a * 2)
        del a

    with tensorscope.trace(engine="native") as t:
        run()
    tens = t.tensors.to_pylist()
    assert any(r["free_seq"] is not None for r in tens)   # randn's storage died inside the trace
    assert t.leaks.num_rows == 1 and t.leaks.to_pylist()[0]["nbytes"] == 400
    keep.clear()


# ---------------------------------------------------------------------------
# op hooks (collectives): the same calls under both engines
# ---------------------------------------------------------------------------
def test_op_hook_receives_collectives_under_both_engines(tmp_path):
    import torch.distributed as dist

    from tensorscope.recording.ophooks import add_op_hook, remove_op_hook

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    excepthook = sys.excepthook   # init_process_group installs its own, for good
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        got = {}
        for eng in ("python", "native"):
            seen = []

            def hook(seq, op, inputs, outputs, seen=seen):
                seen.append((seq, op, [type(i).__name__ for i in inputs],
                             None if outputs is None else len(outputs)))

            def bad_hook(seq, op, inputs, outputs):
                raise ValueError("hook bug")

            h = add_op_hook(("c10d",), hook)
            h2 = add_op_hook("c10d", bad_hook)
            try:
                x = torch.ones(4)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)   # the bad hook's "internal error" note
                    with tensorscope.trace(engine=eng, leaks=False) as t:
                        dist.all_reduce(x)
                        x * 2
            finally:
                remove_op_hook(h)
                remove_op_hook(h2)
            assert torch.equal(x, torch.ones(4))
            assert t.metadata["engine"] == eng
            rows = {r["seq"]: r["op"] for r in t.ops.to_pylist()}
            assert seen and all(rows[s] == op for s, op, _, _ in seen), (seen, rows)
            assert t.metadata["tracer_errors"] == len(seen)   # the bad hook: counted, never raised
            got[eng] = [s[1:] for s in seen]
        assert got["python"] == got["native"]
        assert any("ScriptObject" in types for _, types, _ in got["native"])   # the process group
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


def test_two_threads_tracing_at_once():
    # the native observer records one trace per process: a second, concurrent trace on another
    # thread falls back to the python engine and says why; each records only its own thread
    barrier = threading.Barrier(2, timeout=60)
    results = {}

    def work(name, n):
        with tensorscope.trace(leaks=False) as t:
            barrier.wait()
            x = torch.randn(n)
            for _ in range(5):
                x = x.exp().log()
            barrier.wait()
        results[name] = t

    th = threading.Thread(target=work, args=("b", 5))
    th.start()
    work("a", 3)
    th.join()
    engines = sorted(t.metadata["engine"] for t in results.values())
    assert engines == ["native", "python"]
    py = next(t for t in results.values() if t.metadata["engine"] == "python")
    assert "another thread" in py.metadata["engine_reason"]
    for name, n in (("a", 3), ("b", 5)):
        ops = results[name].ops.to_pylist()
        assert [r["op"] for r in ops] == ["aten.randn.default"] + ["aten.exp.default", "aten.log.default"] * 5
        assert all(s == [n] for r in ops for s in r["out_shapes"])


def test_torch_compile_internals_are_not_recorded():
    # Dynamo runs ops of its own while it compiles (a dispatch mode is disabled then; the
    # observer is paused through Dynamo's compile callbacks): both engines record the same ops
    @torch.compile(backend="eager")
    def f(x):
        return (x.sin() * 2).relu()

    x = torch.randn(8)
    ref = f(x)
    # (not compare(): each trace recompiles, and the generated code's file name differs)
    for eng in ("python", "native"):
        t = _trace(eng, lambda: f(x))
        assert [r["op"] for r in t.ops.to_pylist()] == ["aten.sin.default", "aten.mul.Tensor", "aten.relu.default"]
    assert torch.equal(f(x), ref)


def test_native_engine_on_unusual_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # nested/sparse prototype notices
        with tensorscope.trace(engine="native") as t:
            with FakeTensorMode():
                a = torch.randn(4, 4)
                (a @ a).relu()
            torch.randn(3, device="meta") + 1
            torch.randn(4, 4).to_sparse() * 2
            torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]).sin()
            with torch.inference_mode():
                x = torch.ones(3)
                x.add_(1).log_()
            torch.randn(3, dtype=torch.complex64).exp()
            torch.ones(5, dtype=torch.float16) * 1e5
    assert t.metadata["tracer_errors"] == 0, t.metadata["tracer_error_messages"]
    assert not any("CUDA" in n for n in t.metadata["notes"])   # meta tensors are not "device outputs"
    rows = t.ops.to_pylist()
    assert rows[-1]["op"] == "aten.mul.Tensor" and rows[-1]["nonfinite"] == 5   # fp16 overflow
    assert "meta" in [d for r in rows for d in r["out_devices"]]
    assert "non_strided" in [f for r in rows for f in r["out_formats"]]
