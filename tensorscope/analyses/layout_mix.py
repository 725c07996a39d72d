"""The advisor's slow-mix finding: an op (not a convolution, not a copy) whose 4-d/5-d inputs mix
channels_last and contiguous runs TensorIterator's strided path, many times slower per byte than the
same op with one format (threshold_backward: 25-37x on CPU). The finding needs the proof in the rows:
calls of the same op and dtype with one format in the same trace, against which the mixed calls'
time per byte is measured; its cost is the mixed calls' time past that rate. The contiguous input's
producer names the fix: global average pooling (``AdaptiveAvgPool2d``, ``mean`` over H and W) hands a
contiguous gradient back to channels_last activations, and ``avg_pool2d`` over the whole map does not.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from .findings import Runs, _finding, _where
from .lineage import producer
from .opview import OpView, short_name, window_views

MIX_SLOWDOWN = 2.0   # mixed calls this many times slower per byte than the op's one-format calls make a finding
_CL = ("channels_last", "channels_last_3d")
#: autograd nodes of global average pooling: their gradient comes back contiguous
_POOL_NODES = ("MeanBackward", "AdaptiveAvgPool2DBackward", "AdaptiveAvgPool3DBackward")


def _strings(arr: Any) -> np.ndarray:
    """A (possibly dictionary-encoded) string array as an object array (None for nulls)."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=object)


def _formats(ops: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Per row: (mixed, one format): whether its non-ambiguous 4-d/5-d inputs are channels_last and
    contiguous together, or all of one of those formats."""
    n = ops.num_rows
    none = np.zeros(n, bool)
    if n == 0 or not _may_hold_cl(ops.column("in_formats")):
        return none, none   # no channels_last input at all (most traces): nothing mixes
    fm = ops.column("in_formats").combine_chunks()
    sh = ops.column("in_shapes").combine_chunks()
    amb = ops.column("in_ambiguous").combine_chunks()
    if n == 0 or fm.null_count == n:
        return none, none
    lens = pc.fill_null(pc.list_value_length(fm), 0)
    if not (pc.all(pc.equal(lens, pc.fill_null(pc.list_value_length(sh), 0))).as_py()
            and pc.all(pc.equal(lens, pc.fill_null(pc.list_value_length(amb), 0))).as_py()):
        return none, none   # not one entry per input: nothing to read
    parent = pc.list_parent_indices(fm).to_numpy()
    f = _strings(pc.list_flatten(fm))
    nd = pc.fill_null(pc.list_value_length(pc.list_flatten(sh)), 0).to_numpy()
    a = pc.fill_null(pc.list_flatten(amb), True).to_numpy(zero_copy_only=False).astype(bool)
    big = ((nd == 4) | (nd == 5)) & ~a
    cl = np.zeros(n, bool)
    ct = np.zeros(n, bool)
    cl[parent[big & np.isin(f, _CL)]] = True
    ct[parent[big & (f == "contiguous")]] = True
    return cl & ct, cl ^ ct


def _may_hold_cl(col: Any) -> bool:
    """Whether a list-of-formats column may hold a channels_last entry: read from each chunk's dictionary
    (a few strings) where it is dictionary-encoded, without touching the rows."""
    for chunk in col.chunks:
        child = chunk.values
        if not pa.types.is_dictionary(child.type):
            return True
        if any(v in _CL for v in child.dictionary.to_pylist()):
            return True
    return False


class _Group:
    __slots__ = ("n_mixed", "b_mixed", "t_mixed", "n_one", "b_one", "t_one", "runs", "first", "r_mixed", "r_one")

    def __init__(self) -> None:
        self.n_mixed = self.b_mixed = self.t_mixed = self.n_one = self.b_one = self.t_one = 0
        self.r_mixed: list[np.ndarray] = []   # bytes per ns of each call: the medians compare (one preempted
        self.r_one: list[np.ndarray] = []     # call on a busy machine does not decide)
        self.runs = Runs()
        self.first: Optional[tuple[int, int]] = None   # (window, row in the window's ops) of the first mixed call


def _read(w: int, view: OpView, skip: frozenset[str], groups: dict[tuple[str, str], _Group],
          only: Optional[set[str]]) -> None:
    """Fold one slice of warm rows into ``groups``: the first pass (``only`` None) notes which ops mix
    formats at all; the second sums, per (op, dtype) of those ops, the mixed and the one-format calls."""
    ops = view.ops
    if view.n == 0:
        return
    work = view.mask(lambda name: short_name(name) not in skip and (only is None or name in only))
    if not work.any():
        return
    mixed, one = _formats(ops)
    mixed &= work
    one &= work
    if only is None:
        for c in np.unique(view.codes[mixed]).tolist():
            groups.setdefault((view.names[c], ""), _Group())
        return
    nb = (pc.fill_null(ops.column("bytes_read"), 0).to_numpy(zero_copy_only=False)
          + pc.fill_null(ops.column("bytes_written"), 0).to_numpy(zero_copy_only=False))
    ns = pc.fill_null(ops.column("cpu_ns"), 0).to_numpy(zero_copy_only=False)
    take = (mixed | one) & (nb > 0) & (ns > 0)
    if not take.any():
        return
    dt = _first_dtype(ops)
    for c in np.unique(view.codes[take]).tolist():
        of_op = take & (view.codes == c)
        for d in set(dt[of_op].tolist()):
            m = of_op & (dt == d)
            g = groups.setdefault((view.names[c], str(d)), _Group())
            mm, mo = m & mixed, m & one
            g.n_mixed += int(mm.sum())
            g.b_mixed += int(nb[mm].sum())
            g.t_mixed += int(ns[mm].sum())
            g.n_one += int(mo.sum())
            g.b_one += int(nb[mo].sum())
            g.t_one += int(ns[mo].sum())
            g.r_mixed.append(nb[mm] / ns[mm])
            g.r_one.append(nb[mo] / ns[mo])
            if mm.any():
                g.runs.add(w, view.seq[mm])
                g.first = g.first or (w, view.offset + int(np.flatnonzero(mm)[0]))


def _first_dtype(ops: pa.Table) -> np.ndarray:
    """Per row, the dtype of its first tensor input (None where it has none)."""
    col = ops.column("in_dtypes").combine_chunks()
    out = np.full(len(col), None, dtype=object)
    if len(col) == 0:
        return out
    has = pc.fill_null(pc.greater(pc.list_value_length(col), 0), False).to_numpy(zero_copy_only=False)
    offsets = col.offsets.to_numpy()[:-1]
    flat = _strings(col.values)
    idx = np.flatnonzero(has)
    out[idx] = flat[offsets[idx]]
    return out


def mix_findings(wins: Sequence[Mapping[str, Any]], multi: bool, steps: Optional[int],
                 skip: frozenset[str]) -> list[dict[str, Any]]:
    """One ``layout`` finding per (op, dtype) whose mixed-format calls are ``MIX_SLOWDOWN`` times slower per
    byte than its one-format calls in the same windows (warm rows; ``skip``: ops other findings read)."""
    groups: dict[tuple[str, str], _Group] = {}
    for w, win in enumerate(wins):
        for view in window_views(win, warm_only=True):
            _read(w, view, skip, groups, None)
    if not groups:
        return []
    names = {k[0] for k in groups}
    groups = {}
    for w, win in enumerate(wins):
        for view in window_views(win, warm_only=True):
            _read(w, view, skip, groups, names)
    out = []
    for (op, dtype), g in groups.items():
        if not (g.n_mixed and g.n_one and g.b_mixed) or g.first is None:
            continue
        rate_one = float(np.median(np.concatenate(g.r_one)))
        slow = rate_one / float(np.median(np.concatenate(g.r_mixed)))
        expected = g.b_mixed / rate_one   # the mixed calls' bytes at the one-format calls' median rate
        if slow < MIX_SLOWDOWN or g.t_mixed <= expected:
            continue
        w, row = g.first
        ops = wins[w]["ops"]
        r = S.plain_strings(ops.slice(row, 1).select(
            ["in_formats", "in_storages", "module", "source_file", "source_line", "autograd_node"])).to_pylist()[0]
        fmts, sids = r["in_formats"] or [], r["in_storages"] or []
        ct = [s for f, s in zip(fmts, sids) if f == "contiguous" and s is not None]
        made = producer(ops, row, ct[0]) if ct else None
        seen = (f"{g.n_mixed} of {short_name(op)}'s calls ({dtype}) got channels_last and contiguous inputs together: "
                f"{rate_one / slow:.2f} GB/s against {rate_one:.2f} GB/s for its {g.n_one} calls with one format "
                f"(medians), {slow:.0f}x slower per byte (the strided path)")
        if made is not None:
            node = f" ({made['autograd_node']})" if made.get("autograd_node") else ""
            seen += (f"; the contiguous input is made by {short_name(made['op'])}{node} at "
                     f"{_where(made['source_file'], made['source_line'])}")
        if made is not None and str(made.get("autograd_node") or "").startswith(_POOL_NODES):
            fix = ("global average pooling hands back a contiguous gradient: pool with "
                   "torch.nn.functional.avg_pool2d(x, x.shape[-2:]) (nn.AvgPool2d over the whole map), whose "
                   "gradient keeps channels_last")
        elif made is not None and not made.get("autograd_node"):
            fix = (f"convert the contiguous input once where it is made ({short_name(made['op'])} at "
                   f"{_where(made['source_file'], made['source_line'])}): .contiguous(memory_format=torch.channels_last)")
        else:
            fix = "give both inputs one memory format (channels_last end to end, or contiguous)"
        out.append(_finding("layout", f"{short_name(op)} mixing memory formats", seen, g.runs, multi,
                            int(g.t_mixed - expected), fix, steps, r["module"], r["source_file"], r["source_line"]))
    return out
