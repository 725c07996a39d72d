"""The summary of a multi-rank dataset (``Dataset.summary()``, ``python -m tensorscope report``).

Computes nothing itself: it runs the analyses of ``analyses/ranks.py`` on the
dataset's tables and lays their results out as ``Section``s, which the one
text/HTML renderer of ``render/summary.py`` draws (and escapes).
"""
from __future__ import annotations

import html
from typing import Optional

from .._common import fmt_bytes, fmt_ns
from ..analyses import ranks as A
from .section import Section, Summary


def dataset_summary(ds, run: Optional[str] = None, max_rows: int = 20) -> Summary:
    runs = ds.runs
    run_filter = ""
    if run is not None:
        run = ds._pick_run(run)
        run_filter = " WHERE run = " + "'" + run.replace("'", "''") + "'"
    ranks = ds.sql("SELECT * FROM ranks" + run_filter, arrow=True)
    totals = ds.sql(A.OP_TOTALS_SQL.replace("FROM ops", "FROM ops" + run_filter), arrow=True)
    colls = ds.sql("SELECT * FROM collectives" + run_filter, arrow=True)
    sections = []

    ov = Section("dataset", [("directory", ds.root), ("runs", ", ".join(runs) if run is None else run),
                             ("ranks", str(len(set(ranks.column("rank").to_pylist())))),
                             ("traces", str(ranks.num_rows)),
                             ("ops", f"{sum(totals.column('n').to_pylist()):,}"),
                             ("collectives", f"{colls.num_rows:,}")])
    synced = ranks.column("clock_synced").to_pylist()
    if ranks.num_rows and not all(synced):
        ov.notes.append("clocks not synced on every rank (trace with sync_clocks=True): cross-rank times use "
                        "each host's wall clock and may be off by its NTP error")
    sections.append(ov)

    rt = A.rank_times(ranks, totals, colls).to_pylist()
    sec = Section("per rank (per trace: mean wall time, compute = CPU time of ops, communication = collective "
                  "call to completion)", header=("run", "rank", "traces", "wall", "compute", "communication",
                                                  "comm share", "collectives"))
    for r in rt:
        tot = (r["compute_ns"] or 0) + (r["comm_ns"] or 0)
        share = f"{100 * (r['comm_ns'] or 0) / tot:.0f}%" if tot else "-"
        sec.rows.append((r["run"], r["rank"], r["traces"], fmt_ns(r["wall_ns"]), fmt_ns(r["compute_ns"]),
                         fmt_ns(r["comm_ns"]), share, f"{r['n_collectives']} ({r['n_done']} with completion)"))
    sections.append(sec)

    sk = A.collective_skew(colls, ranks).to_pylist()
    if sk:
        sec = Section("collectives: arrival skew and straggler (the last rank to arrive)",
                      header=("run", "group", "#", "op", "bytes", "ranks", "skew", "straggler", "first"))
        worst = sorted(sk, key=lambda r: -(r["skew_ns"] or 0))[:max_rows]
        for r in worst:
            sec.rows.append((r["run"], r["pg_name"], r["coll_index"], r["op"], fmt_bytes(r["nbytes"]), r["n_ranks"],
                             fmt_ns(r["skew_ns"]), r["straggler_rank"], r["first_rank"]))
        counts: dict = {}
        for r in sk:
            if r["n_ranks"] > 1:
                counts[r["straggler_rank"]] = counts.get(r["straggler_rank"], 0) + 1
        if counts:
            sec.notes.append("straggler counts: " + ", ".join(f"rank {k}: {v}" for k, v in sorted(counts.items())))
        if len(sk) > max_rows:
            sec.notes.append(f"{len(sk) - max_rows} more collectives with smaller skew")
        if any(r["n_ops_seen"] > 1 for r in sk):
            sec.notes.append("some coll_index values matched different ops across ranks: the ranks' collective "
                             "sequences diverge (or their traces did not start at the same point)")
        sections.append(sec)

    diff = A.op_differences(totals).to_pylist()
    if diff:
        sec = Section("ops that differ between ranks", header=("run", "op", "min calls", "on rank", "max calls",
                                                              "on rank"))
        for r in diff[:max_rows]:
            sec.rows.append((r["run"], r["op"], r["min_calls"], r["rank_min"], r["max_calls"], r["rank_max"]))
        if len(diff) > max_rows:
            sec.notes.append(f"{len(diff) - max_rows} more ops differ")
        sections.append(sec)
    return Summary(sections)


def html_document(title: str, body_html: str) -> str:
    """A self-contained HTML page (no script, no network) around ``body_html``."""
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>" + html.escape(title) +
            "</title></head><body style=\"font-family:system-ui,sans-serif\"><h2>" + html.escape(title) + "</h2>" +
            body_html + "</body></html>")
