"""Holder paths: the readable path text, the holder kind and the fix (the label of each edge is
labels.py's).

Labels are computed lazily, only along reported paths, and path descriptions are
memoized per node: a list of 100k tensors costs one description of the list plus a
small extension per element. ``_fix`` turns a path into a concrete statement;
``_merge_fixes`` joins the fixes of several holders into one that runs in order.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

from ..._common import fmt_bytes
from .classify import _TENSOR, _isa, _types
from .labels import _IDENT, _apply_expr, _Labeler
from .roots import _HIDDEN_UNDERS, _NEXT_CELL, _Root
from .search import _Search

# -- path → holder text, kind, fix ---------------------------------------------------------------
# Descriptions are built incrementally and memoized per node: a list of 100k tensors costs one
# description of the list plus one small extension per element, not 100k walks from the root.
_MODULE_DICTS = {"_parameters": "param", "_buffers": "buffer", "_modules": "submodule"}


_GRAPH_KINDS = frozenset(("grad_fn", "node", "saved", "variable"))


class _PathState:
    """The description of the path from a root to one node (immutable once built)."""

    __slots__ = ("root", "pos", "expr", "flags", "marks", "first_kind", "last_kind", "nsteps", "text", "run",
                 "inst", "moddict", "pexpr")

    def __init__(self, root: _Root):
        self.root = root
        self.pos = 0
        self.expr = root.expr
        self.flags: frozenset = frozenset()
        self.marks: dict[str, tuple] = {}
        self.first_kind: Optional[str] = None
        self.last_kind: Optional[str] = None
        self.nsteps = 0
        self.text = root.label
        self.run: tuple[str, ...] = ()
        self.inst = False          # the last raw step entered an instance's __dict__
        self.moddict: Optional[tuple] = None        # (what, expr, pos, parent) while a Module's _parameters/_buffers/_modules waits for its key
        self.pexpr: Optional[str] = None            # the expression of the node's container (the last step's base)

    def copy(self) -> _PathState:
        n = _PathState.__new__(_PathState)
        n.root, n.pos, n.expr, n.flags, n.marks = self.root, self.pos, self.expr, self.flags, self.marks
        n.first_kind, n.last_kind, n.nsteps, n.text, n.run = (self.first_kind, self.last_kind, self.nsteps,
                                                             self.text, self.run)
        n.inst, n.moddict, n.pexpr = self.inst, self.moddict, self.pexpr
        return n

    def full_text(self) -> str:
        return self.text + _render_run(self.run)

    def extend(self, kind: str, text: str, parent, grandparent) -> _PathState:
        n = self.copy()
        n.pos = self.pos + 1
        if (kind == "index" or kind == "key") and self.moddict is None and not self.inst:
            # the parent is a list/tuple/dict: never a module or an optimizer; the common case
            e = self.expr
            n.expr = f"{e}[{text}]" if e is not None else None
            n.pexpr = e
            if n.first_kind is None:
                n.first_kind = kind
            n.last_kind = kind
            n.nsteps += 1
            n.text = (self.text + _render_run(self.run) if self.run else self.text) + f"[{text}]"
            n.run = ()
            return n
        owner = grandparent if self.inst else parent   # attributes of an instance sit in its __dict__
        n.inst = False
        if kind == "instdict":
            n.inst = True
            return n
        if kind in ("cell", "tbnext"):
            return n
        if kind == "fnpart":
            if text == "__closure__":
                n.flags = self.flags | {"closure"}
            return n
        if self.moddict is not None:
            what, mexpr, mpos = self.moddict
            n.moddict = None
            if kind == "key":
                name = text[1:-1] if len(text) >= 2 and text[0] in "'\"" else text
                if what != "submodule":
                    n.flags = n.flags | {what}
                    if "module" not in n.marks:
                        n.marks = dict(n.marks, module=(mpos, mexpr))
                step = ("index", name) if name.isdigit() else ("attr", name)
                n._append(step[0], step[1], mexpr)
                return n
            n._append("attr", text, mexpr)  # not the shape we expected: render both steps plainly
        if kind == "attr" and text in _MODULE_DICTS and _isa(owner, "module"):
            mpos = self.pos - (1 if self.inst else 0)
            n.moddict = (_MODULE_DICTS[text], self.expr, mpos)
            if "topmodule" not in n.marks:
                n.marks = dict(n.marks, topmodule=(mpos, self.expr))
            return n
        if kind == "attr" and self.inst and _isa(owner, "module"):
            n.flags = n.flags | {"modattr"}   # a plain attribute: not a parameter, buffer or submodule
        if "optimizer" not in n.marks and _isa(owner, "optimizer"):
            n.flags = n.flags | {"optimizer"}
            n.marks = dict(n.marks, optimizer=(self.pos - (1 if self.inst else 0), self.expr))
        if kind in _GRAPH_KINDS and "graph" not in n.marks:
            n.flags = n.flags | {"autograd"}
            # the graph's owner (``parent``, a tensor) and the container that holds it (``grandparent``):
            # what the fix may walk (a comprehension only over a container of tensors)
            cont = _container(grandparent) if self.last_kind in ("key", "index") else None
            n.marks = dict(n.marks, graph=(n.pos, self.expr, self.nsteps == 1, self.first_kind, _is_scalar(parent),
                                           self.pexpr, self.last_kind, cont))
        elif kind == "closure":
            n.flags = n.flags | {"closure"}
        elif kind == "genlocal" and "gen" not in n.marks:
            n.marks = dict(n.marks, gen=(self.pos, self.expr))
        elif kind == "grad" and "grad" not in n.marks:
            n.marks = dict(n.marks, grad=(n.pos, self.expr))
        n._append(kind, text, self.expr)
        return n

    def _append(self, kind: str, text: str, base_expr):
        self.expr = _apply_expr(base_expr, kind, text) if base_expr is not None else None
        self.pexpr = base_expr
        if self.first_kind is None:
            self.first_kind = kind
        self.last_kind = kind
        self.nsteps += 1
        if kind == "node":
            self.run = self.run + (text,)
            return
        if self.run:
            self.text = self.text + _render_run(self.run)
            self.run = ()
        self.text = self.text + _render_step(kind, text)


#: id(container) -> what a fix may do with it (``_container``); ids are stable while the search holds
#: every visited object, and the map is dropped with the describer (``_Describer.clear``)
_CONTAINERS: dict[int, tuple[str, bool, bool, str]] = {}


def _container(c) -> tuple[str, bool, bool, str]:
    """(kind, every element is a tensor, every element is a real 0-dim tensor, type name) of the container
    that holds a graph's owner. ``kind`` is ``list``/``dict``/``tuple`` for those exact types (a
    comprehension rebuilds them), ``mapping``/``sequence`` for subclasses and other holders (a
    comprehension would change their type: ``ModelOutput`` → dict), ``other`` otherwise. Element types
    are read from the classification cache, never with isinstance on user objects."""
    key = id(c)
    r = _CONTAINERS.get(key)
    if r is not None:
        return r
    tp = type(c)
    if tp is list or tp is dict or tp is tuple:
        kind = tp.__name__
    elif isinstance(c, dict):
        kind = "mapping"
    elif isinstance(c, (list, tuple)):
        kind = "sequence"
    else:
        kind = "other"
    tensors = scalars = False
    if kind != "other":
        try:
            vals = list(c.values()) if isinstance(c, dict) else list(c)
            tensors = bool(vals) and all(_types.get(type(v)) == _TENSOR for v in vals)
            scalars = tensors and all(_is_scalar(v) for v in vals)
        except Exception:
            tensors = scalars = False
    r = _CONTAINERS[key] = (kind, tensors, scalars, tp.__name__)
    return r


def _is_scalar(t) -> bool:
    """A 0-dim tensor (a loss): its graph is worth nothing once the value is read with .item()."""
    if _types.get(type(t)) != _TENSOR:
        return False
    try:
        return t.dim() == 0 and not t.is_complex()
    except Exception:
        return False


def _render_run(run: tuple[str, ...]) -> str:
    if not run:
        return ""
    if len(run) > 3:
        return f" → {run[0]} → … ({len(run) - 2} nodes) → {run[-1]}"
    return "".join(f" → {n}" for n in run)


def _render_step(kind: str, text: str) -> str:
    if kind == "attr":
        return f".{text}" if _IDENT.match(text) else f".{text!r}"
    if kind in ("key", "index"):
        return f"[{text}]"
    if kind == "dictkey":
        return f" (key {text})"
    if kind == "grad":
        return ".grad"
    if kind == "base":
        return "._base"
    if kind == "grad_fn":
        return f" → grad_fn {text}"
    if kind == "saved":
        return f" → saved {text}"
    if kind == "variable":
        return " → variable"
    if kind == "closure":
        return f" → closure {text}"
    if kind == "local":
        return f" → local {text}"
    if kind == "genlocal":
        return f" → local {text} of the suspended generator" if text else " → local of the suspended generator"
    if kind in ("frame", "obj"):
        return f" → {text}"
    return ""


@dataclass
class _Steps:
    text: str
    kind: str
    fix: str
    cut: int            # chain position whose incoming references the fix removes
    root_label: str
    root_fix: str


class _Describer:
    """Memoized path states per node, and the holder text / kind / fix of a node."""

    def __init__(self, search: _Search):
        self.s = search
        self.lab = _Labeler(search)
        self.lab.describer = self
        self.memo: dict[int, _PathState] = {}

    def state(self, j: int) -> _PathState:
        memo = self.memo
        st = memo.get(j)
        if st is not None:
            return st
        s = self.s
        p = s.par[j]
        if p >= 0:
            ps = memo.get(p)
            if ps is not None:  # the common case: a sibling of a node already described
                kind, text = self.lab.label(j)
                gp = s.par[p]
                st = memo[j] = ps.extend(kind, text, s.order[p], s.order[gp] if gp >= 0 else None)
                return st
        up = []
        k = j
        while k >= 0 and k not in memo:
            up.append(k)
            k = s.par[k]
        if k < 0:
            r = up.pop()  # the root node itself
            st = _PathState(s.roots[s.own[r]])
            memo[r] = st
        else:
            st = memo[k]
        order, par = s.order, s.par
        for n in reversed(up):
            p = par[n]
            gp = par[p]
            kind, text = self.lab.label(n)
            st = st.extend(kind, text, order[p], order[gp] if gp >= 0 else None)
            memo[n] = st
        return st

    def describe(self, j: int, view=None) -> _Steps:
        st = self.state(j)
        root = st.root
        kind = _kind(root.group, st.flags)
        fix, cut = _fix(st, kind, view)
        return _Steps(st.full_text(), kind, fix, cut, root.label, root.fix)

    def clear(self):
        _CONTAINERS.clear()
        self.memo.clear()
        self.lab.cache.clear()
        self.lab.describer = None


#: holder kinds that are a model's or an optimizer's state, not a leak (``expected`` rows)
STATE_KINDS = frozenset(("model_state", "optimizer_state"))
#: the "fix" of state: nothing to run (advice only, in parentheses: ``fix_code`` gives no statement)
MODEL_STATE_FIX = "(model state, not a leak: parameters and buffers live as long as the model is used)"
OPTIMIZER_STATE_FIX = ("(optimizer state, not a leak: the next {opt}.step() needs it; {opt}.state.clear() "
                       "releases it once training is over)")


def _kind(group: str, flags) -> str:
    if group in ("out_cache", "traceback"):
        return group
    if "autograd" in flags:
        return "autograd_graph"
    if "optimizer" in flags:
        return "optimizer_state"
    if "param" in flags or "buffer" in flags:
        return "model_state"      # parameters, their .grad, registered buffers
    if "modattr" in flags:
        return "module"           # an activation kept on a module attribute: a leak
    if "closure" in flags:
        return "closure"
    return group if group in ("global", "local") else "unknown"


def _fix(st: _PathState, kind: str, view) -> tuple[str, int]:
    """(fix, cut): a concrete statement, and the chain position whose references it removes."""
    root = st.root
    if root.group in ("out_cache", "traceback") or (root.group == "local" and root.expr is None):
        return root.fix, 0
    fix, cut = _fix_path(st, kind, view)
    if root.group == "local" and "  (in " not in fix:
        fix += f"  (in {root.label.split(' local ')[0]})"
    return fix, cut


def _fix_path(st: _PathState, kind: str, view) -> tuple[str, int]:
    root = st.root
    full = st.expr
    last = st.pos
    marks = st.marks
    if kind == "autograd_graph":
        return _graph_fix(root, marks["graph"])
    if kind == "optimizer_state":
        p, e = marks["optimizer"]
        # state, not a leak: the next step needs it (never `del opt`)
        return (OPTIMIZER_STATE_FIX.format(opt=e) if e is not None else OPTIMIZER_STATE_FIX.format(opt="opt")), 0
    if kind == "model_state":
        top_pos, top_e = marks.get("topmodule", (0, None))
        if "grad" in marks:
            g, tensor_e = marks["grad"]
            if top_e is not None:
                return f"{top_e}.zero_grad(set_to_none=True)", g
            return (f"{tensor_e}.grad = None", g) if tensor_e else (root.fix, 0)
        # parameters and buffers are the model: never `del model` (nor del model.buf)
        return MODEL_STATE_FIX, 0
    if kind == "module" and full is not None:
        return f"del {full}  (or keep .detach()/.item(), or nothing, instead of the activation)", last
    if kind == "closure":
        return root.fix + "  (the function's closure keeps it)", 0
    if "gen" in marks:
        gp, e = marks["gen"]
        if e is not None:
            return f"{e}.close()  (a suspended generator keeps its locals)", gp
    if view is not None and full is not None:
        vb, sb = view
        return (f"{full} = {full}.clone()  (a {fmt_bytes(vb)} view pins the whole {fmt_bytes(sb)} storage; "
                f"or del {full})"), last
    if full is not None and last > 0:
        if st.last_kind in ("key", "index", "attr"):
            return f"del {full}", last
        if st.last_kind == "grad":
            g, tensor_e = marks["grad"]
            return f"{tensor_e}.grad = None", last
    return root.fix, 0


def _graph_fix(root: _Root, mark: tuple) -> tuple[str, int]:
    """The fix of an autograd graph kept by a tensor (``owner``), checked against what it acts on: a
    comprehension only over an exact list/dict/tuple all of whose elements are tensors (``.item()`` only
    when all are real 0-dim tensors); an element of any other holder (a ``ModelOutput``, a cache class
    holding lists) is detached where it sits, and the holder is named."""
    gpos, owner, _owner_is_elem, _first_kind, _scalar, cexpr, step, cont = mark
    if owner is None:
        return f"{root.fix}  (or store .detach()/.item() instead of the tensor)", 0
    if cont is not None and cexpr is not None:
        ckind, tensors, scalars, tname = cont
        top = cexpr == root.expr   # a list the user appends to (losses), not one inside another holder
        if tensors and ckind == "list" and scalars:
            return (f"{cexpr} = [l.item() for l in {cexpr}]  (" + ("append loss.item(), not loss: " if top else "")
                    + "each scalar keeps its whole autograd graph)"), gpos
        if tensors and ckind == "list":
            return (f"{cexpr} = [v.detach() for v in {cexpr}]  (" + ("append loss.item() or loss.detach(), not "
                    "loss: " if top else "") + "each element keeps its autograd graph)"), gpos
        if tensors and ckind == "tuple":
            return (f"{cexpr} = tuple(v.detach() for v in {cexpr})  (each element keeps its autograd "
                    f"graph)"), gpos
        if tensors and ckind == "dict":
            return (f"{cexpr} = {{k: v.detach() for k, v in {cexpr}.items()}}  (store .detach()/.item(), not the "
                    f"tensor with its graph)"), gpos
        if ckind in ("list", "dict", "mapping", "sequence"):
            what = "" if tensors else ", which also holds other objects"
            art = "an" if tname[:1].lower() in "aeiou" else "a"
            return (f"{owner} = {owner}.detach()  ({cexpr} is {art} {tname}{what}: release the graph of this "
                    f"element where it sits)"), gpos
        if ckind == "tuple":
            return (f"del {root.expr}  ({cexpr} is a tuple that also holds other objects: its elements cannot be "
                    f"replaced; keep .detach()ed tensors instead)" if root.expr else root.fix), 0
    return f"{owner} = {owner}.detach()  (or .item(): keep the value, not its autograd graph)", gpos


def _split_fix(fix: str) -> list[str]:
    """``a; b  (advice; more); c`` → the ``; ``-separated parts outside parentheses and quotes."""
    if "; " not in fix:
        return [fix] if fix else []
    parts: list[str] = []
    cur: list[str] = []
    depth, quote = 0, None
    i, n = 0, len(fix)
    while i < n:
        ch = fix[i]
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif ch == ";" and depth == 0 and fix.startswith("; ", i):
            parts.append("".join(cur))
            cur = []
            i += 2
            continue
        cur.append(ch)
        i += 1
    parts.append("".join(cur))
    return [p for p in parts if p]


def _merge_fixes(fixes: Iterable[str]) -> str:
    """One statement list that releases every holder, in an order that runs: ``a; b; c``."""
    out: list[str] = []
    for f in fixes:
        for part in _split_fix(f) if f else ():
            if part and part not in out:
                out.append(part)
    if len(out) > 1 and _NEXT_CELL in out:
        out.remove(_NEXT_CELL)  # another holder needs a real fix; this one goes away by itself
    # %reset -f out first: it leaves user_ns_hidden's _, __, ___ behind, which the next part clears
    if _HIDDEN_UNDERS in out and "%reset -f out" in out:
        out.remove("%reset -f out")
        out.insert(out.index(_HIDDEN_UNDERS), "%reset -f out")
    # imports first, the collection last (after every reference was dropped)
    for mod in ("gc", "sys"):
        if any(p.startswith(mod + ".") for p in out):
            if f"import {mod}" in out:
                out.remove(f"import {mod}")
            out.insert(0, f"import {mod}")
    coll = [p for p in out if p.startswith("gc.collect()")]
    for p in coll:
        out.remove(p)
    out.extend(coll[:1])
    return "; ".join(out)


def fix_code(fix: str) -> str:
    """The runnable cell for a ``fix`` text: one statement per line, advice in parentheses dropped."""
    lines = []
    for part in _split_fix(fix):
        code = part.split("  (", 1)[0].strip()
        if code and not code.startswith("("):
            lines.append(code)
    return "\n".join(lines)
