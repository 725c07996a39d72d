"""The wheel, built for real from this tree: what it ships, and the one version string."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

import tensorscope
from tests.helpers import ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    # a copy of what a source distribution holds, so the build writes nothing into the checkout
    src = tmp_path_factory.mktemp("src")
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, f), src / f)
    shutil.copytree(os.path.join(ROOT, "tensorscope"), src / "tensorscope",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "No module named pip" in r.stderr:
        pytest.skip("pip is not installed in this interpreter")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (whl,) = out.glob("tensorscope-*.whl")
    return zipfile.ZipFile(whl)


def test_the_wheel_ships_the_native_sources_and_py_typed_but_not_the_test_ops(wheel):
    names = set(wheel.namelist())
    assert "tensorscope/py.typed" in names
    assert {"tensorscope/native/hooks.cpp", "tensorscope/native/engine.cpp"} <= names
    assert not [n for n in names if "test_ops" in n or n.startswith("tests/")], sorted(names)


def test_the_version_is_written_once(wheel):
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    version = [ln.split(":", 1)[1].strip() for ln in wheel.read(meta).decode().splitlines()
               if ln.startswith("Version:")]
    assert version == [tensorscope.__version__]
    tomllib = pytest.importorskip("tomllib")   # Python >= 3.11
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    # pyproject reads it from the package rather than writing it a second time
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "tensorscope.__version__"}
