"""Compiled regions linked: the ``graphs``/``graph_nodes`` tables, and which ops and calls ran which graph.

``link(records, ops, calls, notes)`` runs once per trace, after decoding (the compiled regions
probe's contribution, recording/probes.py): it parses the structured-trace records
``compiled.CompileCapture`` kept (``compiled.graphs_from_records``), remembers the graphs for
later traces, and gives the columns ``ops/calls.graph_id`` and ``calls.compiled``
(see docs/development/architecture.md, "Compiled regions").
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from .compiled import (
    _GENERATED,
    _REGISTRY,
    _REGISTRY_BY_HASH,
    _REGISTRY_LOCK,
    Record,
    _file_md5,
    _remember,
    graphs_from_records,
)
from .spilled import null_column


def graph_tables(graphs: list[dict[str, Any]]) -> tuple[pa.Table, pa.Table]:
    rows, nrows = [], []
    for gid, g in enumerate(graphs):
        nodes = g.get("nodes") or []
        n_ops = sum(1 for n in nodes if n["op"] not in ("input", "output"))
        kernels = g.get("kernels")
        rows.append(dict(
            graph_id=gid, kind=g["kind"], compile_id=g.get("compile_id"), phase=g.get("phase"), frame=g.get("frame"),
            source_file=g.get("source_file"), source_line=g.get("source_line"), compile_ns=g.get("compile_ns"),
            n_nodes=len(nodes) if g["kind"] != "inductor" else None,
            n_ops=n_ops if g["kind"] != "inductor" else None,
            n_kernels=len(kernels) if kernels is not None else None, kernels=kernels,
            guards=g.get("guards") if g["kind"] == "dynamo" else None,
            recompile_reason=g.get("recompile_reason"), cache=g.get("cache"), code_file=g.get("code_file"),
            compiled_in_trace=bool(g.get("compiled_in_trace", True)),
        ))
        for n in nodes:
            nrows.append(dict(graph_id=gid, idx=n["idx"], name=n["name"], op=n["op"], shapes=n["shapes"],
                              strides=n["strides"], dtypes=n["dtypes"], source_file=n["source_file"],
                              source_line=n["source_line"]))
    g = pa.Table.from_pylist(rows, schema=S.GRAPHS) if rows else S.empty("graphs")
    n = pa.Table.from_pylist(nrows, schema=S.GRAPH_NODES) if nrows else S.empty("graph_nodes")
    return g, n


def _link(graphs: list[dict[str, Any]], ops: pa.Table, calls: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """graph_id per call and per op (numpy int64, -1 = none), and the graphs actually used from earlier traces."""
    n_calls, n_ops = calls.num_rows, ops.num_rows
    call_gid = np.full(n_calls, -1, np.int64)
    op_gid = np.full(n_ops, -1, np.int64)
    by_file: dict[str, int] = {}
    by_md5: dict[str, int] = {}
    for gid, g in enumerate(graphs):
        if g["kind"] == "inductor":
            if g.get("code_file"):
                by_file[g["code_file"]] = gid
            if g.get("code_md5"):
                by_md5[g["code_md5"]] = gid
    # files that ran and were compiled before this trace: pull their compile from the registry
    files: Any = set()   # the file names, then (below) an Arrow array of them
    if n_calls:
        files.update(f for f in calls.column("source_file").unique().to_pylist() if f)
    if n_ops:
        files.update(f for f in ops.column("source_file").unique().to_pylist() if f)
    for f in files:
        if f in by_file or not _GENERATED.match(os.path.basename(f)):
            continue
        h = None
        with _REGISTRY_LOCK:
            group = _REGISTRY.get(f)
        if group is None:
            h = _file_md5(f)
            if h is None:
                continue
            if h in by_md5:
                by_file[f] = by_md5[h]
                continue
            with _REGISTRY_LOCK:
                alt = _REGISTRY_BY_HASH.get(h)
                group = _REGISTRY.get(alt) if alt else None
            if group is None:
                continue
        base = len(graphs)
        graphs.extend(dict(g, compiled_in_trace=False) for g in group)
        for i, g in enumerate(group):
            if g["kind"] == "inductor":
                if g.get("code_file"):
                    by_file.setdefault(g["code_file"], base + i)
                if g.get("code_md5"):
                    by_md5.setdefault(g["code_md5"], base + i)
        if f not in by_file:
            h = h or _file_md5(f)
            if h in by_md5:
                by_file[f] = by_md5[h]
    if not by_file:
        return call_gid, op_gid
    # vectorised: traces can hold millions of ops
    files = pa.array(list(by_file), pa.string())
    file_gid = np.array(list(by_file.values()), dtype=np.int64)

    def gid_of(col: Any) -> np.ndarray:
        if isinstance(col, pa.ChunkedArray):
            col = col.combine_chunks()
        if pa.types.is_dictionary(col.type):   # schema 1.2 dictionary columns
            col = col.cast(pa.string())
        idx = pc.index_in(col, value_set=files).fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        out = np.full(len(idx), -1, np.int64)
        ok = idx >= 0
        out[ok] = file_gid[idx[ok]]
        return out

    sib = np.arange(len(graphs), dtype=np.int64)   # runtime graph -> its backward sibling
    backward_of = {g.get("compile_id"): gid for gid, g in enumerate(graphs)
                   if g["kind"] == "inductor" and g.get("phase") == "backward"}
    for gid, g in enumerate(graphs):
        if g["kind"] == "inductor" and g.get("compile_id") in backward_of:
            sib[gid] = backward_of[g["compile_id"]]
    if n_calls:
        call_gid[:] = gid_of(calls.column("source_file"))
        parent = calls.column("parent_id").fill_null(-1).to_numpy()
        for i in np.nonzero((call_gid < 0) & (parent >= 0))[0].tolist():   # nested in a linked call: same region
            if call_gid[parent[i]] >= 0:                            # (parents precede their children)
                call_gid[i] = call_gid[parent[i]]
    if n_ops:
        call = ops.column("call_id").fill_null(-1).to_numpy()
        has = (call >= 0) & (call < n_calls)
        op_gid[has] = call_gid[call[has]]
        src_gid = gid_of(ops.column("source_file"))
        bwd = pc.equal(ops.column("phase"), "backward").fill_null(False).to_numpy(zero_copy_only=False)
        fill = ~bwd & (op_gid < 0) & (src_gid >= 0)
        op_gid[fill] = src_gid[fill]
        compiled_node = pc.match_substring(pc.cast(ops.column("autograd_node"), pa.string()), "CompiledFunction").fill_null(False) \
            .to_numpy(zero_copy_only=False)
        fwd_gid = op_gid.copy()
        op_gid[bwd] = -1   # AccumulateGrad & co: the autograd engine, not the compiled graph
        fwd = ops.column("fwd_seq").fill_null(-1).to_numpy()
        rows = np.nonzero(bwd & compiled_node)[0]
        if len(rows):
            f = fwd[rows]
            ok = (f >= 0) & (f < n_ops)
            fg = np.full(len(rows), -1, np.int64)
            fg[ok] = fwd_gid[f[ok]]
            fg = np.where(fg >= 0, fg, src_gid[rows])
            op_gid[rows] = np.where(fg >= 0, sib[np.maximum(fg, 0)], -1)
    return call_gid, op_gid


def _note_unknown_regions(notes: list[str], calls: pa.Table, call_gid: np.ndarray) -> None:
    """Calls from Inductor-generated code whose compile this process never saw: say why there is no graph."""
    if calls.num_rows == 0:
        return
    # per distinct file, not per row (a long trace has millions of calls, a handful of files), chunk
    # by chunk (a spilled trace's calls are memory-mapped: never combined into one array)
    col = calls.column("source_file")
    n = pos = 0
    for chunk in col.chunks if isinstance(col, pa.ChunkedArray) else [col]:
        m = len(chunk)
        if not pa.types.is_dictionary(chunk.type):
            chunk = chunk.dictionary_encode()
        names = chunk.dictionary.to_pylist()
        generated = np.array([bool(f) and bool(_GENERATED.match(os.path.basename(f))) for f in names] + [False])
        if generated.any():   # else no call from generated code here (the common case): nothing to count
            codes = chunk.indices.fill_null(len(names)).to_numpy(zero_copy_only=False).astype(np.int64)
            n += int(np.count_nonzero(generated[codes] & (call_gid[pos:pos + m] < 0)))
        pos += m
    if n:
        notes.append(
            f"{n} torch-level call(s) came from torch.compile'd code compiled before any trace saw it, so its "
            "graphs are unknown: compile inside a traced cell (or call torch._dynamo.reset() first) to see them")


def _user_location(table: pa.Table, gid: np.ndarray, graphs: list[dict[str, Any]]) -> pa.Table:
    """Rows that ran in a compiled region point at Inductor's generated file (the first frame outside torch):
    show the compiled function's file and first line instead (the generated file is ``graphs.code_file``)."""
    linked = gid >= 0
    if not linked.any() or "source_file" not in table.column_names:
        return table
    files = pa.array([g.get("source_file") for g in graphs], pa.string())
    lines = pa.array([g.get("source_line") for g in graphs], pa.int64())
    idx = pa.array(np.where(linked, gid, 0))
    mask = pa.array(linked & pc.is_valid(files.take(idx)).to_numpy(zero_copy_only=False))
    for col, values in (("source_file", files), ("source_line", lines)):
        i = table.schema.get_field_index(col)
        field = table.schema.field(i)
        new = pc.if_else(mask, values.take(idx), pc.cast(table.column(col), values.type))
        if pa.types.is_dictionary(field.type):   # schema 1.2 dictionary columns: encode back
            new = pc.dictionary_encode(new).cast(field.type)
        table = table.set_column(i, field, new)
    return table


def link(records: list[Record], ops: pa.Table, calls: pa.Table, notes: list[str]
         ) -> tuple[dict[str, pa.Table], dict[tuple[str, str], Any]]:
    """The ``graphs``/``graph_nodes`` tables built from the capture's ``records``, and the columns
    they give the decoded ``ops`` and ``calls`` (``graph_id``, ``calls.compiled``, and the
    ``source_file``/``source_line`` of rows that ran in a compiled region); a note is appended to
    ``notes`` for calls from code compiled before any trace saw it."""
    graphs = graphs_from_records(records)
    if graphs:
        _remember(graphs)
    with _REGISTRY_LOCK:
        known = bool(_REGISTRY)
    if graphs or known:
        call_gid, op_gid = _link(graphs, ops, calls)
    else:   # nothing compiled in this trace nor remembered from an earlier one: nothing can link
        # (views of one -1: a long trace's rows hold no memory for them)
        call_gid = np.broadcast_to(np.int64(-1), (calls.num_rows,))
        op_gid = np.broadcast_to(np.int64(-1), (ops.num_rows,))
    _note_unknown_regions(notes, calls, call_gid)
    columns: dict[tuple[str, str], Any] = {("calls", "compiled"): pa.array(call_gid >= 0, pa.bool_())}
    for name, gid in (("ops", op_gid), ("calls", call_gid)):
        # nothing linked (most traces): null chunks that share one array, not 9 bytes a row
        columns[(name, "graph_id")] = S.nullable_array(gid, gid < 0) if (gid >= 0).any() else \
            null_column(len(gid), pa.int64())
    for name, table, gid in (("ops", ops, op_gid), ("calls", calls, call_gid)):
        if table.num_rows and (gid >= 0).any():
            located = _user_location(table, gid, graphs)
            for col in ("source_file", "source_line"):
                columns[(name, col)] = located.column(col)
    g, nodes = graph_tables(graphs)
    return {"graphs": g, "graph_nodes": nodes}, columns
