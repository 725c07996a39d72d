"""The native libraries' file lists (native/_build.py): every file a library's sources include is
listed, so it is hashed into the build key, and a change to any of them, a header included, is a
new build. Reads files only; compiles nothing."""
from __future__ import annotations

import os
import re
import shutil

import pytest

from tensorscope.native import _build

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
_LIBS = (_build.HOOKS, _build.ENGINE, _build.FMODE)


def _includes(path: str):
    with open(path, encoding="utf-8") as f:
        return _INCLUDE.findall(f.read())


@pytest.mark.parametrize("spec", _LIBS, ids=lambda s: s.kind)
def test_a_library_lists_every_file_its_sources_include(spec):
    listed = set(spec.files)
    seen, todo = set(), list(spec.sources)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        assert os.path.exists(_build.file_path(name)), name
        todo.extend(_includes(_build.file_path(name)))
    assert seen == listed, f"{spec.kind}: included but not listed {sorted(seen - listed)}, " \
                           f"listed but not included {sorted(listed - seen)}"


def test_every_native_file_belongs_to_a_library():
    here = os.path.dirname(_build.file_path("abi.h"))
    on_disk = {f for f in os.listdir(here) if f.endswith((".cpp", ".h"))}
    assert on_disk == set().union(*(s.files for s in _LIBS))
    sources = [s for spec in _LIBS for s in spec.sources]
    assert len(sources) == len(set(sources)), "a translation unit in two libraries"


@pytest.mark.parametrize("spec", _LIBS, ids=lambda s: s.kind)
def test_the_build_key_hashes_every_file(spec, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    here = os.path.dirname(_build.file_path("abi.h"))
    for name in spec.files:
        shutil.copy(os.path.join(here, name), tmp_path / name)
    monkeypatch.setattr(_build, "_HERE", str(tmp_path))
    key = _build.build_key(spec)
    for name in spec.files:
        with open(tmp_path / name, "a") as f:
            f.write("\n// changed\n")
        new = _build.build_key(spec)
        assert new != key, f"{spec.kind}: a change to {name} keeps the build key"
        key = new
