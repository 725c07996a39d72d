"""What memory is made of, on real workloads, under both engines: ``tensors.category`` checked
against what the program holds (every parameter's storage, every ``.grad``, the optimizer's state,
what the autograd graph saved, read from the graph itself), the timeline and per-module memory."""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import tensorscope
from tensorscope import schema as S

ENGINES = ["native", "python"]


def _ptr(t):
    return t.untyped_storage().data_ptr()


def graph_saved(loss, exclude=()):
    """{data_ptr: nbytes} of the tensors the autograd graph behind ``loss`` saved (``_raw_saved_*``
    read through ``.data``, which runs no unpack hook), minus ``exclude`` (data pointers)."""
    out, seen, stack = {}, set(), [loss.grad_fn]
    skip = set(exclude)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for name in dir(node):
            if not name.startswith("_raw_saved_"):
                continue
            try:
                raw = getattr(node, name)
            except Exception:
                continue
            for sv in raw if isinstance(raw, (list, tuple)) else (raw,):
                try:
                    data = sv.data
                except Exception:
                    continue
                if isinstance(data, torch.Tensor) and _ptr(data) and _ptr(data) not in skip:
                    out[_ptr(data)] = data.untyped_storage().nbytes()
        stack.extend(f for f, _ in node.next_functions)
    return out


def _cats(t):
    return t.tensors.select(["storage_id", "nbytes", "category", "alloc_seq", "free_seq"]).to_pylist()


def _bytes(t, cat):
    return sum(r["nbytes"] for r in _cats(t) if r["category"] == cat)


class Block(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(c)
        self.conv2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def resnet():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               Block(8), Block(8), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(8, 10))


class TBlock(torch.nn.Module):
    def __init__(self, d=32, ckpt=False):
        super().__init__()
        self.embed = torch.nn.Linear(16, d)
        self.layer = torch.nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(d, 5)
        self.ckpt = ckpt

    def forward(self, x):
        h = self.embed(x)
        h = checkpoint(self.layer, h, use_reentrant=False) if self.ckpt else self.layer(h)
        return self.head(h)


def _step_checks(t, model, opt, x, expected_saved):
    cats = _cats(t)
    assert all(r["category"] in S.MEMORY_CATEGORIES for r in cats)
    by = {}
    for r in cats:
        by.setdefault(r["category"], []).append(r)
    n_params = len({_ptr(p) for p in model.parameters()})
    # every parameter storage the trace saw is a parameter (all of them are used by the step)
    assert sum(r["nbytes"] for r in by.get("parameter", [])) == sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert len(by.get("parameter", [])) == n_params
    # every .grad alive at the end is a gradient
    want_grad = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    alive_grads = sum(r["nbytes"] for r in by.get("gradient", []) if r["free_seq"] is None)
    assert alive_grads == want_grad
    # the optimizer's state tensors
    if opt is not None:
        want_state = sum(v.untyped_storage().nbytes() for st in opt.state.values() for v in st.values()
                         if isinstance(v, torch.Tensor))
        assert sum(r["nbytes"] for r in by.get("optimizer_state", [])) == want_state
    # the bytes saved for backward equal what the autograd graph held
    assert sum(r["nbytes"] for r in by.get("activation", [])) == expected_saved
    assert sum(r["nbytes"] for r in by.get("input", [])) >= x.untyped_storage().nbytes()
    return by


def _expected_saved(model, x, loss_fn, inputs=()):
    """Bytes the graph saves for one forward, params, buffers and the inputs excluded (run untraced)."""
    excl = {_ptr(p) for p in model.parameters()} | {_ptr(b) for b in model.buffers()} | {_ptr(x)}
    excl |= {_ptr(i) for i in inputs}
    loss = loss_fn(model(x))
    got = sum(graph_saved(loss, excl).values())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return got


@pytest.mark.parametrize("engine", ENGINES)
def test_resnet_step_with_sgd_categories_match_what_the_program_holds(engine):
    model = resnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 3, 8, 8)
    y = torch.tensor([1, 2, 3, 4])

    def loss_fn(out):
        return F.cross_entropy(out, y)

    expected = _expected_saved(model, x, loss_fn, inputs=(y,))   # nll_loss saves the target: an input
    with tensorscope.trace(engine=engine) as t:
        loss = loss_fn(model(x))
        loss.backward()
        opt.step()
    assert expected > 0
    by = _step_checks(t, model, opt, x, expected)
    assert sum(r["nbytes"] for r in by["buffer"]) == sum(b.untyped_storage().nbytes() for b in model.buffers())
    assert by.get("temporary")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("ckpt", [False, True])
def test_transformer_block_with_adam_and_activation_checkpointing(engine, ckpt):
    torch.manual_seed(0)
    model = TBlock(ckpt=ckpt)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(2, 6, 16)

    def loss_fn(out):
        return out.square().mean()

    # warm the optimizer so its state exists before the trace, as in a training loop
    loss_fn(model(x)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    kept = []   # checkpoint keeps the layer's input for the recomputation, outside the loss's graph
    hook = model.embed.register_forward_hook(lambda m, i, o: kept.append(o.untyped_storage().nbytes()))
    expected = _expected_saved(model, x, loss_fn) + (kept[0] if ckpt else 0)
    hook.remove()
    kept.clear()
    with tensorscope.trace(engine=engine) as t:
        loss = loss_fn(model(x))
        loss.backward()
        opt.step()
    by = _step_checks(t, model, opt, x, expected)
    assert len(by["optimizer_state"]) == 3 * len(list(model.parameters()))
    act = sum(r["nbytes"] for r in by["activation"])
    if ckpt:
        # the checkpointed layer keeps its input only: far less than without checkpointing
        plain = TBlock(ckpt=False)
        plain.load_state_dict(model.state_dict())
        assert act < _expected_saved(plain, x, loss_fn) / 2
        assert t.tensors.filter(pa.compute.equal(t.tensors.column("category"), "temporary")).num_rows > 0
    mm = {r["module"]: r for r in t.module_memory.to_pylist()}
    assert mm["layer"]["activation_bytes"] >= mm["layer.self_attn"]["activation_bytes"] if "layer.self_attn" in mm else True
    assert sum(r["own_activation_bytes"] for r in mm.values()) <= act


@pytest.mark.parametrize("engine", ENGINES)
def test_a_compiled_mlp(engine):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cm = torch.compile(model)
    x = torch.randn(5, 8)

    def loss_fn(out):
        return out.square().mean()

    loss = loss_fn(cm(x))   # compiled before the trace
    excl = {_ptr(p) for p in model.parameters()} | {_ptr(x)}
    expected = sum(graph_saved(loss, excl).values())
    loss.backward()
    with tensorscope.trace(engine=engine) as t:
        loss_fn(cm(x)).backward()
    assert expected > 0
    by = _step_checks(t, model, None, x, expected)
    assert not any(r["alloc_seq"] is None and r["category"] == "activation" for r in by["activation"])


@pytest.mark.parametrize("engine", ENGINES)
def test_autocast_and_inference_mode(engine):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)

    def loss_fn(out):
        return out.float().square().mean()

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_fn(model(x))

    excl = {_ptr(p) for p in model.parameters()} | {_ptr(x)}
    loss = run()
    expected = sum(graph_saved(loss, excl).values())   # the bf16 weight copies are saved too
    loss.backward()
    model.zero_grad(set_to_none=True)
    with tensorscope.trace(engine=engine) as t:
        run().backward()
    _step_checks(t, model, None, x, expected)
    with tensorscope.trace(engine=engine) as t2:
        with torch.inference_mode():
            model(x).sum()
    cats = {r["category"] for r in _cats(t2)}
    assert "activation" not in cats and "gradient" not in cats and "parameter" in cats


@pytest.mark.parametrize("engine", ENGINES)
def test_forward_traced_backward_not_yet_the_graph_holds_the_activations(engine):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    x = torch.randn(4, 8)
    with tensorscope.trace(engine=engine) as t:
        loss = model(x).sum()
    excl = {_ptr(p) for p in model.parameters()} | {_ptr(x)}
    assert _bytes(t, "activation") == sum(graph_saved(loss, excl).values()) > 0
    # ... and the next trace runs the backward: those storages are freed by it, made before it
    with tensorscope.trace(engine=engine) as t2:
        loss.backward()
    assert _bytes(t2, "activation") == _bytes(t, "activation")
    assert {r["category"] for r in _cats(t2) if r["free_seq"] is None and r["alloc_seq"] is not None} <= {"gradient"}


@pytest.mark.parametrize("engine", ENGINES)
def test_timeline_adds_up_to_the_memory_view_and_marks_the_peak(engine):
    torch.manual_seed(0)
    model = resnet()
    x = torch.randn(2, 3, 8, 8)
    with tensorscope.trace(engine=engine) as t:
        model(x).sum().backward()
    tl = t.memory_timeline
    assert tl.schema.equals(S.MEMORY_TIMELINE, check_metadata=False)
    assert tl.num_rows == t.ops.num_rows
    cols = tl.to_pydict()
    mem = t.memory.column("live_bytes").to_pylist()
    for i in range(tl.num_rows):
        assert sum(cols[f"{c}_bytes"][i] for c in S.MEMORY_CATEGORIES) == cols["live_bytes"][i] == mem[i]
    peak = [i for i in range(tl.num_rows) if cols["is_peak"][i]]
    assert len(peak) == 1 and cols["live_bytes"][peak[0]] == max(mem)
    assert cols["op"][peak[0]] == t.ops.column("op")[cols["seq"][peak[0]]].as_py()
    at = t.memory_at()
    assert sum(at.column("bytes").to_pylist()) == max(mem)
    assert {r["category"] for r in at.to_pylist()} >= {"parameter", "activation"}
    assert sum(t.memory_at(0).column("bytes").to_pylist()) == mem[0]
    with pytest.raises(IndexError):
        t.memory_at(t.ops.num_rows)
    # per module: the children roll into their parent
    mm = {r["module"]: r for r in t.module_memory.to_pylist()}
    assert mm["3"]["activation_bytes"] == sum(r["own_activation_bytes"] for m, r in mm.items()
                                              if m == "3" or m.startswith("3."))
    assert mm["3"]["fwd_peak_bytes"] >= mm["3.conv1"]["fwd_peak_bytes"]
    assert mm["3"]["bwd_peak_bytes"] is not None


def test_the_summary_draws_the_timeline_and_the_module_table():
    torch.manual_seed(0)
    model = resnet()
    x = torch.randn(2, 3, 8, 8)
    with tensorscope.trace() as t:
        model(x).sum().backward()
    s = t.summary()
    text = s.to_text()
    assert "at the peak" in text and "memory per module" in text and "activation" in text
    from urllib.parse import unquote

    html = unquote(s.to_html())   # the charts are SVG data URIs (percent-encoded)
    assert html.count("<svg xmlns='http://www.w3.org/2000/svg' class='tensorscope-memory'") == 1 and "<path d='M" in html
    assert "activations (saved for backward)" in html


def test_old_traces_load_with_the_category_null(tmp_path):
    import os

    from tests.helpers import TESTS

    old = tensorscope.load(os.path.join(TESTS, "data", "golden-schema-1.2"))
    assert old.tensors.column("category").null_count == old.tensors.num_rows > 0
    tl = old.memory_timeline   # everything "other": the timeline still adds up
    # (to the live bytes of today's rule: a saved memory table keeps the rule it was saved with)
    from tensorscope.analyses.memory import memory_table

    assert tl.column("other_bytes").to_pylist() == \
        memory_table(old.tensors, old.ops.num_rows).column("live_bytes").to_pylist()
    assert "at the peak" not in old.summary().to_text()
    new = tensorscope.load(os.path.join(TESTS, "data", f"golden-schema-{S.SCHEMA_VERSION}"))
    assert new.tensors.column("category").null_count == 0
    assert "activation" in new.tensors.column("category").to_pylist()


@pytest.mark.parametrize("engine", ENGINES)
def test_categorising_reaches_no_user_mode_and_keeps_nothing_alive(engine):
    import gc
    import weakref

    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class FSpy(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    class DSpy(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        return model, torch.optim.Adam(model.parameters()), torch.randn(3, 8)

    def step(model, opt, x):
        model(x).square().mean().backward()
        opt.step()

    seen = []
    for traced in (False, True):
        model, opt, x = make()
        with FSpy() as f, DSpy() as d:
            if traced:
                # (the python engine's non-finite probes reach a dispatch mode below it: not this test's subject)
                with tensorscope.trace(engine=engine, nonfinite=False) as t:
                    step(model, opt, x)
            else:
                step(model, opt, x)
        seen.append((f.seen, d.seen))
    assert seen[0] == seen[1]   # the build's reads of parameters, .grad and optimizer state are invisible
    assert {"parameter", "gradient", "optimizer_state"} <= set(t.tensors.column("category").to_pylist())
    refs = [weakref.ref(model), weakref.ref(opt), weakref.ref(next(model.parameters()))]
    del model, opt, x
    gc.collect()
    assert all(r() is None for r in refs)   # the trace keeps no module, optimizer or tensor
    assert t.memory_timeline.num_rows == t.ops.num_rows
