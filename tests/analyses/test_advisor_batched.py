"""The advisor a record batch at a time: every result equals the one read in a single batch, whatever the
batch size, including runs of rows, gaps and first-run stretches that cross a batch boundary, starts out of
order, and several windows; and the batched pieces (outside_ops, Runs) against plain whole-table oracles."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

import tensorscope
from tensorscope import schema as S
from tensorscope.analyses.advisor import advise_tables
from tensorscope.analyses.findings import Runs, expand_runs, finding_rows
from tensorscope.analyses.idle import gpu_idle, outside_ops
from tensorscope.analyses.syncs import sync_table
from tests.helpers.synthetic import make_trace, table

ENGINES = ("native", "python")
SIZES = (1, 2, 3, 7, 64)


def _wins(traces):
    return [{"ops": t.ops, "calls": t.calls, "kernels": t.kernels, "layout_changes": t.layout_changes,
             "wall_ns": t.metadata.get("wall_ns"), "engine": t.metadata.get("engine"),
             "run_delay_ns": t.metadata.get("run_delay_ns"), "steps": None} for t in traces]


def _same(a, b):
    assert a["findings"].equals(b["findings"]), (a["findings"].to_pylist(), b["findings"].to_pylist())
    assert a["syncs"].equals(b["syncs"])
    assert a["roofline"].equals(b["roofline"])
    assert a["outside"] == b["outside"] and a["gpu_idle"] == b["gpu_idle"]
    for k in ("steps", "op_ns", "first_run_ns", "cold"):
        assert a[k] == b[k], k


def _loop(n, shapes=False):
    """A small training loop with a scalar read, a data-dependent shape, in-place zeroing and tiny ops;
    ``shapes``: a new shape every step (each step's ops are first executions: a cold trace)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    grads = [torch.zeros(3), torch.zeros(5)]

    def run():
        for i in range(n):
            x = torch.randn(7 + (i if shapes else 0), 16)
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            loss.item()
            torch.nonzero(x > 0)
            for g in grads:
                g.zero_()
    return run


@pytest.mark.parametrize("engine", ENGINES)
def test_advice_read_in_small_batches_equals_one_batch(engine):
    """Warm rows after a first step of first executions (a first_run stretch that small batches split),
    syncs, zeroing, tiny ops (the overhead finding's runs cross every boundary) and the largest gaps."""
    run = _loop(12)
    with tensorscope.trace(engine=engine, leaks=False):
        run()                                   # warm: the traced run below is mostly warm rows
    k = 13 + ENGINES.index(engine)
    with tensorscope.trace(engine=engine, leaks=False) as t:
        run()
        torch.randn(k, 29).mul(torch.randn(k, 29)).sum()   # shapes new to this process: first_run rows
        run()
    assert any(t.ops.column("first_run").to_pylist()) and not all(t.ops.column("first_run").to_pylist())
    whole = advise_tables(_wins([t]), {}, min_share=0.0)
    kinds = set(whole["findings"].column("kind").to_pylist())
    assert {"sync", "overhead"} <= kinds, kinds
    for n in SIZES:
        _same(advise_tables(_wins([t]), {}, min_share=0.0, batch_rows=n), whole)
    # several windows: a run never crosses from one window into the next
    two = advise_tables(_wins([t, t]), {}, min_share=0.0)
    _same(advise_tables(_wins([t, t]), {}, min_share=0.0, batch_rows=5), two)
    over = [f for f in two["findings"].to_pylist() if f["kind"] == "overhead"][0]
    one = [f for f in whole["findings"].to_pylist() if f["kind"] == "overhead"][0]
    assert over["n_rows"] == 2 * one["n_rows"] and len(over["row_starts"]) == 2 * len(one["row_starts"])
    assert finding_rows(over).tolist() == 2 * finding_rows(one).tolist()


def test_a_cold_trace_read_in_small_batches_names_the_same_first_runs():
    """Stretches of first executions (1 ms each) between warm rows and bookkeeping rows: small batches split
    them, the first_run finding names the same runs."""
    rows = [{"seq": i, "op": "aten.mm.default" if i % 4 else "aten.add.Tensor", "start_ns": 2_000_000 * i,
             "cpu_ns": 1_000_000 if (i // 5) % 2 == 0 else 1_000, "first_run": (i // 5) % 2 == 0,
             "is_noise": i % 7 == 3, "bytes_read": 64, "bytes_written": 64, "flops": 16} for i in range(40)]
    t = make_trace({"wall_ns": 100_000_000}, ops=table("ops", rows))
    whole = advise_tables(_wins([t]), {}, min_share=0.0)
    assert whole["cold"]
    (cold,) = [f for f in whole["findings"].to_pylist() if f["kind"] == "first_run"]
    want = [r["seq"] for r in rows if r["first_run"] and not r["is_noise"]]
    assert finding_rows(cold).tolist() == want and len(cold["row_starts"]) > 3
    for n in SIZES:
        _same(advise_tables(_wins([t]), {}, min_share=0.0, batch_rows=n), whole)


def test_sync_table_in_batches_equals_one_batch():
    with tensorscope.trace(leaks=False) as t:
        _loop(3)()
    whole = sync_table(t.ops, t.calls)
    assert whole.num_rows >= 6
    for n in SIZES:
        assert sync_table(t.ops, t.calls, rows=n).equals(whole)


def test_call_names_and_steps_read_the_calls_in_batches():
    from tensorscope.analyses.syncs import call_names, infer_steps

    with tensorscope.trace(leaks=False) as t:
        _loop(4)()
    ids = t.ops.column("call_id").to_pylist() + [None, 10**9]
    whole = call_names(t.calls, ids)
    assert "Tensor.item" in whole and whole[-2:] == [None, None]
    assert infer_steps(t.calls) == 4
    for n in (1, 3, 64):
        assert call_names(t.calls, ids, rows=n) == whole
        assert infer_steps(t.calls, rows=n) == 4


# -- time outside ops: one pass in start order, against the whole-table reading -------------------------

def _oracle(rows, tracer_ns=0, ratio=0.0, own_op_ns=0):
    """The plain reading: every row sorted by start (ties in row order), gaps against the running end."""
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["start_ns"], i))
    run_end, gaps, outside = None, [], 0
    for k, i in enumerate(order):
        r = rows[i]
        g = 0 if run_end is None else max(r["start_ns"] - run_end, 0)
        if k:   # the tracer's time after the row before: timed per row, else the engine's mean
            p = rows[order[k - 1]].get("probe_ns")
            own = own_op_ns if p is None else p
        else:
            own = 0
        g = max(g - own - max(tracer_ns, int(ratio * own)), 0)
        outside += g
        gaps.append((g, k))
        e = r["start_ns"] + r["cpu_ns"]
        run_end = e if run_end is None else max(run_end, e)
    real = [k for k, i in enumerate(order) if not rows[i]["is_noise"]]
    named = []
    for g, k in sorted(gaps, key=lambda x: (-x[0], x[1]))[:3]:
        after = [j for j in real if j >= k]
        before = [j for j in real if j < k]
        if g > 0 and after:
            named.append((g, rows[order[before[-1]]]["seq"] if before else None, rows[order[after[0]]]["seq"]))
    span = run_end - rows[order[0]]["start_ns"]
    return span, outside, named


def _ops(rows):
    return table("ops", [dict(r, op="aten.add.Tensor") for r in rows])


def test_outside_ops_in_batches_crosses_boundaries_and_out_of_order_starts():
    rows = [
        {"seq": 0, "start_ns": 0, "cpu_ns": 10, "is_noise": False, "probe_ns": 0},
        {"seq": 1, "start_ns": 12, "cpu_ns": 5, "is_noise": False, "probe_ns": 1},
        # an outer op recorded after the two ops inside it: starts out of order
        {"seq": 2, "start_ns": 20, "cpu_ns": 3, "is_noise": False, "probe_ns": 0},
        {"seq": 3, "start_ns": 24, "cpu_ns": 2, "is_noise": False, "probe_ns": 0},
        {"seq": 4, "start_ns": 19, "cpu_ns": 10, "is_noise": False, "probe_ns": 0},
        # the largest gap: before bookkeeping rows, named by the real op after them (a later batch)
        {"seq": 5, "start_ns": 500, "cpu_ns": 1, "is_noise": True, "probe_ns": 0},
        {"seq": 6, "start_ns": 501, "cpu_ns": 1, "is_noise": True, "probe_ns": 0},
        {"seq": 7, "start_ns": 502, "cpu_ns": 4, "is_noise": False, "probe_ns": 2},
        {"seq": 8, "start_ns": 600, "cpu_ns": 50, "is_noise": False, "probe_ns": 0},
        {"seq": 9, "start_ns": 610, "cpu_ns": 5, "is_noise": False, "probe_ns": 0},     # inside seq 8
        {"seq": 10, "start_ns": 700, "cpu_ns": 5, "is_noise": False, "probe_ns": 0},
        {"seq": 11, "start_ns": 900, "cpu_ns": 5, "is_noise": True, "probe_ns": 0},     # bookkeeping at the end
    ]
    ops = _ops(rows)
    span, outside, named = _oracle(rows)
    assert named[0] == (500 - 29, 3, 7)   # after the outer op ends (29; seq 3 started last), before the next real op
    for n in range(1, len(rows) + 2):
        got = outside_ops(ops, S.empty("calls"), 1000, rows=n)
        assert (got["span_ns"], got["outside_ns"], got["gaps"]) == (span, outside, named), n
    # the tracer's own allowance comes off each gap, in every batch
    got = outside_ops(ops, S.empty("calls"), 1000, tracer_ns=7, rows=2)
    assert (got["span_ns"], got["outside_ns"], got["gaps"]) == _oracle(rows, 7)
    # and in proportion to its timed work where that is more: per row, or the engine's mean where no row has it
    got = outside_ops(ops, S.empty("calls"), 1000, tracer_ns=1, rows=3, untimed_ratio=4.0)
    assert (got["span_ns"], got["outside_ns"], got["gaps"]) == _oracle(rows, 1, 4.0)
    untimed = [{k: v for k, v in r.items() if k != "probe_ns"} for r in rows]
    got = outside_ops(_ops(untimed), S.empty("calls"), 1000, tracer_ns=1, rows=3, own_op_ns=2, untimed_ratio=4.0)
    assert (got["span_ns"], got["outside_ns"], got["gaps"]) == _oracle(untimed, 1, 4.0, own_op_ns=2)
    assert got["outside_ns"] < _oracle(untimed)[1]


def test_outside_ops_in_batches_matches_the_oracle_on_shuffled_starts():
    rng = np.random.default_rng(1)
    for trial in range(30):
        n = int(rng.integers(2, 60))
        start = np.cumsum(rng.integers(0, 40, n))
        if trial % 3:                      # some rows out of order, some far out
            i = rng.choice(n, size=max(1, n // 5), replace=False)
            start[i] = rng.integers(0, int(start[-1]) + 1, len(i))
        rows = [{"seq": k, "start_ns": int(start[k]), "cpu_ns": int(rng.integers(0, 30)),
                 "is_noise": bool(rng.random() < 0.3), "probe_ns": int(rng.integers(0, 3))} for k in range(n)]
        rows[0]["start_ns"] = int(start.max()) + 5 if trial % 4 == 0 else rows[0]["start_ns"]   # a late first row
        ops = _ops(rows)
        want = _oracle(rows, 2, 1.5)
        for size in (1, 2, 5, 16, None):
            got = outside_ops(ops, S.empty("calls"), 10**6, tracer_ns=2, rows=size, untimed_ratio=1.5)
            assert (got["span_ns"], got["outside_ns"], got["gaps"]) == want, (trial, size)


def test_gpu_idle_reads_the_launching_ops_in_batches():
    ops = table("ops", [{"seq": i, "op": "aten.mm.default", "start_ns": 100 * i + 50 * (i == 3), "cpu_ns": 10,
                         "is_noise": False} for i in range(8)])
    kernels = table("kernels", [{"seq": i, "name": f"k{i}", "device": 0, "stream": 7, "start_ns": 100 * i + 60,
                                 "dur_ns": 20} for i in (1, 3, 6)])
    whole = gpu_idle(ops, kernels)
    assert whole[0]["host_wait_ns"] > 0
    for n in (1, 3, 5):
        assert gpu_idle(ops, kernels, rows=n) == whole


# -- runs of rows -------------------------------------------------------------------------------------

def test_runs_built_a_slice_at_a_time_equal_the_whole_sequence():
    rng = np.random.default_rng(2)
    for _ in range(50):
        n = int(rng.integers(0, 80))
        w = np.sort(rng.integers(0, 3, n))
        s = np.cumsum(rng.choice([1, 1, 1, 2, -5, 0], n)) + 100
        whole = Runs.of((w, s))
        assert [x.tolist() for x in whole.pairs()] == [w.tolist(), s.tolist()]
        assert len(whole) == n
        cut = Runs()
        edges = [0, *sorted(rng.integers(0, n + 1, 4).tolist()), n]
        for a, b in zip(edges[:-1], edges[1:]):
            for wi in np.unique(w[a:b]).tolist():      # slices in order, each window's part of it
                cut.add(wi, s[a:b][w[a:b] == wi])
        assert all((x == y).all() for x, y in zip(cut.arrays(), whole.arrays())), (w, s)
        k = int(rng.integers(0, 8))
        assert [x.tolist() for x in whole.head(k)] == [w[:k].tolist(), s[:k].tolist()]
        other = Runs.of((np.sort(rng.integers(0, 3, 5)), rng.integers(90, 200, 5)))
        ow, os_ = other.pairs()
        share = bool({*zip(w.tolist(), s.tolist())} & {*zip(ow.tolist(), os_.tolist())})
        assert whole.overlaps(other) == share == other.overlaps(whole)


def test_a_long_run_is_a_few_numbers_and_expands_exactly():
    r = Runs()
    for off in range(0, 1_000_000, 65_536):                    # slices of a trace of small ops
        r.add(0, np.arange(off, min(off + 65_536, 1_000_000)))
    w, f, c = r.arrays()
    assert (w.tolist(), f.tolist(), c.tolist()) == ([0], [0], [1_000_000])
    assert expand_runs([5, 100], [3, 2]).tolist() == [5, 6, 7, 100, 101]
    assert expand_runs([], []).tolist() == []


def test_the_advice_table_names_rows_as_runs_with_the_same_evidence():
    rows = [{"seq": i, "op": "aten.add.Tensor", "start_ns": 1000 * i, "cpu_ns": 900, "is_noise": i == 150,
             "bytes_read": 64, "bytes_written": 64, "flops": 16} for i in range(300)]
    t = make_trace({"wall_ns": 400_000}, ops=table("ops", rows))
    adv = tensorscope.advise(t, peaks={}, min_share=0.0)
    (i,) = [k for k, kind in enumerate(adv.findings.column("kind").to_pylist()) if kind == "overhead"]
    f = adv.findings.to_pylist()[i]
    assert f["row_starts"] == [0, 151] and f["row_counts"] == [150, 149] and f["n_rows"] == 299
    assert adv.rows(i).tolist() == [s for s in range(300) if s != 150]
    assert f["evidence"].startswith("ops seq 0, 1, 2, 3, 4, 5 … (299 rows)")
    assert adv.findings.schema.equals(S.ADVICE) and pa.types.is_list(adv.findings.schema.field("row_starts").type)


def test_row_by_row_findings_read_in_small_batches_equal_one_batch():
    """Layout mixes and copies, layout_changes groups (some rows the mix already names), zeroing and
    host-to-device copies, on hand-built rows (the cuda device names are strings in the table: no CUDA runs),
    their runs split by every batch size."""
    cl4 = {"in_ambiguous": [False, False], "in_shapes": [[2, 3, 8, 8], [4, 3, 3, 3]]}
    rows = []
    for i in range(60):
        r = {"seq": i, "start_ns": 1000 * i, "cpu_ns": 100 + i, "is_noise": False, "source_file": "m.py",
             "source_line": 10 + i % 3, "in_ambiguous": None, "in_shapes": None, "in_formats": None,
             "out_formats": None, "in_storages": None, "in_devices": None, "out_devices": None}
        k = i % 6
        if k in (0, 1):      # forward convolutions: channels_last data, contiguous weight
            r.update(cl4, op="aten.convolution.default", in_formats=["channels_last", "contiguous"])
        elif k == 2:         # copies converting channels_last back to contiguous
            r.update(cl4, op="aten.copy_.default", in_formats=["contiguous", "channels_last"],
                     out_formats=["contiguous"])
        elif k == 3:         # zeroing distinct tensors outside modules
            r.update(op="aten.zero_.default", in_storages=[i])
        elif k == 4:         # host-to-device copies
            r.update(op="aten._to_copy.default", in_devices=["cpu"], out_devices=["cuda:0"])
        else:
            r.update(op="aten.add.Tensor")
        rows.append(r)
    lc = table("layout_changes", [
        {"seq": s, "op": "aten.clone.default" if s % 2 else "aten.copy_.default", "kind": "hidden_copy",
         "reason": "a copy", "bytes": 64 * s, "source_file": "m.py", "source_line": 10 + s % 2, "call": "reshape",
         "from_format": "channels_last"} for s in (2, 5, 7, 8, 11, 13, 14, 17, 29, 31, 41, 44)])
    t = make_trace({"wall_ns": 100_000}, ops=table("ops", rows), layout_changes=lc)
    whole = advise_tables(_wins([t]), {}, min_share=0.0)
    subjects = [f["subject"] for f in whole["findings"].to_pylist()]
    for want in ("mixed memory formats around convolutions", "host-to-device copies", "zeroing at m.py:10",
                 "aten.clone.default (hidden copy)"):
        assert any(s.startswith(want) for s in subjects), (want, subjects)
    (mix,) = [f for f in whole["findings"].to_pylist() if f["subject"].startswith("mixed memory")]
    assert finding_rows(mix).tolist() == [s for s in range(60) if s % 6 in (0, 1)] + list(range(2, 60, 6))
    (clone,) = [f for f in whole["findings"].to_pylist() if f["subject"] == "aten.clone.default (hidden copy)"]
    assert finding_rows(clone).tolist() == [5, 11, 17, 29, 41]   # the ones the mix does not name (7, 13, 31)
    for n in SIZES:
        _same(advise_tables(_wins([t]), {}, min_share=0.0, batch_rows=n), whole)


@pytest.mark.parametrize("engine", ENGINES)
def test_layout_changes_found_in_small_batches_equal_one_batch(engine):
    """Format changes, hidden copies (whose next row names the target shape: a pair a boundary may split) and
    non-dense inputs, with their call names, whatever the slice size."""
    from tensorscope.analyses.layout import layout_changes

    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(3, 4, 3)

    def run():
        for _ in range(3):
            y = conv(x)
            y.flatten(1).sum()                    # a hidden copy of a channels_last activation
            y.contiguous()                        # a hidden copy that changes the format
            torch.ones(2, 3, 4, 4).to(memory_format=torch.channels_last)   # a format change
            torch.randn(4, 6).t().mm(torch.randn(4, 5))   # a non-dense (transposed) input
            x.permute(0, 2, 3, 1).reshape(2, -1)  # a copy the reshape makes

    with tensorscope.trace(engine=engine, leaks=False) as t:
        run()
    whole = layout_changes(t.ops, t.calls)
    assert {"hidden_copy", "format_change"} <= set(whole.column("kind").to_pylist()), whole.to_pylist()
    assert any(whole.column("call").to_pylist())
    for n in (1, 2, 3, 7, 64):
        assert layout_changes(t.ops, t.calls, rows=n).equals(whole), n
