"""Tensor metadata helpers: memory-format labels and the dense check, in plain integers.

Computed once per distinct ``(shape, stride)`` (the recorder interns metas), never per
op: ``torch._prims_common.is_non_overlapping_and_dense`` costs 20-30 µs, these
integer loops ~1-2 µs, and the cache makes repeats free.

Labels: ``empty`` (numel 0), ``scalar`` (dim 0), ``contiguous``, ``channels_last``
(4-d NHWC), ``channels_last_3d`` (5-d NDHWC), ``strided`` (dense, another
permutation), ``non_dense`` (expanded, gapped or overlapping). ``ambiguous`` is
true when size-1 dims make a tensor both contiguous and channels_last; the label
then follows torch's own tie-break (``is_channels_last_strides_2d``).
"""
from __future__ import annotations

from typing import Sequence, Tuple


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


def is_dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Non-overlapping and dense: some permutation of the dims is contiguous."""
    dims = sorted((stride[d], shape[d]) for d in range(len(shape)) if shape[d] != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


_CL2 = (1, 3, 2, 0)
_CL3 = (1, 4, 3, 2, 0)


def memory_format(shape: Tuple[int, ...], stride: Tuple[int, ...]) -> Tuple[str, bool]:
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
    return ("strided" if is_dense(shape, stride) else "non_dense"), False


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def extent_elems(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements of storage a strided view spans (1 + sum((size-1)*stride))."""
    if numel(shape) == 0:
        return 0
    return 1 + sum((sz - 1) * abs(st) for sz, st in zip(shape, stride))
