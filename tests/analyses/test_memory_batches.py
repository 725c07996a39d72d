"""The live-bytes tables built a block of ops at a time equal the whole-table definitions.

``memory``, ``memory_timeline`` and ``module_memory`` are built by ``LiveSweep`` (analyses/live_sweep.py)
over op blocks, reading the storages a chunk at a time; here each is compared, over blocks of one op and
of a few ops (a storage alive across many blocks, peaks and tie-breaks at block edges) and chunks of one
and a few storages, with the whole-array definitions they replaced (kept below as the reference: every
op's live bytes in one array, ``live_matrix``), on a training trace, the same storages listed in reverse
(not in first-sighting order: the sweep reads them whole), on two devices, and as a table of many small
chunks (the ops too: pieces with their own dictionaries).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

import tensorscope
from tensorscope import schema as S
from tensorscope.analyses.memory import _devices, _int_column, live_mask, memory_peak, memory_table
from tensorscope.analyses.memory_batches import memory_at, memory_batches, memory_timeline_batches, module_memory
from tensorscope.analyses.memory_categories import (
    _CAT,
    CATS,
    _category_codes,
    _codes,
    _op_columns,
    backward_region,
    peaks,
)

# -- the whole-table definitions (what the batched builders replaced), the reference ------------

def _sum_by(index: np.ndarray, weights: np.ndarray, n: int) -> np.ndarray:
    if index.size == 0:
        return np.zeros(n, dtype=np.int64)
    return np.bincount(index, weights=weights.astype(np.float64), minlength=n)[:n].astype(np.int64)


def live_matrix(key: np.ndarray, nbytes: np.ndarray, alloc: np.ndarray, free: np.ndarray, n_keys: int,
                n_ops: int) -> tuple[np.ndarray, np.ndarray]:
    """(live[k, s], baseline[k]): bytes of the storages of each key (device, or device and category)
    live while op ``s`` runs (``live_mask``, for every op at once), and before the first op.

    Built in one ``n_keys x n_ops`` array (the changes per op, summed in place), with one more of
    the same size at a time: an event at or past ``n_ops`` changes no op's bytes and is left out."""
    pre = alloc < 0
    baseline = _sum_by(key[pre], nbytes[pre], n_keys)
    size = n_keys * n_ops
    made = ~pre & (alloc < n_ops)
    # (bincount's float64 sums are exact below 2**53 bytes)
    delta = np.bincount(key[made] * n_ops + alloc[made], weights=nbytes[made].astype(np.float64), minlength=size)
    # a storage freed after op f started still counts during f: it stops counting at f + 1
    freed = (free >= 0) & (free + 1 < n_ops)
    delta -= np.bincount(key[freed] * n_ops + free[freed] + 1, weights=nbytes[freed].astype(np.float64),
                         minlength=size)
    live = delta.astype(np.int64).reshape(n_keys, n_ops)
    del delta
    np.cumsum(live, axis=1, out=live)
    live += baseline[:, None]
    return live, baseline


def whole_memory_table(tensors: pa.Table, n_ops: int) -> pa.Table:
    nbytes = _int_column(tensors, "nbytes", 0)
    alloc = _int_column(tensors, "alloc_seq", -1)
    free = _int_column(tensors, "free_seq", -1)
    dev_order, dev = _devices(tensors)
    live, baseline = live_matrix(dev, nbytes, alloc, free, len(dev_order), n_ops)
    delta = live.copy()
    delta[:, 1:] -= live[:, :-1]
    delta[:, 0] -= baseline
    seqs = np.tile(np.arange(n_ops, dtype=np.int64), len(dev_order))
    dev_col = pa.DictionaryArray.from_arrays(np.repeat(np.arange(len(dev_order), dtype=np.int32), n_ops),
                                             pa.array(dev_order, pa.string())).cast(pa.string())
    return pa.Table.from_arrays([pa.array(seqs), dev_col, pa.array(live.reshape(-1)),
                                 pa.array(delta.reshape(-1))], schema=S.MEMORY)


def storage_columns(tensors: pa.Table) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What the live-bytes views read of each storage: (device names, device code, category code,
    nbytes, alloc_seq (-1: before the trace), free_seq (-1: never freed))."""
    names, dev = _devices(tensors)
    return (names, dev, _category_codes(tensors), _int_column(tensors, "nbytes", 0),
            _int_column(tensors, "alloc_seq", -1), _int_column(tensors, "free_seq", -1))


def _live(tensors: pa.Table, n_ops: int) -> tuple[list[str], np.ndarray]:
    """(devices, live[d, c, s]): bytes of category c on device d live while op s runs (``live_mask``)."""
    names, dev, cat, nbytes, alloc, free = storage_columns(tensors)
    D, C = len(names), len(CATS)
    live, _ = live_matrix(dev * C + cat, nbytes, alloc, free, D * C, n_ops)
    return names, live.reshape(D, C, n_ops)


def _repeated(names: list[str], n: int) -> pa.Array:
    """Each of ``names`` ``n`` times, as one string array (through a dictionary: no string per row in Python)."""
    codes = np.repeat(np.arange(len(names), dtype=np.int32), n)
    return pa.DictionaryArray.from_arrays(codes, pa.array(names, pa.string())).cast(pa.string())


def whole_memory_timeline(tensors: pa.Table, ops: pa.Table) -> pa.Table:
    """MEMORY_TIMELINE rows: per device, one row per op (seq order), live bytes per category while it runs."""
    n_ops = ops.num_rows
    if n_ops == 0 or tensors.num_rows == 0:
        return S.MEMORY_TIMELINE.empty_table()
    names, live = _live(tensors, n_ops)
    D = len(names)
    total = live.sum(axis=1)
    peak = np.zeros((D, n_ops), bool)
    peak[np.arange(D), np.argmax(total, axis=1)] = True
    rows = np.tile(np.arange(n_ops, dtype=np.int64), D)
    opc = _op_columns(ops, n_ops, rows)
    cols: dict[str, Any] = dict(seq=pa.array(rows), device=_repeated(names, n_ops),
                                live_bytes=pa.array(total.reshape(-1)), is_peak=pa.array(peak.reshape(-1)))
    cols.update(opc)
    for ci, c in enumerate(CATS):
        cols[f"{c}_bytes"] = pa.array(live[:, ci, :].reshape(-1))
    return pa.Table.from_arrays([cols[f.name] for f in S.MEMORY_TIMELINE], schema=S.MEMORY_TIMELINE)



def _ancestors(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def storage_modules(tensors: pa.Table, ops: pa.Table) -> tuple[np.ndarray, list[Optional[str]]]:
    """(per storage an index into the names, -1 for none; names): the module that made it (the
    op's module: backward ops carry their forward op's), or for one the trace did not make, the
    module whose op first read it. Vectorised: one lookup table per dictionary."""
    names: list[Optional[str]] = []
    index: dict[Optional[str], int] = {}

    def lut(values: list[Optional[str]]) -> np.ndarray:
        return np.array([-1 if v is None else index.setdefault(v, len(index)) for v in values] + [-1],
                        dtype=np.int64)

    tcodes, tvals = _codes(tensors.column("module"))
    codes = lut(tvals)[tcodes]
    if ops.num_rows:
        alloc = _int_column(tensors, "alloc_seq", -1)
        made = (alloc >= 0) & (alloc < ops.num_rows)
        if made.any():
            ocodes, ovals = _codes(ops.column("module"))
            codes[made] = lut(ovals)[ocodes[alloc[made]]]
    names = [None] * len(index)
    for v, i in index.items():
        names[i] = v
    return codes, names


def whole_memory_at(tensors: pa.Table, ops: pa.Table, seq: Optional[int] = None) -> pa.Table:
    """MEMORY_AT rows: storages live while op ``seq`` ran grouped by (device, category, module), largest
    first. ``seq`` None: each device at its own peak."""
    n_ops = ops.num_rows
    if n_ops == 0 or tensors.num_rows == 0:
        return S.MEMORY_AT.empty_table()
    names, dev = _devices(tensors)
    if seq is None:
        tl = whole_memory_timeline(tensors, ops)
        at = {p["device"]: p["seq"] for p in peaks(tl)}
    else:
        at = {d: int(seq) for d in names}
    nbytes = _int_column(tensors, "nbytes", 0)
    alloc = _int_column(tensors, "alloc_seq", -1)
    free = _int_column(tensors, "free_seq", -1)
    cat = _category_codes(tensors)
    mcodes, mnames = storage_modules(tensors, ops)
    M = len(mnames) + 1
    out: list[dict[str, Any]] = []
    for di, d in enumerate(names):
        s = at.get(d)
        if s is None:
            continue
        alive = np.nonzero((dev == di) & live_mask(alloc, free, s))[0]
        if not len(alive):
            continue
        key = cat[alive] * M + (mcodes[alive] + 1)
        keys, inv = np.unique(key, return_inverse=True)
        sums = np.bincount(inv, weights=nbytes[alive].astype(np.float64)).astype(np.int64)
        counts = np.bincount(inv)
        for k in np.argsort(-sums, kind="stable").tolist():
            mi = int(keys[k] % M) - 1
            out.append(dict(seq=s, device=d, category=CATS[int(keys[k] // M)],
                            module=mnames[mi] if mi >= 0 else None, bytes=int(sums[k]), storages=int(counts[k])))
    return pa.Table.from_pylist(out, schema=S.MEMORY_AT)


def whole_module_memory(tensors: pa.Table, ops: pa.Table, calls: Optional[pa.Table] = None) -> pa.Table:
    """MODULE_MEMORY rows, largest activations first (see the module docstring)."""
    n_ops = ops.num_rows
    if n_ops == 0 or tensors.num_rows == 0:
        return S.MODULE_MEMORY.empty_table()
    # live bytes per device while each op runs (every category at once: one row per device, not per category)
    names, dev = _devices(tensors)
    total, _ = live_matrix(dev, _int_column(tensors, "nbytes", 0), _int_column(tensors, "alloc_seq", -1),
                           _int_column(tensors, "free_seq", -1), len(names), n_ops)   # [device, seq]
    mcodes, mvalues = _codes(ops.column("module"))
    bwd = backward_region(ops, calls)
    rows: dict[tuple[str, str], dict[str, Any]] = {}

    def row(m: str, d: str) -> dict[str, Any]:
        r = rows.get((m, d))
        if r is None:
            r = rows[(m, d)] = dict(module=m, device=d, depth=m.count("."), activation_bytes=0,
                                    own_activation_bytes=0, fwd_peak_bytes=None, fwd_peak_seq=None,
                                    bwd_peak_bytes=None, bwd_peak_seq=None, fwd_ops=0, bwd_ops=0)
        return r

    has = mcodes >= 0
    for di, d in enumerate(names):
        for phase, mask in (("fwd", ~bwd), ("bwd", bwd)):
            sel = np.nonzero(has & mask)[0]
            if not len(sel):
                continue
            codes = mcodes[sel]
            order = np.lexsort((sel, codes))
            sel, codes = sel[order], codes[order]
            starts = np.concatenate([[0], np.nonzero(np.diff(codes))[0] + 1])
            vals = total[di, sel]
            for k, st in enumerate(starts.tolist()):
                end = int(starts[k + 1]) if k + 1 < len(starts) else len(sel)
                j = st + int(np.argmax(vals[st:end]))
                path = mvalues[int(codes[st])]
                if path is None:
                    continue
                for anc in _ancestors(path):
                    r = row(anc, d)
                    r[f"{phase}_ops"] += end - st
                    b = int(vals[j])
                    if r[f"{phase}_peak_bytes"] is None or b > r[f"{phase}_peak_bytes"] or (
                            b == r[f"{phase}_peak_bytes"] and int(sel[j]) < r[f"{phase}_peak_seq"]):
                        r[f"{phase}_peak_bytes"], r[f"{phase}_peak_seq"] = b, int(sel[j])
    _, dev = _devices(tensors)
    cat = _category_codes(tensors)
    act = np.nonzero(cat == _CAT["activation"])[0]
    if len(act):
        mcodes, mnames = storage_modules(tensors, ops)
        nbytes = _int_column(tensors, "nbytes", 0)
        act = act[mcodes[act] >= 0]
        M = len(mnames)
        key = dev[act] * M + mcodes[act]
        keys, inv = np.unique(key, return_inverse=True)
        sums = np.bincount(inv, weights=nbytes[act].astype(np.float64)).astype(np.int64)
        for k, b in zip(keys.tolist(), sums.tolist()):
            m, d = mnames[k % M], names[k // M]
            if m is None:
                continue
            row(m, d)["own_activation_bytes"] += b
            for anc in _ancestors(m):
                row(anc, d)["activation_bytes"] += b
    out = sorted(rows.values(), key=lambda r: (-r["activation_bytes"], -(r["fwd_peak_bytes"] or 0), r["module"]))
    return pa.Table.from_pylist(out, schema=S.MODULE_MEMORY)


def whole_memory_peak(memory: pa.Table, ops: Optional[pa.Table] = None, tensors: Optional[pa.Table] = None) -> dict[str, dict[str, Any]]:
    """Per device: ``peak_bytes`` and ``peak_seq`` (first op during which live bytes were largest),
    ``peak_op`` (its name, when ``ops`` is given), ``start_bytes`` (before seq 0), ``end_bytes``
    (during the last op) and, when ``tensors`` is given, ``high_water_bytes``/``high_water_seq``:
    the same rule over every storage of ``tensors`` (equal to the peak since live bytes count what
    an op allocates and what it frees within itself; kept for readers of the key)."""
    out: dict[str, dict[str, Any]] = {}
    if memory.num_rows == 0:
        return out
    seq = memory.column("seq").to_numpy()
    live = memory.column("live_bytes").to_numpy()
    delta = memory.column("delta_bytes").to_numpy()
    names, devs = _devices(memory)
    op_col = ops.column("op") if ops is not None and ops.num_rows else None
    noise: Optional[np.ndarray] = None
    if ops is not None and op_col is not None and "is_noise" in ops.column_names:
        noise = np.asarray(pc.fill_null(ops.column("is_noise"), False).to_numpy(zero_copy_only=False)).astype(bool)
    hw = _whole_high_water(tensors) if tensors is not None else {}
    for di, d in enumerate(names):
        m = devs == di
        s, lv, dl = seq[m], live[m], delta[m]
        k = int(np.argmax(lv))
        if noise is not None:
            # the first op after which live bytes were largest that is not eager's bookkeeping (a lift or
            # detach moves no data: never the op a peak is named after); none: the peak names no op
            at_peak = np.nonzero(lv == lv[k])[0]
            sp = s[at_peak]
            inside = (sp >= 0) & (sp < len(noise))
            named = at_peak[inside][~noise[sp[inside]]]
            k = int(named[0]) if len(named) else k
        info = {"peak_bytes": int(lv[k]), "peak_seq": int(s[k]), "start_bytes": int(lv[0] - dl[0]),
                "end_bytes": int(lv[-1])}
        if op_col is not None and 0 <= info["peak_seq"] < len(op_col) and not (noise is not None and noise[info["peak_seq"]]):
            info["peak_op"] = op_col[info["peak_seq"]].as_py()
        if d in hw:
            info["high_water_bytes"], info["high_water_seq"] = hw[d]
        out[d] = info
    return out


def _whole_high_water(tensors: pa.Table) -> dict[str, tuple[int, int]]:
    """Per device (bytes, seq): the largest live bytes while an op runs, over every op a storage of
    ``tensors`` names (``live_mask``)."""
    if tensors.num_rows == 0:
        return {}
    nbytes = _int_column(tensors, "nbytes", 0)
    alloc = _int_column(tensors, "alloc_seq", -1)
    free = _int_column(tensors, "free_seq", -1)
    names, dev = _devices(tensors)
    n = int(max(alloc.max(initial=-1), free.max(initial=-1))) + 1
    if n <= 0:
        return {}
    live, _ = live_matrix(dev, nbytes, alloc, free, len(names), n)
    return {d: (int(live[di].max()), int(np.argmax(live[di]))) for di, d in enumerate(names)}


# -- the comparisons ---------------------------------------------------------------------------

def _training():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(),
                                torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.Tanh()), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(16, 6)
    kept = []
    with tensorscope.trace() as t:
        for _ in range(3):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            kept.append(loss.detach())
    return t.result


@pytest.fixture(scope="module")
def trace():
    return _training()


def _variants(t):
    tensors = t.tensors
    yield "recorded", tensors, t.ops
    yield "reversed", tensors.take(pa.array(np.arange(tensors.num_rows)[::-1])), t.ops
    dev = [("meta" if i % 3 == 0 else d) for i, d in enumerate(tensors.column("device").to_pylist())]
    yield "two devices", tensors.set_column(tensors.schema.get_field_index("device"), "device",
                                            pa.array(dev).dictionary_encode()), t.ops
    yield "small chunks", pa.Table.from_batches(tensors.to_batches(max_chunksize=5)), \
        pa.Table.from_batches([S.plain_strings(pa.Table.from_batches([b])).to_batches()[0]
                               for b in t.ops.to_batches(max_chunksize=4)])   # a dictionary per piece


@pytest.mark.parametrize("block,step", [(1, 1), (7, 3), (1 << 16, 1 << 16)])
def test_the_batched_tables_equal_the_whole_ones(trace, block, step):
    n = trace.ops.num_rows
    for name, tensors, ops in _variants(trace):
        got = pa.Table.from_batches(list(memory_batches(tensors, n, block=block, step=step)), schema=S.MEMORY)
        want = whole_memory_table(tensors, n)
        assert got.equals(want), name
        assert got.num_rows == n * (2 if name == "two devices" else 1)
        got = pa.Table.from_batches(list(memory_timeline_batches(tensors, ops, block=block, step=step)),
                                    schema=S.MEMORY_TIMELINE)
        want = whole_memory_timeline(tensors, trace.ops)
        assert got.equals(want), name
        assert got.column("is_peak").to_pylist().count(True) == (2 if name == "two devices" else 1)
        got = module_memory(tensors, ops, trace.calls, block=block, step=step)
        want = whole_module_memory(tensors, trace.ops, trace.calls)
        assert got.equals(want), name
        assert {r["module"] for r in got.to_pylist()} >= {"0", "2", "2.0", "3"}
        assert any(r["activation_bytes"] for r in got.to_pylist())
        for seq in (None, 0, n // 2, n - 1):
            got = memory_at(tensors, ops, seq, step=step)
            assert got.equals(whole_memory_at(tensors, trace.ops, seq)), (name, seq)
            assert got.num_rows


def test_the_public_builders_are_the_batched_ones(trace):
    from tensorscope.analyses.memory_categories import memory_timeline
    from tensorscope.analyses.memory_categories import module_memory as mm

    assert memory_table(trace.tensors, trace.ops.num_rows).equals(whole_memory_table(trace.tensors, trace.ops.num_rows))
    assert memory_timeline(trace.tensors, trace.ops).equals(whole_memory_timeline(trace.tensors, trace.ops))
    assert mm(trace.tensors, trace.ops, trace.calls).equals(whole_module_memory(trace.tensors, trace.ops, trace.calls))
    assert trace.memory.equals(whole_memory_table(trace.tensors, trace.ops.num_rows))
    assert trace.memory_timeline.to_arrow().equals(whole_memory_timeline(trace.tensors, trace.ops))
    assert trace.module_memory.to_arrow().equals(whole_module_memory(trace.tensors, trace.ops, trace.calls))


def _flat():
    """Every op allocates and frees the same bytes: the peak is tied over every op, bookkeeping ones too."""
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with tensorscope.trace() as t:
        for _ in range(30):
            a.add(b)
            torch.tensor([1.0, 2.0])
    return t.result


@pytest.mark.parametrize("rows", [1, 3, 1 << 16])
def test_memory_peak_read_a_batch_at_a_time_equals_the_whole_read(trace, rows, monkeypatch):
    from tensorscope.analyses import live_sweep

    monkeypatch.setattr(live_sweep, "STORAGE_STEP", rows)   # memory rows and storages read at a time
    for t in (trace, _flat()):
        n = t.ops.num_rows
        for name, tensors, ops in _variants(t) if t is trace else [("flat", t.tensors, t.ops)]:
            mem = whole_memory_table(tensors, n)
            for m in (mem, pa.Table.from_batches(mem.to_batches(max_chunksize=rows))):
                want = whole_memory_peak(mem, t.ops, tensors)
                assert memory_peak(m, ops, tensors) == want, name
                assert memory_peak(m, ops) == whole_memory_peak(mem, t.ops), name
                assert memory_peak(m) == whole_memory_peak(mem), name
                assert want and all("peak_op" in p and "high_water_bytes" in p for p in want.values()), want


def _tied(t):
    """``t``'s ops over storages that make every op's live bytes equal (one kept from before the trace,
    one made and freed by each op), the first seven ops bookkeeping: the peak is the first op, and
    the op it is named after the first one past the bookkeeping, several batches later."""
    n = t.ops.num_rows
    tensors = S.conform("tensors", pa.table({
        "storage_id": pa.array(range(n + 1), pa.int64()), "nbytes": pa.array([100] + [50] * n, pa.int64()),
        "alloc_seq": pa.array([None] + list(range(n)), pa.int64()),
        "free_seq": pa.array([None] + list(range(n)), pa.int64()), "device": pa.array(["cpu"] * (n + 1))}))
    noise = pa.array([i < 7 for i in range(n)])
    return tensors, t.ops.set_column(t.ops.schema.get_field_index("is_noise"), "is_noise", noise)


@pytest.mark.parametrize("rows", [1, 3, 1 << 16])
def test_a_peak_tied_past_bookkeeping_ops_is_named_after_the_first_real_op(trace, rows, monkeypatch):
    from tensorscope.analyses import live_sweep
    from tensorscope.analyses.memory_digest import digest_memory_peak, memory_digest

    monkeypatch.setattr(live_sweep, "STORAGE_STEP", rows)
    tensors, ops = _tied(trace)
    mem = whole_memory_table(tensors, ops.num_rows)
    assert set(mem.column("live_bytes").to_pylist()) == {150}
    want = whole_memory_peak(mem, ops, tensors)
    assert want["cpu"]["peak_seq"] == 7 and want["cpu"]["high_water_seq"] == 0
    assert memory_peak(pa.Table.from_batches(mem.to_batches(max_chunksize=rows)), ops, tensors) == want
    assert digest_memory_peak(memory_digest(tensors, ops, 10, block=rows, step=rows), ops, tensors) == want


def test_the_ops_columns_of_a_few_rows_are_taken_chunk_by_chunk(trace):
    from tensorscope.analyses.memory_columns import _op_columns, take_plain

    ops = trace.ops
    # chunks of 4 ops, each with its own dictionaries (another writer's pieces)
    pieces = pa.Table.from_batches([S.plain_strings(pa.Table.from_batches([b])).to_batches()[0]
                                    for b in ops.to_batches(max_chunksize=4)])
    rows = np.array([17, 3, 3, ops.num_rows - 1, 0, 9], np.int64)   # any order, repeated, across chunks
    # chunks of 5 ops whose string columns are dictionaries of their own (codes differ across batches)
    own = []
    for b in S.plain_strings(ops).to_batches(max_chunksize=5):
        cols = [c.dictionary_encode() if pa.types.is_string(c.type) else c for c in b.columns]
        own.append(pa.RecordBatch.from_arrays(cols, names=b.schema.names))
    own_dicts = pa.Table.from_batches(own)
    assert own_dicts.num_rows == ops.num_rows and own_dicts.column("op").num_chunks > 3
    names = ["op", "module", "source_line", "phase"]
    want_all = S.plain_strings(ops.select(names).take(pa.array(rows)))
    for t in (ops, pieces, own_dicts):
        got = take_plain(t.select(names), rows)
        assert got.column("op").num_chunks == 1, "one chunk a column"
        for name in names:
            assert got.column(name).chunk(0).equals(want_all.column(name).combine_chunks()), name
    for name in ("op", "module", "source_line"):
        want = S.plain_strings(ops.select([name]).take(pa.array(rows))).column(name).combine_chunks()
        for t in (ops, pieces, own_dicts):
            assert take_plain(t.select([name]), rows).column(name).chunk(0).equals(want), name
    assert take_plain(ops.select(names), np.zeros(0, np.int64)).num_rows == 0
    got = _op_columns(pieces, ops.num_rows, rows)
    assert got["op"].to_pylist() == [ops.column("op")[int(r)].as_py() for r in rows]


@pytest.mark.parametrize("categories", [False, True])
def test_a_sweep_of_one_storage_chunk_reads_it_once(trace, categories, monkeypatch):
    """A tensors table of at most ``step`` rows is read once (the sweep's passes share the chunk); its
    blocks equal a sweep read many chunks at a time, the storages in their order and reversed (not in
    first-sighting order: every event at once)."""
    from tensorscope.analyses import live_sweep

    n = trace.ops.num_rows
    reads = []
    real = live_sweep.LiveSweep._read_chunks
    monkeypatch.setattr(live_sweep.LiveSweep, "_read_chunks", lambda self: reads.append(1) or real(self))
    for tensors in (trace.tensors, trace.tensors.take(pa.array(np.arange(trace.tensors.num_rows)[::-1]))):
        reads.clear()
        one = live_sweep.LiveSweep(tensors, n, categories=categories)
        got = [(a, b, live.copy()) for a, b, live in one.blocks([0, n // 3, n])]
        assert len(reads) == 1 and one._one is not None
        many = live_sweep.LiveSweep(tensors, n, categories=categories, step=5)
        want = list(many.blocks([0, n // 3, n]))
        assert many._one is None and len(reads) > 2
        assert one.ordered == many.ordered and one.names == many.names
        assert [(a, b) for a, b, _ in got] == [(a, b) for a, b, _ in want]
        for (_, _, x), (_, _, y) in zip(got, want):
            assert np.array_equal(x, y)
