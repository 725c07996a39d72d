"""Two ranks on gloo, CPU, loopback only: real processes (mp.spawn, multiprocessing, torchrun).

Each run is bounded by a timeout. One spawn run feeds most checks (module fixture).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

import tensorscope
from tests.helpers import ROOT
from tests.helpers.datasets import check_layout

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "dist", "workers.py")
TRAIN = os.path.join(HERE, "dist", "train.py")

pytestmark = pytest.mark.skipif(not __import__("torch").distributed.is_available(), reason="torch.distributed missing")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("TENSORSCOPE_RUN_ID", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def _run(args, timeout=300):
    r = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return r


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("spawn") / "ds")
    r = _run([sys.executable, WORKERS, "spawn", root, str(_port())])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return tensorscope.open_dataset(root)


def test_layout_and_identical_schema_across_ranks(spawned):
    check_layout(spawned.root)
    r = spawned.ranks
    assert sorted(r["rank"]) == [0, 1] and set(r["world_size"]) == {2}
    assert set(r["rank_source"]) == {"dist"}   # decided while the group lived, written after destroy
    assert len(spawned.runs) == 1 and set(r["run_source"]) == {"store"}
    assert set(r["backend"]) == {"gloo"}


def test_collectives_match_across_ranks(spawned):
    c = spawned.sql("SELECT * FROM collectives ORDER BY rank, coll_index")
    assert len(c) > 0
    per_rank = {rk: g.reset_index(drop=True) for rk, g in c.groupby("rank")}
    assert set(per_rank) == {0, 1}
    a, b = per_rank[0], per_rank[1]
    assert list(a["coll_index"]) == list(b["coll_index"]) == list(range(len(a)))
    assert list(a["op"]) == list(b["op"])
    ops = set(a["op"])
    for want in ("c10d.allreduce_.default", "c10d.broadcast_.default", "c10d.allgather_.default",
                 "c10d.barrier.default", "_c10d_functional.all_reduce.default"):
        assert want in ops, (want, ops)
    assert any("reduce_scatter" in o for o in ops)
    assert set(a["pg_size"]) == {2} and set(a["pg_name"]) == {"0"}
    # DDP: the bucketed gradient all-reduce (after the forward's broadcasts), a SUM of the grads' bytes
    grad_bytes = (8 * 4 + 4) * 4
    ddp = a[(a["op"] == "c10d.allreduce_.default") & (a["nbytes"] == grad_bytes)]
    assert len(ddp) == 1 and ddp["reduce_op"].iloc[0] == "SUM"
    # completion from the Work future for c10d ops; unknown (null) for functional collectives
    ar = a[a["op"] == "c10d.allreduce_.default"]
    assert ar["done_ns"].notna().all() and (ar["done_ns"] >= ar["start_ns"]).all()
    assert a[a["op"].str.startswith("_c10d_functional")]["done_ns"].isna().all()
    # every collective's seq is its op row
    j = spawned.sql("SELECT c.op AS c_op, o.op AS o_op FROM collectives c JOIN ops o "
                    "USING (run, rank, attempt, trace_id, seq)")
    assert len(j) == len(c) and (j["c_op"] == j["o_op"]).all()


def test_clock_offsets_within_their_bound(spawned):
    r = spawned.ranks.set_index("rank")
    assert r["clock_synced"].all()
    assert r.loc[0, "clock_offset_ns"] == 0
    # one host, one clock: the true offset is 0, so the measured one lies within its bound
    assert abs(int(r.loc[1, "clock_offset_ns"])) <= int(r.loc[1, "clock_error_ns"])
    assert 0 < int(r.loc[1, "clock_error_ns"]) < 1_000_000_000


def test_rank_whose_work_differs_and_summary(spawned):
    s = spawned.summary()
    text = s.to_text()
    assert "aten.exp.default" in text and "straggler" in text
    diff = spawned.sql("SELECT rank, count(*) n FROM ops WHERE op = 'aten.exp.default' GROUP BY rank")
    assert dict(zip(diff["rank"], diff["n"])) == {1: 1}


def test_trace_of_one_rank_and_perfetto(spawned, tmp_path):
    t = spawned.trace(rank=1)
    assert t.collectives.num_rows == spawned.sql("SELECT count(*) n FROM collectives WHERE rank = 1")["n"][0]
    assert "aten.exp.default" in t.ops.column("op").to_pylist()
    import json

    p = spawned.to_perfetto(tmp_path / "all.json")
    doc = json.load(open(p))
    from tensorscope.render.perfetto import validate_trace_events

    assert validate_trace_events(doc) == []
    names = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    assert {"rank 0", "rank 1"} <= names
    assert any(e.get("cat") == "collective" for e in doc["traceEvents"])


def test_killed_rank_leaves_the_other_readable(tmp_path):
    root = str(tmp_path / "ds")
    r = _run([sys.executable, WORKERS, "kill", root, str(_port())])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_layout(root)
    ds = tensorscope.open_dataset(root)
    assert list(ds.ranks["rank"]) == [0]
    assert ds.sql("SELECT count(*) n FROM ops WHERE rank = 0")["n"][0] > 0
    assert ds.trace(rank=0).ops.num_rows > 0


def test_torchrun_ddp_every_rank_writes_its_part(tmp_path):
    root = str(tmp_path / "ds")
    r = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "-m", "tensorscope", "run", "--out", root, "--no-leaks", TRAIN, "--some-arg"], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_layout(root)
    ds = tensorscope.open_dataset(root)
    assert len(ds.runs) == 1
    r = ds.ranks
    assert sorted(r["rank"]) == [0, 1] and set(r["run_source"]) == {"torchelastic"}
    assert set(r["rank_source"]) == {"dist"} and set(r["attempt"]) == {0}
    # DDP's gradient all-reduce on both ranks, matched by coll_index
    n = ds.sql("SELECT coll_index, count(*) n, count(DISTINCT op) k FROM collectives "
               "WHERE op = 'c10d.allreduce_.default' GROUP BY ALL")
    assert len(n) >= 1 and set(n["n"]) == {2} and set(n["k"]) == {1}


def test_elastic_restart_writes_a_new_attempt(tmp_path):
    """Two attempts of one run, with the environment torchelastic gives workers (its own restart of a
    gloo group on loopback fails to reconnect in torch 2.13 even without tensorscope)."""
    root = str(tmp_path / "ds")
    for attempt in (0, 1):
        port = _port()
        procs = []
        for rank in (0, 1):
            env = _env()
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_PORT=str(port),
                       TORCHELASTIC_RUN_ID="job-42", TORCHELASTIC_RESTART_COUNT=str(attempt))
            log = open(tmp_path / f"a{attempt}-r{rank}.log", "w+")   # a file, not a pipe nobody drains
            procs.append((subprocess.Popen([sys.executable, "-m", "tensorscope", "run", "--out", root, "--no-leaks",
                                            TRAIN], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log))
        try:
            for p, _ in procs:
                p.wait(timeout=300)
        finally:
            for p, _ in procs:   # a rank left waiting for a failed peer must not outlive the test
                if p.poll() is None:
                    p.kill()
        for p, log in procs:
            log.seek(0)
            assert p.returncode == 0, log.read()[-3000:]
            log.close()
    check_layout(root)
    ds = tensorscope.open_dataset(root)
    assert ds.runs == ["job-42"]
    got = ds.sql("SELECT rank, attempt FROM ranks ORDER BY ALL")
    assert [tuple(x) for x in got.values] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    files = sorted(os.listdir(os.path.join(root, "ops", "run=job-42", "rank=1")))
    assert files == ["part-a0-00000.parquet", "part-a1-00000.parquet"]
    assert ds.trace(rank=1).metadata["dataset"]["attempt"] == 1   # the latest attempt by default
    assert ds.trace(rank=1, attempt=0).ops.num_rows > 0
