"""Other engines read the dataset unchanged: Spark (local mode), polars, pyarrow.dataset; totals agree with DuckDB."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import tensorscope


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines") / "ds"
    for rank in (0, 1):   # two ranks' worth of parts, as torchrun would write them
        os.environ.update(TENSORSCOPE_RUN_ID="run1", RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
        try:
            with tensorscope.trace(dataset=str(root), leaks=False):
                x = torch.randn(4, 8)
                for _ in range(rank + 2):
                    x = torch.nn.functional.linear(x, torch.randn(8, 8)).relu()
        finally:
            for k in ("TENSORSCOPE_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
                os.environ.pop(k, None)
    return tensorscope.open_dataset(root)


def _duck_totals(ds):
    df = ds.sql("SELECT rank, op, count(*)::BIGINT n, sum(cpu_ns)::BIGINT cpu FROM ops GROUP BY ALL")
    return {(int(r.rank), r.op): (int(r.n), int(r.cpu)) for r in df.itertuples()}


def _duck_shapes(ds):
    df = ds.sql("SELECT rank, len(s) AS d, count(*)::BIGINT n FROM (SELECT rank, unnest(in_shapes) s FROM ops) "
                "GROUP BY ALL")
    return {(int(r.rank), int(r.d)): int(r.n) for r in df.itertuples()}


def test_pyarrow_dataset_reads_it(dataset):
    import pyarrow.dataset as pads

    d = pads.dataset(os.path.join(dataset.root, "ops"), format="parquet", partitioning="hive")
    t = d.to_table()
    assert t.num_rows == int(dataset.sql("SELECT count(*) n FROM ops")["n"][0])
    assert set(t.column("rank").to_pylist()) == {0, 1}


def test_polars_reads_it(dataset):
    pl = pytest.importorskip("polars", reason="polars is in the test extra")
    df = pl.scan_parquet(os.path.join(dataset.root, "ops", "**", "*.parquet"), hive_partitioning=True).collect()
    got = df.group_by(["rank", "op"]).agg(pl.len().alias("n"), pl.col("cpu_ns").sum().alias("cpu"))
    totals = {(int(r["rank"]), r["op"]): (int(r["n"]), int(r["cpu"])) for r in got.iter_rows(named=True)}
    assert totals == _duck_totals(dataset)


def _java() -> bool:
    if shutil.which("java") is None:
        return False
    return subprocess.run(["java", "-version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _java(), reason="Spark needs Java: apt-get install default-jre-headless (.ci/run does as root)")
def test_spark_reads_it_and_agrees_with_duckdb(dataset):
    pytest.importorskip("pyspark", reason="pyspark is in the test extra")
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")   # loopback only
    spark = (SparkSession.builder.master("local[1]").appName("tensorscope-test")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .getOrCreate())
    try:
        ops = spark.read.option("mergeSchema", "true").parquet(os.path.join(dataset.root, "ops"))
        rows = ops.groupBy("rank", "op").agg(F.count("*").alias("n"), F.sum("cpu_ns").alias("cpu")).collect()
        assert {(int(r["rank"]), r["op"]): (int(r["n"]), int(r["cpu"])) for r in rows} == _duck_totals(dataset)
        shapes = (ops.select("rank", F.explode("in_shapes").alias("s")).groupBy("rank", F.size("s").alias("d"))
                  .count().collect())
        assert {(int(r["rank"]), int(r["d"])): int(r["count"]) for r in shapes} == _duck_shapes(dataset)
        ranks = spark.read.parquet(os.path.join(dataset.root, "ranks")).select("rank", "run").collect()
        assert sorted((int(r["rank"]), r["run"]) for r in ranks) == [(0, "run1"), (1, "run1")]
    finally:
        spark.stop()
