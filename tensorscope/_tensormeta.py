"""Tensor metadata helpers: memory-format labels and the dense check, in plain integers.

Computed once per distinct ``(shape, stride)`` (the recorder interns metas), never per
op, with integer loops instead of ``torch._prims_common`` (why: docs/development/architecture.md,
"Measured decisions").

Labels: ``empty`` (numel 0), ``scalar`` (dim 0), ``contiguous``, ``channels_last``
(4-d NHWC), ``channels_last_3d`` (5-d NDHWC), ``strided`` (dense, another
permutation), and for tensors that are not dense: ``expanded`` (a zero stride on a
dim of size > 1), ``overlapping`` (two indexes reach one element), ``gapped``
(distinct elements, holes between them). ``non_dense`` remains only for the rare
layout too large to settle exactly (and in traces written before schema 1.2).
``ambiguous`` is true when size-1 dims make a tensor both contiguous and
channels_last; the label then follows torch's own tie-break
(``is_channels_last_strides_2d``).
"""
from __future__ import annotations

from collections.abc import Sequence
from math import gcd


def _is_contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    expected = 1
    for d in range(len(shape) - 1, -1, -1):
        s = shape[d]
        if s != 1:
            if stride[d] != expected:
                return False
            expected *= s
    return True


def _is_contiguous_perm(shape, stride, order) -> bool:
    """Contiguous when dims are laid out innermost-first in ``order``."""
    expected = 1
    for d in order:
        s = shape[d]
        if s != 1:
            if stride[d] != expected:
                return False
            expected *= s
    return True


def _channels_last_strides(shape, stride, order) -> bool:
    # A transcription of c10's is_channels_last_strides_2d_s4 / 3d_s5: how torch
    # itself breaks the tie when size-1 dims make both formats hold.
    mn = 0
    if stride[1] == 0:
        return False
    for d in order:
        if shape[d] == 0:
            return False
        if stride[d] < mn:
            return False
        if d == 0 and mn == stride[1]:
            return False
        mn = stride[d]
        if shape[d] > 1:
            mn *= shape[d]
    return True




#: the exact overlap check walks a bitset of this many offsets at most (64 KiB)
EXACT_EXTENT_BITS = 1 << 19


def non_dense_kind(shape: Sequence[int], stride: Sequence[int]) -> str:
    """``dense``, ``expanded``, ``gapped`` or ``overlapping`` from sizes and strides; ``non_dense``
    when the layout is not dense and too large to decide overlap exactly.

    Overlap means two index tuples reach one offset. Sorted by stride, a dim whose stride
    exceeds the largest offset the smaller dims reach can never collide with them (the usual
    test, exact when it passes; it used ``stride * size`` as that reach, which called
    shape (2, 2) strides (3, 2), offsets {0, 2, 3, 5}, overlapping). When it fails the answer
    may still be "no": shape (3, 2) strides (2, 3) reaches {0, 2, 3, 4, 5, 7}. Two dims have a
    closed form; more elements than offsets in reach settles "yes"; otherwise the set of reached offsets is built as a
    bitset, dim by dim: no collision exactly when its size is the product of the sizes.
    """
    dims = sorted((abs(st), sz) for st, sz in zip(stride, shape) if sz != 1)
    if any(sz == 0 for _, sz in dims):
        return "dense"   # empty: nothing is touched
    if any(st == 0 for st, _ in dims):
        return "expanded"
    expected = 1
    dense = True
    for st, sz in dims:
        if st != expected:
            dense = False
            break
        expected *= sz
    if dense:
        return "dense"
    reach = 0
    for st, sz in dims:
        if st <= reach:
            break
        reach += (sz - 1) * st
    else:
        return "gapped"
    if len(dims) == 2:
        # i*a == j*b has its smallest solution at i = b/g, j = a/g: a collision exactly when both fit
        (a, na), (b, nb) = dims
        g = gcd(a, b)
        return "overlapping" if b // g < na and a // g < nb else "gapped"
    g = 0
    for st, _ in dims:
        g = gcd(g, st)
    dims = [(st // g, sz) for st, sz in dims]
    n = 1
    extent = 1
    for st, sz in dims:   # a collision among the smaller-stride dims is a collision
        n *= sz
        extent += (sz - 1) * st
        if n > extent:
            return "overlapping"   # more elements than offsets they can reach
    if extent > EXACT_EXTENT_BITS:
        return "non_dense"
    reached = 1   # bit k set: offset k is reached
    count = 1
    for st, sz in dims:
        acc = reached   # union of ``reached`` shifted by 0 .. m-1 strides
        m = 1
        while 2 * m <= sz:
            acc |= acc << (m * st)
            m *= 2
        if m < sz:   # shifts sz-m .. sz-1 complete 0 .. sz-1 (the ranges overlap: a union is a union)
            acc |= acc << ((sz - m) * st)
        count *= sz
        if _popcount(acc) != count:
            return "overlapping"
        reached = acc
    return "gapped"


def _popcount(x: int) -> int:
    bc = getattr(x, "bit_count", None)   # Python >= 3.10
    return bc() if bc is not None else bin(x).count("1")


_CL2 = (1, 3, 2, 0)
_CL3 = (1, 4, 3, 2, 0)


def memory_format(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[str, bool]:
    """``(label, ambiguous)`` for a strided tensor's shape and stride."""
    nd = len(shape)
    if nd == 0:
        return "scalar", False
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return "empty", False
    contig = _is_contiguous(shape, stride)
    if nd == 4 or nd == 5:
        order = _CL2 if nd == 4 else _CL3
        cl = _is_contiguous_perm(shape, stride, order)
        name = "channels_last" if nd == 4 else "channels_last_3d"
        if cl and contig:
            return (name if _channels_last_strides(shape, stride, order) else "contiguous"), True
        if cl:
            return name, False
    if contig:
        return "contiguous", False
    kind = non_dense_kind(shape, stride)
    return ("strided" if kind == "dense" else kind), False


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

