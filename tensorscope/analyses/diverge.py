"""Where two runs part ways: two ``ops`` tables aligned, their output fingerprints compared.

``diverge_tables(ops_a, ops_b, rtol=None) -> (pairs, structure, facts)``:

* **Alignment.** Views and bookkeeping rows (``is_view``, ``is_noise``) carry no values and are left
  out. Each remaining op is keyed by (module, source file and line, op, phase) and numbered by
  occurrence of its key; the (key, occurrence) pairs both runs have are matched, and the longest
  chain of matches in the same order in both runs is kept (patience diff: a longest increasing
  subsequence, O(n log n)). That runs three times: first with the output's hash in the key (equal
  values anchor: a loop's iterations pair by value, not by counting, so a removed op shifts
  nothing), then by the key alone between those anchors (occurrences counted from each gap's
  start), then by the looser key (module, op, phase), so a call that moved to another line pairs. Ops
  left over are *structure*: a cast one run inserted (autocast), or ops only one run ran there
  (a different kernel or decomposition, a compiled region's fused ops).
* **Comparison.** A pair compares the two fingerprints (``fp_*``): the same hash is identical; else
  the relative difference of the statistics, ``max(|sum_a - sum_b|, |abs_a - abs_b|) / max(abs_a,
  abs_b)`` and ``|max_a - max_b| / max(max_a, max_b)`` (a lower bound on the normwise relative error;
  a different NaN/Inf count is ``inf``). The pair *diverged* when that exceeds ``rtol`` (default: the
  tolerance of the finer of the two dtypes, ``RTOL``); it is *explained* when it stays within the
  coarser dtype's tolerance (bf16 against fp32: about 2^-8 per rounding).
* **Cause.** An op's inputs are traced to the ops that last wrote their storages (through casts
  only one run made). A diverged pair whose inputs all agree is *numeric* (the first one is where
  the runs part ways); one with an input made by ops only one run ran is *structural*; one with a
  diverged input, or a close one whose difference it amplified less than 10x, is *propagated*, and
  it *grew* when its error is 10x its inputs' or more.
"""
from __future__ import annotations

import math
import os
from bisect import bisect_left
from collections.abc import Hashable, Sequence
from typing import Any, Optional

import pyarrow as pa

from .. import schema as S
from .._common import COPY_INTO_OPS
from .casts import CAST_OPS

#: relative tolerance per dtype (torch.testing's defaults; float32: torch.allclose's)
RTOL = {"float64": 1e-7, "float32": 1e-5, "float16": 1e-3, "bfloat16": 1.6e-2}
#: unit roundoff per dtype (what one rounding costs, relative)
UNIT = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
#: a propagated error that is this many times its inputs' grew
GROWTH = 10.0
#: the fingerprint columns a trace needs
FP_COLUMNS = ("fp_hash", "fp_nonfinite", "fp_sum", "fp_abs_sum", "fp_max_abs")

_COLS = ("seq", "op", "module", "source_file", "source_line", "phase", "in_dtypes", "out_dtypes", "is_view",
         "is_noise", "inplace", "in_storages", "out_storages", "out_alias") + FP_COLUMNS

Fp = tuple[int, int, float, float, float]


def _pylist(col: Any) -> list[Any]:
    """A column as Python values, quickly: dictionary strings decoded once per chunk and list columns
    cut from their flat values by offsets (``to_pylist`` on list-of-dictionary columns is ~50x slower)."""
    out: list[Any] = []
    for arr in (col.chunks if isinstance(col, pa.ChunkedArray) else [col]):
        t = arr.type
        if pa.types.is_dictionary(t):
            out.extend(arr.dictionary_decode().to_pylist())
        elif pa.types.is_list(t):
            flat = _pylist(arr.flatten())
            offs = arr.offsets.to_numpy(zero_copy_only=False)
            offs = (offs - offs[0]).tolist()
            valid = arr.is_valid().to_pylist() if arr.null_count else None
            out.extend(flat[offs[i]:offs[i + 1]] if valid is None or valid[i] else None for i in range(len(arr)))
        else:
            out.extend(arr.to_pylist())
    return out


def _base(op: Optional[str]) -> str:
    parts = (op or "").split(".")
    return parts[1] if len(parts) > 1 else parts[0]


class Side:
    """One run's ops as Python lists, the rows that align, and who produced each row's inputs."""

    def __init__(self, ops: pa.Table) -> None:
        c = {name: _pylist(ops.column(name)) for name in _COLS}
        self.c = c
        n = ops.num_rows
        self.n = n
        view, noise = c["is_view"], c["is_noise"]
        #: positions (row numbers) of the ops that align
        self.rows = [i for i in range(n) if not view[i] and not noise[i]]
        mod, src, line, op, ph = c["module"], c["source_file"], c["source_line"], c["op"], c["phase"]
        self.full: list[Hashable] = []
        self.loose: list[Hashable] = []
        for i in self.rows:
            f = os.path.basename(src[i]) if src[i] else None
            self.full.append((mod[i], f, line[i], op[i], ph[i]))
            self.loose.append((mod[i], op[i], ph[i]))
        h, nf, s, a, m = (c[k] for k in FP_COLUMNS)
        self.fp: list[Optional[Fp]] = [None if h[i] is None else (h[i], nf[i], s[i], a[i], m[i]) for i in range(n)]
        #: the full key with the output's hash: equal values anchor the alignment first
        self.exact: list[Optional[Hashable]] = [None if h[r] is None else (k, h[r]) for k, r in zip(self.full, self.rows)]
        self.is_cast = [_is_cast(op[i], c["in_dtypes"][i], c["out_dtypes"][i]) for i in range(n)]
        # producers: the last row that wrote each input storage (fresh outputs and written ones)
        last: dict[int, int] = {}
        prod: list[tuple[int, ...]] = []
        ins, outs, alias, inplace = c["in_storages"], c["out_storages"], c["out_alias"], c["inplace"]
        for i in range(n):
            p = []
            for sid in ins[i] or ():
                if sid is not None and sid >= 0:
                    w = last.get(sid)
                    if w is not None and w not in p:
                        p.append(w)
            prod.append(tuple(p))
            if view[i] or noise[i]:
                continue
            al = alias[i] or ()
            for k, sid in enumerate(outs[i] or ()):
                if sid is not None and sid >= 0 and (inplace[i] or k >= len(al) or al[k] is None or al[k] < 0):
                    last[sid] = i
        self.prod = prod

    def out_dtype(self, i: int) -> Optional[str]:
        """The fingerprinted output's dtype: the first floating output."""
        for d in self.c["out_dtypes"][i] or ():
            if d in RTOL:
                return str(d)
        d0 = _dtype(self.c["out_dtypes"][i], 0)
        return d0


def _is_cast(op: Optional[str], ins: Optional[Sequence[Any]], outs: Optional[Sequence[Any]]) -> bool:
    """A conversion between dtypes (``_to_copy`` and friends, or ``copy_`` from another dtype)."""
    base = _base(op)
    if base in COPY_INTO_OPS:
        return _dtype(ins, 1) is not None and _dtype(ins, 1) != _dtype(ins, 0)
    return base in CAST_OPS and _dtype(ins, 0) != _dtype(outs, 0)


def _dtype(ds: Optional[Sequence[Any]], k: int) -> Optional[str]:
    return str(ds[k]) if ds and len(ds) > k and ds[k] is not None else None


def check(ops: pa.Table, label: str) -> None:
    """A clear error when ``ops`` cannot be compared: no fingerprint columns, or none recorded."""
    from ..errors import DivergeInputError

    missing = [c for c in FP_COLUMNS if c not in ops.column_names]
    if missing:
        raise DivergeInputError(f"trace {label} has no fingerprint columns ({', '.join(missing)}): it was saved "
                                f"by a tensorscope older than schema 1.5; record both runs again with "
                                f"trace(fingerprints=True)")
    if ops.num_rows and ops.column("fp_hash").null_count == ops.num_rows:
        raise DivergeInputError(f"trace {label} has no fingerprints (fp_hash is null on every op): record both "
                                f"runs with trace(fingerprints=True) (--fingerprints)")


# -- alignment -------------------------------------------------------------------------------------
def _lis(cands: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The longest chain of (i, j) candidates, given in increasing i, with increasing j."""
    tails: list[int] = []      # smallest j ending a chain of each length
    tail_at: list[int] = []    # candidate index of that tail
    back = [-1] * len(cands)
    for k, (_, j) in enumerate(cands):
        p = bisect_left(tails, j)
        if p == len(tails):
            tails.append(j)
            tail_at.append(k)
        else:
            tails[p] = j
            tail_at[p] = k
        back[k] = tail_at[p - 1] if p else -1
    out: list[tuple[int, int]] = []
    k = tail_at[-1] if tail_at else -1
    while k >= 0:
        out.append(cands[k])
        k = back[k]
    out.reverse()
    return out


def _match(ka: Sequence[Hashable], kb: Sequence[Hashable], ia: range, ib: range) -> list[tuple[int, int]]:
    """Matches of (key, occurrence) between positions ``ia`` of ``ka`` and ``ib`` of ``kb``, as the
    longest chain in the same order in both."""
    occ: dict[Hashable, int] = {}
    where: dict[tuple[Hashable, int], int] = {}
    for j in ib:
        k = kb[j]
        if k is None:
            continue
        o = occ.get(k, 0)
        occ[k] = o + 1
        where[(k, o)] = j
    occ.clear()
    cands: list[tuple[int, int]] = []
    for i in ia:
        k = ka[i]
        if k is None:
            continue
        o = occ.get(k, 0)
        occ[k] = o + 1
        jj = where.get((k, o))
        if jj is not None:
            cands.append((i, jj))
    return _lis(cands)


def _refine(ka: Sequence[Optional[Hashable]], kb: Sequence[Optional[Hashable]], anchors: list[tuple[int, int]],
            na: int, nb: int) -> list[tuple[int, int]]:
    """``anchors`` with the gaps between them matched by the keys ``ka``/``kb`` (occurrences counted
    from each gap's start)."""
    out: list[tuple[int, int]] = []
    pi, pj = -1, -1
    for i, j in anchors + [(na, nb)]:
        if i - pi > 1 and j - pj > 1:
            out.extend(_match(ka, kb, range(pi + 1, i), range(pj + 1, j)))
        if i < na:
            out.append((i, j))
        pi, pj = i, j
    return out


def align(a: Side, b: Side) -> list[tuple[int, int]]:
    """Aligned (position in a.rows, position in b.rows) pairs, in order: first the ops with the same
    key and the same output bits (a loop's iterations pair by their values, not by counting), then
    the same key in the gaps between them, then the looser key in what is left."""
    na, nb = len(a.rows), len(b.rows)
    pairs = _match(a.exact, b.exact, range(na), range(nb))
    pairs = _refine(a.full, b.full, pairs, na, nb)
    return _refine(a.loose, b.loose, pairs, na, nb)


# -- comparison ------------------------------------------------------------------------------------
def rel_err(fa: Fp, fb: Fp) -> float:
    """The relative difference of two fingerprints' statistics (0: identical bits)."""
    if fa[0] == fb[0]:
        return 0.0
    if fa[1] != fb[1]:
        return math.inf
    scale = max(fa[3], fb[3])
    e = (max(abs(fa[2] - fb[2]), abs(fa[3] - fb[3])) / scale) if scale > 0 else 0.0
    m = max(fa[4], fb[4])
    if m > 0:
        e = max(e, abs(fa[4] - fb[4]) / m)
    return e


def _tol(da: Optional[str], db: Optional[str]) -> tuple[float, float]:
    ta = RTOL.get(da or "", RTOL["float32"])
    tb = RTOL.get(db or "", RTOL["float32"])
    return min(ta, tb), max(ta, tb)


def diverge_tables(ops_a: pa.Table, ops_b: pa.Table, rtol: Optional[float] = None
                   ) -> tuple[pa.Table, pa.Table, dict[str, Any]]:
    """(pairs, structure, facts): see the module docstring. ``facts``: counts and the first divergence."""
    a, b = Side(ops_a), Side(ops_b)
    pos = align(a, b)
    pair_of_a: dict[int, int] = {}
    pair_of_b: dict[int, int] = {}
    for k, (i, j) in enumerate(pos):
        pair_of_a[a.rows[i]] = k
        pair_of_b[b.rows[j]] = k
    n = len(pos)
    errs: list[Optional[float]] = [None] * n
    diverged = [False] * n
    cols: dict[str, list[Any]] = {name: [] for name in S.DIVERGE_PAIRS.names}
    ca = a.c

    def inputs(side: Side, pair_of: dict[int, int], row: int) -> tuple[list[int], bool, bool]:
        """(pairs that produced the row's inputs, an input came through an unpaired cast, an input
        came from an unpaired op that is not a cast)"""
        pairs: list[int] = []
        cast = struct = False
        stack = [(p, 0) for p in side.prod[row]]
        while stack:
            p, depth = stack.pop()
            k = pair_of.get(p)
            if k is not None:
                pairs.append(k)
            elif side.is_cast[p] and depth < 8:
                cast = True
                stack.extend((q, depth + 1) for q in side.prod[p])
            elif side.fp[p] is not None or side.c["out_dtypes"][p]:
                struct = True
        return pairs, cast, struct

    for k, (i, j) in enumerate(pos):
        ra, rb = a.rows[i], b.rows[j]
        da, db = a.out_dtype(ra), b.out_dtype(rb)
        thr, expected = _tol(da, db)
        if rtol is not None:
            thr = float(rtol)
        fa, fb = a.fp[ra], b.fp[rb]
        pa_, cast_a, struct_a = inputs(a, pair_of_a, ra)
        pb_, cast_b, struct_b = inputs(b, pair_of_b, rb)
        in_pairs = set(pa_) | set(pb_)
        in_err = max((errs[p] or 0.0 for p in in_pairs), default=0.0)
        in_div = any(diverged[p] for p in in_pairs)
        err: Optional[float] = None
        cause: Optional[str] = None
        growth: Optional[float] = None
        if fa is None or fb is None:
            status = "unknown"
        else:
            err = rel_err(fa, fb)
            errs[k] = err
            if fa[0] == fb[0]:
                status = "identical"
            elif err <= thr:
                status = "close"
            else:
                status = "diverged"
                diverged[k] = True
                if in_div or (in_err > 0 and err < GROWTH * in_err):
                    # an input already differed (a diverged one, or a close one this op amplified
                    # less than GROWTH times): the difference arrived here, it was not made here
                    cause = "propagated"
                    growth = (err / in_err) if in_err > 0 else math.inf
                elif struct_a or struct_b:
                    cause = "structural"
                else:
                    cause = "numeric"
        cols["seq_a"].append(ca["seq"][ra])
        cols["seq_b"].append(b.c["seq"][rb])
        cols["op"].append(ca["op"][ra])
        cols["module"].append(ca["module"][ra])
        cols["source_file"].append(ca["source_file"][ra])
        cols["source_line"].append(ca["source_line"][ra])
        cols["phase"].append(ca["phase"][ra])
        cols["dtype_a"].append(da)
        cols["dtype_b"].append(db)
        cols["status"].append(status)
        cols["cause"].append(cause)
        cols["rel_err"].append(err)
        cols["threshold"].append(thr)
        cols["expected"].append(expected)
        cols["explained"].append(None if status != "diverged" else bool(err is not None and err <= expected))
        cols["input_err"].append(in_err if in_pairs else None)
        cols["growth"].append(growth)
        cols["after_cast"].append(cast_a or cast_b)
    pairs = pa.Table.from_pydict(cols, schema=S.DIVERGE_PAIRS)
    structure = _structure(a, b, pos)
    first = next((k for k in range(n) if cols["cause"][k] in ("numeric", "structural")), None)
    grew = [k for k in range(n) if cols["cause"][k] == "propagated" and (cols["growth"][k] or 0) >= GROWTH]
    facts: dict[str, Any] = {
        "ops_a": len(a.rows), "ops_b": len(b.rows), "aligned": n,
        "identical": cols["status"].count("identical"), "close": cols["status"].count("close"),
        "diverged": cols["status"].count("diverged"), "unknown": cols["status"].count("unknown"),
        "numeric": cols["cause"].count("numeric"), "structural": cols["cause"].count("structural"),
        "propagated": cols["cause"].count("propagated"),
        "first": first, "grew": grew, "rtol": rtol,
    }
    return pairs, structure, facts


def _structure(a: Side, b: Side, pos: list[tuple[int, int]]) -> pa.Table:
    """The ops only one run made, each with its kind (cast / replaced / extra)."""
    cols: dict[str, list[Any]] = {name: [] for name in S.DIVERGE_STRUCTURE.names}
    pi, pj = -1, -1
    for i, j in pos + [(len(a.rows), len(b.rows))]:
        gap_a, gap_b = range(pi + 1, i), range(pj + 1, j)
        for side, name, gap, other, oside in ((a, "a", gap_a, gap_b, b), (b, "b", gap_b, gap_a, a)):
            replaced = any(not oside.is_cast[oside.rows[q]] for q in other)
            for p in gap:
                r = side.rows[p]
                c = side.c
                cols["side"].append(name)
                cols["seq"].append(c["seq"][r])
                cols["op"].append(c["op"][r])
                cols["module"].append(c["module"][r])
                cols["source_file"].append(c["source_file"][r])
                cols["source_line"].append(c["source_line"][r])
                cols["phase"].append(c["phase"][r])
                cols["in_dtype"].append(_dtype(c["in_dtypes"][r], 0))
                cols["out_dtype"].append(_dtype(c["out_dtypes"][r], 0))
                cols["kind"].append("cast" if side.is_cast[r] else ("replaced" if replaced else "extra"))
        pi, pj = i, j
    return pa.Table.from_pydict(cols, schema=S.DIVERGE_STRUCTURE)
