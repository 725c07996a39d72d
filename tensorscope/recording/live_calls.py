"""The native function mode's calls store (``rec.calls`` while ``native/fmode.cpp`` records).

C keeps the calls rows in blocks of 16,384 calls, packed column by column once full; each spill of
the recorder takes the blocks packed since the last one (``fm.take_packed``: C frees them) and
writes them out with the op chunks, in the python engine's ``CallStore`` format; the end of the
trace hands the rest over (``fm.take``). Readers see one store: ``field``, ``column``,
``column_range`` read the handed-over calls from their chunks and the others from C.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from ..native import fields_dtype
from ..native.abi_layout import CALL_ROW_FIELDS, CALL_ROW_SIZE
from .packed_rows import unpack_all
from .recorder import CALL_FIELDS, CallStore, Packed, pack

#: a calls row as native/fmode.cpp's ``CallRow`` lays it out (checked against ROW_SIZE at load)
CALL_DTYPE = fields_dtype(CALL_ROW_FIELDS, CALL_ROW_SIZE)   # native/abi.h CallRow


class LiveCalls(CallStore):
    """``rec.calls`` while the native function mode records: the rows live in C until it hands them
    over; its full blocks stay packed as it packed them (``frozen`` chunks, ~10 B a call, as the
    python engine's ``CallStore`` freezes them). Each spill of the recorder takes the blocks packed
    since the last one from C (``take_packed``) and writes them out with the op chunks (``spill``),
    so C holds only the calls after them; at the end the rest is handed over: its packed blocks
    appended to ``frozen`` and the tail rows a structured array from ``base`` on, read a field (or a
    range of one) at a time: no per-row Python work, and no row of 56 B per call (nor an int64
    matrix of every call) when the trace ends. While recording, ``base`` is the first call C still
    holds: the calls below it are read from the spilled and frozen chunks, never from C."""

    def __init__(self, fm: Any) -> None:
        super().__init__(CALL_FIELDS)
        self._fm = fm   # the C function mode until it hands the rows over, then None
        self._block = int(fm.BLOCK_ROWS)   # calls a packed block holds (native/fmode.h kBlock)
        self._rows: Optional[np.ndarray] = None
        self._released = False
        self._live_cols: dict[str, list[tuple[int, np.ndarray]]] = {}   # fields read while recording (_handed_over)

    def release(self) -> None:
        """Drop the handed-over rows: a spilled trace's finish calls it once the calls table is in
        its file; nothing reads them after that (reading raises)."""
        self._rows = None
        self.frozen = []
        self.close_reads()
        self._released = True

    def _check(self) -> None:
        if self._released:
            raise RuntimeError("the calls rows were released once the calls table was built")

    def field(self, call_id: int, k: int) -> int:
        self._check()
        if self._fm is not None and call_id >= self.base:
            v = self._fm.field(call_id, k)
            return 0 if v is None else v
        if self._rows is not None and call_id >= self.base:
            return int(self._rows[self.fields[k]][call_id - self.base])
        return super().field(call_id, k)

    def full_matrix(self) -> np.ndarray:
        if self._rows is None:
            return super().full_matrix()
        return np.stack([self.column(name) for name in self.fields], axis=1)

    @property
    def live(self) -> bool:
        """Still recording: a field is read whole from C (``column``), ``rec.n_calls`` is set at the end."""
        return self._rows is None and self._fm is not None

    def column(self, name: str) -> np.ndarray:
        self._check()
        rows = self._rows
        if rows is None and self._fm is not None:
            # still recording (a dataset= spill decodes ops now): this field of every call so far,
            # the calls handed over read from their chunks, the rest by C (8 B a call; a copy of
            # whole rows, 56 B a call, kept from one spill to the next, was 40% of a spilling
            # trace's memory)
            raw, n = self._fm.column(self.fields.index(name), self.base)
            rest = np.frombuffer(raw, dtype=np.int64, count=n - self.base)
            return np.concatenate([self._handed_over(name), rest]) if self.base else rest
        if rows is None:
            return super().column(name)
        return self.column_range(name, 0, self.base + len(rows))

    def _handed_over(self, name: str) -> np.ndarray:
        """While recording: field ``name`` of the calls handed over (below ``base``) as int64. Each
        spill of a dataset= trace reads a field of every call so far: its packed parts (a few bytes
        a call at most, nothing for a constant field) are kept from the first read on, the blocks
        taken since added by ``_append``, so no spill reads the spilled files back again."""
        parts = self._live_cols.get(name)
        if parts is None:
            parts = self._live_cols[name] = list(self._frozen_columns(name))
        return unpack_all(parts)

    def _counts(self) -> list[int]:
        return [n for _, n in self.spilled] + [len(ch[self.fields[0]][1]) for ch in self.frozen]

    def _chunk(self, i: int, name: str) -> tuple[int, np.ndarray]:
        """Field ``name`` of packed chunk ``i`` (spilled ones read back), packed."""
        if i >= len(self.spilled):
            return self.frozen[i - len(self.spilled)][name]
        return self.spilled_field(i, name)   # the last few chunks read stay mapped (CallStore)

    def column_range(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Rows ``[lo, hi)`` of one field as int64 (the calls table is built a range at a time):
        from the packed chunks that hold them, then the structured rows."""
        self._check()
        if self._rows is None:
            return self.column(name)[lo:hi]
        out = np.empty(max(hi - lo, 0), np.int64)
        start = 0
        for i, n in enumerate(self._counts()):
            if start >= hi:
                break
            if start + n > lo:
                a, b = max(lo, start), min(hi, start + n)
                base, arr = self._chunk(i, name)
                part = out[a - lo:b - lo]
                part[:] = arr[a - start:b - start]
                if base:
                    part += base
            start += n
        if hi > self.base:
            a = max(lo, self.base)
            out[a - lo:] = self._rows[name][a - self.base:hi - self.base]
        return out

    def spill(self, directory: str) -> None:
        """The recorder spills (its op chunks are written): take the blocks C packed since the last
        spill and write them out with the frozen chunks (``CallStore.spill``), up to
        ``MERGE_BLOCKS`` blocks a part: reading a part back costs ~1 ms whatever its rows, so
        parts of 16,384 calls made finishing ~0.1 us a call slower (in memory they stay blocks:
        re-packed over more calls a field may need a wider type)."""
        self.take_packed()
        merged: list[dict[str, Packed]] = []
        group: list[dict[str, Packed]] = []
        for ch in self.frozen:
            group.append(ch)
            if sum(_rows(c) for c in group) >= MERGE_BLOCKS * self._block:
                merged.append(self._merged(group))
                group = []
        if group:
            merged.append(self._merged(group))
        self.frozen = merged
        super().spill(directory)

    def take_packed(self) -> None:
        """While recording: the full blocks C packed and did not hand over yet, appended to
        ``frozen`` (C frees them; ``base`` moves past them)."""
        if self._fm is not None and self._rows is None:
            first, packed = self._fm.take_packed()
            self._append(first, packed)

    def _append(self, first: int, packed: Sequence[Sequence[tuple[int, int, bytes]]]) -> None:
        """Packed blocks of calls ``first`` on (per field ``(base, width, bytes)``) after ``frozen``."""
        assert first == self.base, (first, self.base)   # call order: they follow the ones handed over
        block = self._block
        chunks = [{name: (int(b), np.frombuffer(buf, dtype=_PACKED[w]) if w else _zeros(block))
                   for name, (b, w, buf) in zip(self.fields, blk)} for blk in packed]
        self.frozen.extend(chunks)
        for name, parts in self._live_cols.items():
            parts.extend(ch[name] for ch in chunks)
        self.base = first + len(packed) * block

    def _merged(self, chunks: Sequence[dict[str, Packed]]) -> dict[str, Packed]:
        """One frozen chunk of ``chunks`` (in call order): a field constant over them costs nothing
        (a broadcast zero, as C's width 0), another is widened a field at a time and ``pack``ed."""
        if len(chunks) == 1:
            return chunks[0]
        n = sum(_rows(ch) for ch in chunks)
        out: dict[str, Packed] = {}
        for name in self.fields:
            parts = [ch[name] for ch in chunks]
            b0 = parts[0][0]
            if all(b == b0 and a.strides == (0,) and a[0] == 0 for b, a in parts):
                out[name] = (b0, _zeros(n))
                continue
            out[name] = pack(unpack_all(parts))
        return out

    def handover(self, raw: bytes, n: int, first: int = 0,
                 packed: Sequence[Sequence[tuple[int, int, bytes]]] = ()) -> None:
        """The C mode's rows not handed over yet (``take_packed``): ``packed`` full blocks (per
        field ``(base, width, bytes)``) from call ``base`` on, then the CALL_DTYPE rows of calls
        ``first`` .. ``n - 1``."""
        self._append(self.base, packed)
        assert self.base == first, (self.base, first)
        self._rows = np.frombuffer(raw, dtype=CALL_DTYPE, count=n - first)
        self._fm = None
        self._live_cols = {}


#: the packed calls blocks (16,384 calls each) a spilled calls part holds at most
MERGE_BLOCKS = 16
def _zeros(n: int) -> np.ndarray:
    """A packed field that is its base on ``n`` rows: a broadcast zero (no memory)."""
    return np.broadcast_to(np.zeros(1, np.uint8), (n,))


def _rows(chunk: dict[str, Packed]) -> int:
    return len(next(iter(chunk.values()))[1])


#: a packed calls field's width -> its numpy type (native/fmode.h: unsigned, minus the base; 8: raw)
_PACKED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
