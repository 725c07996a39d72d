"""Leak rows in bulk: many plain tensors of one container, named without a path each.

``_by_parent`` groups the storages the search reached by the container that holds them: tensors
side by side in one list or dict (``tensors[3]``), or in many small tuples, lists or dicts of one
container (``pairs[7][0]``, ``records[2]['x']``). For each group ``_bulk_rows`` / ``_bulk_nested``
describe the container once and build every column in C-level passes (``_emit_plain``); a group
whose path needs the general rules is left to ``holders`` (nothing added).
"""
from __future__ import annotations

from itertools import chain, compress, groupby, repeat
from operator import attrgetter, itemgetter
from typing import Any, Optional

from ..._common import fmt_bytes
from .classify import _DEV_STR, _DTYPE_STR, _T, _TENSOR, _types
from .holders import _make_row
from .known import _KNOWN
from .labels import _short_repr
from .paths import _Describer
from .rowset import _RowSet
from .search import _Search

#: a container with at least this many tensors (or small containers of tensors) gets bulk rows
_BULK_MIN = 16


def _by_parent(search: _Search):
    """``(generic, direct, nested)``: the storages that need a path of their own; ``[(parent node,
    storages)]`` for tensors side by side in one container (a list of 100k tensors); and
    ``[(grandparent node, parent nodes, storages, index of each storage's parent)]`` for tensors in
    many small tuples, lists or dicts of one container (a dataset of (x, y) pairs). Only a storage
    held by one tensor, whose node no other root reaches, is grouped. In C-level passes over
    ``found``; groups in order of first appearance, storages in discovery order."""
    import numpy as np

    found, par, cross, order = search.found, search.par, search.cross, search.order
    keys = list(found)
    if not keys:
        return [], [], []
    nodes = list(found.values())
    firsts = list(map(itemgetter(0), nodes))
    pars = np.fromiter(map(par.__getitem__, firsts), dtype=np.int64, count=len(keys))
    ok = (np.fromiter(map(len, nodes), dtype=np.int64, count=len(keys)) == 1) & (pars >= 0)
    if cross:
        ok &= ~np.fromiter(map(cross.__contains__, firsts), dtype=bool, count=len(keys))
    del nodes, firsts
    generic = list(compress(keys, (~ok).tolist()))
    pos = np.flatnonzero(ok)
    if not len(pos):
        return generic, [], []
    get = keys.__getitem__
    uniq, inv, counts = np.unique(pars[pos], return_inverse=True, return_counts=True)
    many = counts[inv] >= _BULK_MIN
    direct = []
    if many.any():
        dpos = pos[many]
        dpos = dpos[np.argsort(pars[dpos], kind="stable")]
        sp = pars[dpos]
        starts = np.flatnonzero(np.concatenate(([True], sp[1:] != sp[:-1])))
        ends = np.append(starts[1:], len(dpos))
        for _first, p, a, b in sorted(zip(dpos[starts].tolist(), sp[starts].tolist(), starts.tolist(),
                                          ends.tolist())):
            direct.append((p, list(map(get, dpos[a:b].tolist()))))
    few = pos[~many]
    if not len(few):
        return generic, direct, []
    # small containers: by grandparent, when the container is a plain tuple/list/dict no other root reaches
    fp = pars[few]
    cand = np.unique(fp).tolist()
    nestable = np.fromiter(map(_NESTABLE.__contains__, map(type, map(order.__getitem__, cand))), dtype=bool,
                           count=len(cand))
    if cross:
        nestable &= ~np.fromiter(map(cross.__contains__, cand), dtype=bool, count=len(cand))
    gps = np.fromiter(map(par.__getitem__, cand), dtype=np.int64, count=len(cand))
    nestable &= gps >= 0
    cand_np = np.array(cand, dtype=np.int64)
    at = np.searchsorted(cand_np, fp)
    kn = nestable[at]
    generic.extend(map(get, few[~kn].tolist()))
    few, fp, kgp = few[kn], fp[kn], gps[at[kn]]
    nested = []
    if len(few):
        o = np.lexsort((few, fp, kgp))
        few, fp, kgp = few[o], fp[o], kgp[o]
        starts = np.flatnonzero(np.concatenate(([True], kgp[1:] != kgp[:-1])))
        ends = np.append(starts[1:], len(few))
        for a, b in zip(starts.tolist(), ends.tolist()):
            ps_, kowner = np.unique(fp[a:b], return_inverse=True)
            ks = list(map(get, few[a:b].tolist()))
            if len(ps_) < _BULK_MIN:
                generic.extend(ks)
                continue
            nested.append((int(kgp[a]), ps_.tolist(), ks, kowner.tolist()))
    return generic, direct, nested


def _plain_top(desc: _Describer, p: int):
    """The path state of ``p`` when it is a plain container under a global name (``tensors``,
    ``data['train']``): what it holds is named by index and key steps alone. None otherwise."""
    ps = desc.state(p)
    root = ps.root
    if root.group != "global" or ps.flags or ps.marks or ps.moddict is not None or ps.inst or ps.run:
        return None
    return ps


def _child_steps(search: _Search, desc: _Describer, p: int, objs: list[Any]) -> Optional[list[str]]:
    """The path step (``[3]``, ``['x']``) from node ``p`` to each of ``objs`` (children of ``p``); None
    when an edge is not a plain index or key."""
    o = search.order[p]
    if type(o) is list:
        # the edge labels of a list are its indices (the first, for an item listed twice)
        ids = list(map(id, o))
        where = dict(zip(reversed(ids), range(len(ids) - 1, -1, -1)))
        del ids, o
        at = list(map(where.get, map(id, objs)))
        if None in at:
            return None
        return [f"[{n}]" for n in at]
    del o
    m = desc.lab.cache.get(p)
    if m is None:
        if search.idx[id(objs[0])] in search.synth:
            return None   # a C++ edge's child: its label is not the container's
        m = desc.lab.labels(p)
    labs: list[Any] = list(map(m.get, map(id, objs)))
    if None in labs or not {lab[0] for lab in labs} <= {"index", "key"}:
        return None
    return [f"[{lab[1]}]" for lab in labs]


def _tensors_of(search: _Search, keys: list[int]) -> Optional[list[Any]]:
    """The tensor holding each storage (its first node); None unless all are tensors."""
    order, found = search.order, search.found
    ts = list(map(order.__getitem__, map(itemgetter(0), map(found.__getitem__, keys))))
    if any(_types.get(tp) != _TENSOR for tp in set(map(type, ts))):
        return None
    return ts


def _bulk_rows(search: _Search, desc: _Describer, p: int, keys: list[int], key_meta, rows: _RowSet) -> bool:
    """Many plain tensors directly in one global container (a list of 100k tensors): one description
    of the container, then each column in one C-level pass. False (nothing added) when the path
    needs the general rules."""
    ps = _plain_top(desc, p)
    if ps is None:
        return False
    ts = _tensors_of(search, keys)
    if ts is None:
        return False
    steps = _child_steps(search, desc, p, ts)
    if steps is None:
        return False
    return _emit_plain(search, ps, keys, ts, steps, key_meta, rows)


#: small containers whose items a nested bulk row names by position: ``pairs[3][0]``
_SMALL_SEQ = (tuple, list)
#: small containers a nested bulk row looks through
_NESTABLE = frozenset((tuple, list, dict))


def _bulk_nested(search: _Search, desc: _Describer, gp: int, parents: list[int], keys: list[int],
                 kowner: list[int], key_meta, rows: _RowSet) -> bool:
    """Tensors in many small plain containers (``parents``) of one global container (a dataset as a
    list of ``(x, y)`` tuples, a list of ``{'x': x, 'y': y}`` dicts): ``data[3][0]``, without a path
    per tensor. ``kowner[k]`` indexes the parent of ``keys[k]``. False (nothing added) when some
    path needs the general rules."""
    ps = _plain_top(desc, gp)
    if ps is None:
        return False
    order = search.order
    pobjs = list(map(order.__getitem__, parents))
    psteps = _child_steps(search, desc, gp, pobjs)
    if psteps is None:
        return False
    ts = _tensors_of(search, keys)
    if ts is None:
        return False
    if all(type(o) in _SMALL_SEQ for o in pobjs):
        # all tuples and lists: each item's position from one flat (container, item) -> index map
        lens = list(map(len, pobjs))
        item_ids = list(map(id, chain.from_iterable(pobjs)))
        pos = list(chain.from_iterable(map(range, lens)))
        where: dict[Any, int] = dict(zip(reversed(item_ids), reversed(pos)))   # first occurrence
        if len(where) == len(item_ids):   # every item in one place (the usual dataset): by id alone
            del pobjs, item_ids, pos
            at: list[Any] = list(map(where.get, map(id, ts)))
        else:   # an item in several containers: by (container, item)
            owners = list(chain.from_iterable(map(repeat, range(len(pobjs)), lens)))
            where = dict(zip(zip(reversed(owners), reversed(item_ids)), reversed(pos)))
            del pobjs, owners, item_ids, pos
            at = list(map(where.get, zip(kowner, map(id, ts))))
        del where
        if None in at:
            return False
        steps = [f"{psteps[o]}[{n}]" for o, n in zip(kowner, at)]
        del at
        return _emit_plain(search, ps, keys, ts, steps, key_meta, rows)
    if all(type(o) is dict for o in pobjs):
        # all dicts with string keys (records): the same, the step being the key's text
        dkeys = list(chain.from_iterable(map(dict.keys, pobjs)))
        if set(map(type, dkeys)) <= {str}:
            lens = list(map(len, pobjs))
            owners = list(chain.from_iterable(map(repeat, range(len(pobjs)), lens)))
            val_ids = list(map(id, chain.from_iterable(map(dict.values, pobjs))))
            where2: dict[Any, int] = dict(zip(zip(reversed(owners), reversed(val_ids)), range(len(val_ids) - 1, -1, -1)))
            texts = [f"[{t}]" for t in map(_short_repr, dkeys)]
            del pobjs, owners, val_ids, dkeys
            at2: list[Any] = list(map(where2.get, zip(kowner, map(id, ts))))
            del where2
            if None in at2:
                return False
            steps = [psteps[o] + texts[n] for o, n in zip(kowner, at2)]
            del at2, texts
            return _emit_plain(search, ps, keys, ts, steps, key_meta, rows)
    del pobjs
    steps = []
    k = 0
    for o, grp in groupby(kowner):   # keys come grouped by parent
        n = len(list(grp))
        mine = ts[k:k + n]
        cs = _child_steps(search, desc, parents[o], mine)
        if cs is None:
            return False
        steps.extend([psteps[o] + c for c in cs])
        k += n
    return _emit_plain(search, ps, keys, ts, steps, key_meta, rows)


def _emit_plain(search: _Search, ps, keys: list[int], ts: list[Any], steps: list[str], key_meta,
                rows: _RowSet) -> bool:
    """Rows for tensors named ``ps`` + a step each, all of kind ``global``: columns in C-level passes."""
    root = ps.root
    storage = _T().UntypedStorage
    try:
        ss = list(map(search.storages.__getitem__, keys))
        vbs = list(map(attrgetter("nbytes"), ts))
        sbs = list(map(storage.nbytes, ss))
        ptrs = list(map(storage.data_ptr, ss))
        dts = list(map(attrgetter("dtype"), ts))
        dvs = list(map(attrgetter("device"), ts))
        shapes = list(map(attrgetter("shape"), ts))   # torch.Size: a tuple, as Arrow takes it
    except Exception:
        return False
    base_text, base_expr = ps.text, ps.expr
    rlabel, rfix = root.label, root.fix
    holders = list(map(base_text.__add__, steps))
    if base_expr is None:
        fixes = [rfix] * len(steps)
    else:
        fixes = list(map(("del " + base_expr).__add__, steps))
        import numpy as np

        for n in np.flatnonzero(np.array(vbs, dtype=np.int64) * 2 < np.array(sbs, dtype=np.int64)).tolist():
            expr = base_expr + steps[n]
            fixes[n] = (f"{expr} = {expr}.clone()  (a {fmt_bytes(vbs[n])} view pins the whole "
                        f"{fmt_bytes(sbs[n])} storage; or del {expr})")
    del steps, vbs
    dtype_str, dev_str = _DTYPE_STR, _DEV_STR
    for dt in set(dts):
        if dt not in dtype_str:
            dtype_str[dt] = str(dt).replace("torch.", "")
    for dv in set(dvs):
        if dv not in dev_str:
            dev_str[dv] = str(dv)
    dts = list(map(dtype_str.__getitem__, dts))
    dvs = list(map(dev_str.__getitem__, dvs))
    # storages a trace or discovery recorded carry their creation site: the general row for those
    recorded = sorted({n for d in (key_meta, _KNOWN) if d
                       for n in compress(range(len(keys)), map(d.__contains__, keys))})
    if recorded:
        for n in recorded:
            rows.add(_make_row(search, keys[n], ss[n], key_meta.get(keys[n]), holders[n], "global", fixes[n],
                               rlabel, rfix))
        plain = [True] * len(keys)
        for n in recorded:
            plain[n] = False
        holders, fixes, sbs, ptrs, dvs, dts, shapes = (list(compress(c, plain))
                                                       for c in (holders, fixes, sbs, ptrs, dvs, dts, shapes))
    del ss, ts
    rows.add_plain(holders, fixes, sbs, ptrs, dvs, dts, shapes, "global", rlabel, rfix)
    return True
