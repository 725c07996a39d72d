"""The example notebooks run top to bottom in a real kernel (nbclient), and the demo works."""
from __future__ import annotations

import os
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


@pytest.mark.kernel
@pytest.mark.parametrize("name", sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".ipynb")))
def test_notebook_executes(name, tmp_path):
    nb = nbformat.read(os.path.join(EXAMPLES, name), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    if name == "quickstart.ipynb":
        assert os.path.isfile(tmp_path / "runs" / "quickstart" / "ops.parquet")
        html = "".join(o.get("data", {}).get("text/html", "") for c in nb.cells if c.cell_type == "code"
                       for o in c.get("outputs", []))
        assert "tensorscope trace" in html


@pytest.mark.kernel
def test_run_demo_prints_summary(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(EXAMPLES, "run_demo.py"), "--cwd", str(tmp_path)],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "tensorscope trace of cell" in p.stdout and "top ops" in p.stdout
    assert os.path.isfile(tmp_path / "runs" / "quickstart" / "metadata.json")
