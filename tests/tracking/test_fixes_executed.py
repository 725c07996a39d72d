"""Every leak fix is checked against what it acts on, and executed (issue 29).

A ``.detach()``/comprehension fix only over containers whose elements are all tensors; an element of
another holder (a ``ModelOutput``-like dict subclass, a cache class holding lists of tensors, like
transformers' ``DynamicCache``: transformers is not installed, so a stand-in with the same shape is
built here) is detached where it sits. Model and optimizer state is never told to ``del``. Each fix
is run in the notebook namespace and the storages the finding named are checked through weak
references to be freed.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

import tensorscope.tracking.leaks as L
from tests.tracking.test_leaks import apply_fix, notebook, report, rows_of


class DynamicCache:
    """The shape of transformers' DynamicCache: per-layer key/value tensors in two lists, grown by update()."""

    def __init__(self):
        self.key_cache: list = []
        self.value_cache: list = []

    def update(self, k, v, layer):
        if len(self.key_cache) <= layer:
            self.key_cache.append(k)
            self.value_cache.append(v)
        else:
            self.key_cache[layer] = torch.cat([self.key_cache[layer], k], -2)
            self.value_cache[layer] = torch.cat([self.value_cache[layer], v], -2)
        return self.key_cache[layer], self.value_cache[layer]

    def __len__(self):
        return len(self.key_cache)


class ModelOutput(OrderedDict):
    """transformers' ModelOutput is an OrderedDict subclass with attribute access."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _decoder_ns():
    torch.manual_seed(0)
    ns = notebook("")
    ns.update(DynamicCache=DynamicCache, ModelOutput=ModelOutput)
    exec("lin = torch.nn.Linear(64, 64)\n"
         "def decoder(x, layers=2):\n"
         "    cache = DynamicCache()\n"
         "    h = x\n"
         "    for layer in range(layers):\n"
         "        k, v = cache.update(lin(h), lin(h) * 2, layer)\n"
         "        h = torch.relu(k + v)\n"
         "    return ModelOutput(logits=lin(h), past_key_values=cache)\n"
         "out = decoder(torch.randn(256, 64))\n", ns)
    return ns


def _graph_refs(tensors):
    """Weak references to every storage saved in the autograd graphs of ``tensors`` (no unpack hook runs),
    except the tensors' own storages (an activation saves its result: that is the value, kept)."""
    own = {t.untyped_storage().data_ptr() for t in tensors}
    out, todo, seen = [], [t.grad_fn for t in tensors], set()
    while todo:
        n = todo.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        for a in dir(n):
            if a.startswith("_raw_saved_"):
                v = getattr(n, a)
                for sv in v if isinstance(v, (list, tuple)) else [v]:
                    d = getattr(sv, "data", None)
                    if isinstance(d, torch.Tensor) and not isinstance(d, torch.nn.Parameter) \
                            and d.untyped_storage().nbytes() >= 256 * 64 * 4 \
                            and d.untyped_storage().data_ptr() not in own:
                        out.append(weakref.ref(d.untyped_storage()))
        todo.extend(f for f, _ in n.next_functions)
    return out


def test_a_dict_subclass_holding_a_cache_object_gets_fixes_that_run():
    """Issue 29: the GPT-2 fix ``out = {k: v.detach() for k, v in out.items()}`` raised AttributeError on
    the DynamicCache; the fix now detaches each tensor where it sits and runs."""
    ns = _decoder_ns()
    out = ns["out"]
    refs = _graph_refs([out["logits"], *out["past_key_values"].key_cache, *out["past_key_values"].value_cache])
    assert len(refs) >= 2
    rep = report(ns)
    (grp,) = [g for g in rep.groups if g.holder_kind == "autograd_graph" and g.holder.startswith("global out")]
    assert "out.items()" not in grp.fix, grp.fix                       # the old fix: AttributeError
    code = L.fix_code(grp.fix)
    assert "out['logits'] = out['logits'].detach()" in code, code
    assert "out['past_key_values'].key_cache = [v.detach() for v in out['past_key_values'].key_cache]" in code
    assert "out['past_key_values'].value_cache = [v.detach() for v in out['past_key_values'].value_cache]" in code
    assert "ModelOutput" in grp.fix                                    # the holder is named
    del out
    apply_fix(ns, grp.fix)                                             # runs: no AttributeError
    assert all(r() is None for r in refs)                              # and frees every saved activation
    assert isinstance(ns["out"], ModelOutput) and ns["out"].logits.grad_fn is None
    assert not [r for r in rows_of(report(ns), kind="autograd_graph") if r["holder"].startswith("global out")]


def test_an_exact_dict_and_list_of_tensors_get_the_comprehension_and_it_runs():
    ns = notebook("w = torch.randn(64, 64, requires_grad=True)\n"
                  "outs = {'a': torch.randn(512, 64) @ w, 'b': torch.tanh(torch.randn(512, 64) @ w)}\n"
                  "hist = [torch.relu(torch.randn(512, 64) @ w) for _ in range(3)]\n"
                  "mixed = [torch.sigmoid(torch.randn(512, 64) @ w), 'note', 3]\n")
    refs = _graph_refs(list(ns["outs"].values()) + ns["hist"] + ns["mixed"][:1])
    rep = report(ns)
    fixes = {g.holder: g.fix for g in rep.groups if g.holder_kind == "autograd_graph"}
    assert L.fix_code(fixes["global outs (autograd graphs)"]) == "outs = {k: v.detach() for k, v in outs.items()}"
    assert L.fix_code(fixes["global hist (autograd graphs)"]) == "hist = [v.detach() for v in hist]"
    # a list that also holds a string and an int: no comprehension over it (v.detach() would raise)
    assert L.fix_code(fixes["global mixed (autograd graphs)"]) == "mixed[0] = mixed[0].detach()"
    for f in fixes.values():
        apply_fix(ns, f)
    assert all(r() is None for r in refs)
    assert ns["mixed"][1:] == ["note", 3]


def test_model_and_optimizer_state_are_never_told_to_del():
    """Issue 29: model parameters got ``del model`` as their first fix (and a buffer ``del model.buf``)."""
    ns = notebook("model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))\n"
                  "model.register_buffer('buf', torch.zeros(5000))\n"
                  "opt = torch.optim.Adam(model.parameters())\n"
                  "losses = []\n"
                  "for _ in range(2):\n"
                  "    loss = model(torch.randn(128, 64)).pow(2).mean()\n"
                  "    loss.backward()\n"
                  "    opt.step()\n"
                  "    losses.append(loss)\n"
                  "losses.append(model(torch.randn(128, 64)).pow(2).mean())   # a graph kept: the leak\n"
                  "del loss\n")
    rep = report(ns)
    state = [r for r in rep.table.to_pylist() if r["holder_kind"] in ("model_state", "optimizer_state")]
    assert state and all(r["expected"] for r in state)
    for r in state:
        assert not L.fix_code(r["fix"]).startswith("del "), r
        assert "del model" not in r["fix"] and "del opt" not in r["fix"], r
    grads = [r for r in state if r["holder"].endswith(".grad")]
    assert grads and {r["fix"] for r in grads} == {"model.zero_grad(set_to_none=True)"}
    # the leak (the graphs kept by losses) comes first; state after it, with nothing to run
    kinds = [g.holder_kind for g in rep.groups if g.holder.startswith(("global model", "global opt", "global losses"))]
    assert kinds[0] == "autograd_graph" and set(kinds[1:]) <= {"model_state", "optimizer_state", "global"}
    text = rep.to_text(max_groups=1000)
    assert text.index("global losses (autograd graphs)") < text.index("not leaks (model/optimizer state") \
        < text.index("[model_state] global model")
    g = next(g for g in rep.groups if g.holder_kind == "model_state")
    assert L.fix_code(g.fix) in ("", "model.zero_grad(set_to_none=True)"), g.fix
    # the grad fix runs and frees the gradients
    grad_refs = [weakref.ref(p.grad.untyped_storage()) for p in ns["model"].parameters()]
    apply_fix(ns, next(r["fix"] for r in grads))
    assert all(r() is None for r in grad_refs)


def test_tuples_are_rebuilt_or_released_never_assigned_into():
    """A tuple's element cannot be assigned: all tensors → rebuilt with tuple(...); else the holder goes."""
    ns = notebook("w = torch.randn(64, 64, requires_grad=True)\n"
                  "pair = (torch.relu(torch.randn(512, 64) @ w), torch.tanh(torch.randn(512, 64) @ w))\n"
                  "tagged = (torch.sigmoid(torch.randn(512, 64) @ w), 'step 3')\n")
    refs_pair = _graph_refs(list(ns["pair"]))
    refs_tagged = _graph_refs([ns["tagged"][0]])
    fixes = {g.holder: g.fix for g in report(ns).groups if g.holder_kind == "autograd_graph"}
    assert L.fix_code(fixes["global pair (autograd graphs)"]) == "pair = tuple(v.detach() for v in pair)"
    assert L.fix_code(fixes["global tagged (autograd graphs)"]) == "del tagged"
    for f in fixes.values():
        apply_fix(ns, f)
    assert all(r() is None for r in refs_pair + refs_tagged)
    assert type(ns["pair"]) is tuple and "tagged" not in ns
