"""``with tensorscope.trace() as t:`` gives a type checker a ``Trace`` (mypy run through its API on
check_trace_types.py, its ``reveal_type`` lines read back)."""
from __future__ import annotations

import os
import re

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _plain(t: str) -> str:
    """One spelling across mypy versions: ``builtins.str`` -> ``str``, ``Union[X, None]`` -> ``X | None``."""
    t = t.replace("builtins.", "")
    m = re.fullmatch(r"Union\[(.+), None\]", t)
    return f"{m.group(1)} | None" if m else t


def _revealed() -> dict[int, str]:
    api = pytest.importorskip("mypy.api")
    path = os.path.join(HERE, "check_trace_types.py")
    out, err, _ = api.run([path, "--no-incremental", "--follow-imports=silent", "--ignore-missing-imports",
                           "--config-file", os.path.join(ROOT, "pyproject.toml")])
    got = {int(m.group(1)): _plain(m.group(2)) for m in re.finditer(r"check_trace_types\.py:(\d+): note: Revealed type is \"(.+)\"", out)}
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert not errors, out + err
    return got


def test_the_trace_block_is_a_trace_to_a_type_checker():
    got = list(_revealed().values())
    table = got[-1]   # pyarrow.Table as this checker sees it
    assert got[:-1] == [
        "tensorscope._trace.Trace",
        table,
        "tensorscope.render.views.TableView",
        "tensorscope.render.views.TableView",
        "str",
        "str | None",
        "tensorscope._trace.Trace",
    ], got
