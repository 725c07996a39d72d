"""Headless CLI: run a script and a notebook, report, install-kernel (real processes and kernels)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import tensorscope
from tests.helpers import ROOT


def _cli(*args, timeout=240, env=None):
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("TENSORSCOPE_RUN_ID", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "tensorscope", *args], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=ROOT)


def test_run_script_passes_args_and_exit_status(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import sys, torch\nprint('argv', sys.argv[1:])\ntorch.ones(3).mul(2)\n"
                      "sys.exit(int(sys.argv[-1]))\n")
    r = _cli("run", "--out", str(tmp_path / "ds"), "--no-leaks", str(script), "--out", "x", "4")
    assert r.returncode == 4, r.stderr
    assert "argv ['--out', 'x', '4']" in r.stdout
    ds = tensorscope.open_dataset(tmp_path / "ds")
    assert "aten.mul.Tensor" in set(ds.df("ops")["op"])


def test_run_script_exception_is_printed_and_trace_written(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("import torch\ntorch.ones(2).add(1)\nraise ValueError('boom')\n")
    r = _cli("run", "--out", str(tmp_path / "ds"), "--no-leaks", str(script))
    assert r.returncode == 1 and "ValueError: boom" in r.stderr and "bad.py" in r.stderr
    ds = tensorscope.open_dataset(tmp_path / "ds")
    assert len(ds.ranks) == 1


def test_run_notebook_one_trace_per_cell_and_report(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import torch\nx = torch.randn(4, 4)"),
                nbformat.v4.new_markdown_cell("text"),
                nbformat.v4.new_code_cell("y = (x @ x).relu()\ny.sum()")]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, str(path))
    out = tmp_path / "ds"
    r = _cli("run", "--out", str(out), "--no-leaks", str(path))
    assert r.returncode == 0, r.stderr
    ds = tensorscope.open_dataset(out)
    ranks = ds.sql("SELECT trace_id, cell, cell_source FROM ranks ORDER BY trace_id")
    assert list(ranks["cell"]) == [1, 2]
    assert ranks["cell_source"][1].startswith("y = (x @ x)")
    ops = ds.sql("SELECT cell, op FROM ops ORDER BY trace_id, seq")
    assert ("aten.mm.default" in set(ops[ops["cell"] == 2]["op"]))
    executed = nbformat.read(str(out / "nb.ipynb"), as_version=4)
    assert executed.cells[2].outputs and "tensor" in executed.cells[2].outputs[0]["data"]["text/plain"]
    # the report: self-contained HTML
    rep = tmp_path / "report.html"
    r = _cli("report", str(out), "-o", str(rep))
    assert r.returncode == 0, r.stderr
    html = rep.read_text()
    assert html.startswith("<!DOCTYPE html>") and "per rank" in html
    assert "<script" not in html and "http://" not in html and "https://" not in html


def test_report_of_a_saved_trace_and_bad_path(tmp_path):
    with tensorscope.trace(leaks=False) as t:
        __import__("torch").ones(2).add(1)
    p = t.save(tmp_path / "one")
    r = _cli("report", p, "-o", str(tmp_path / "r.html"))
    assert r.returncode == 0, r.stderr
    assert "aten.add" in (tmp_path / "r.html").read_text()
    r = _cli("report", str(tmp_path / "nothing"), "-o", str(tmp_path / "x.html"))
    assert r.returncode == 2 and "tensorscope:" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.kernel
def test_install_kernel_loads_the_extension(tmp_path):
    r = _cli("install-kernel", "--name", "ts-test", "--prefix", str(tmp_path))
    assert r.returncode == 0, r.stderr
    kdir = tmp_path / "share" / "jupyter" / "kernels" / "ts-test"
    spec = json.loads((kdir / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    ksm = KernelSpecManager(kernel_dirs=[str(kdir.parent)])
    km = KernelManager(kernel_name="ts-test", kernel_spec_manager=ksm)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    km.start_kernel(env=env)
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        outs = []
        kc.execute_interactive("print('tensorscope' in get_ipython().extension_manager.loaded)",
                               output_hook=lambda m: outs.append(m["content"].get("text", "")), timeout=60)
        assert "True" in "".join(outs)
        kc.stop_channels()
    finally:
        km.shutdown_kernel(now=True)


@pytest.mark.kernel
def test_cell_magic_dataset_flag(tmp_path):
    from tests.helpers.kernel_utils import Kernel

    k = Kernel(cwd=str(tmp_path), env={"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                       "TENSORSCOPE_RUN_ID": "nb1"})
    try:
        assert k.run("%load_ext tensorscope").status == "ok"
        r = k.run(f"%%tensorscope -q --no-leaks --dataset {tmp_path / 'ds'}\nimport torch\ntorch.ones(2).add(1)")
        assert r.status == "ok", r.error
        assert "tensor([2., 2.])" in r.text()   # the cell's value still displays
    finally:
        k.close()
    ds = tensorscope.open_dataset(tmp_path / "ds")
    assert ds.runs == ["nb1"] and list(ds.ranks["cell"]) == [2]
    assert "aten.add.Tensor" in set(ds.df("ops")["op"])


def test_summary_sql_and_export_read_the_dataset_run_wrote(tmp_path):
    """What ``run --out DIR`` wrote answers ``summary DIR`` (its one trace's summary first, then the
    dataset's), ``sql DIR`` and ``export DIR`` (it was "not a tensorscope trace directory")."""
    script = tmp_path / "s.py"
    script.write_text("import torch\nfor _ in range(3):\n    torch.ones(8).relu().sum()\n")
    ds = str(tmp_path / "ds")
    assert _cli("run", "--out", ds, "--no-leaks", str(script)).returncode == 0
    r = _cli("summary", ds)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("tensorscope trace") and "aten.relu.default" in r.stdout
    assert r.stdout.index("== the cell in numbers ==") < r.stdout.index("== dataset ==")
    r = _cli("sql", ds, "select count(*) as n from ops where op = 'aten.relu.default'")
    assert r.returncode == 0 and r.stdout.split()[-1] == "3", r.stderr
    r = _cli("export", ds, "--perfetto", str(tmp_path / "p.json"))
    assert r.returncode == 0 and json.loads((tmp_path / "p.json").read_text())
    # a second run into the same dataset: two traces, the dataset's summary and how to read one
    assert _cli("run", "--out", ds, "--no-leaks", str(script)).returncode == 0
    r = _cli("summary", ds)
    assert r.returncode == 0 and r.stdout.startswith("== dataset ==") and "2 traces; one of them" in r.stdout
