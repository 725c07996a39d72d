"""The docs stay true (every column and option documented) and the CLI works on real files."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import tensorscope
from tensorscope import options as O
from tensorscope import schema as S
from tests.helpers import ROOT

README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def _generator():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tsgen", os.path.join(ROOT, "docs", "_ext", "tsgen.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docs_document_every_column_and_option():
    """The site's tables and options pages are generated from the schema and the option declarations:
    every column of every table and every flag is on them, and the user guide explains each recorded table."""
    gen = _generator()
    tables, options = gen.tables_md(), gen.options_md()
    for name, schema in list(S.TABLES.items()) + [("ranks", S.RANKS)]:
        assert f"### `{name}`" in tables, name
        for field in schema:
            assert f"| `{field.name}` |" in tables, f"{name}.{field.name} is not documented"
    for flags, _ in O.argparse_arguments():
        assert f"`{flags[0]}" in options, flags
    guide = open(os.path.join(ROOT, "docs", "guide", "tables.md"), encoding="utf-8").read()
    for name in S.RECORDED + S.DERIVED:
        assert f"**{name}**" in guide, f"docs/guide/tables.md does not explain the {name} table"
    assert "make demo" in README and "make test" in README
    assert os.path.exists(os.path.join(ROOT, "docs", "guide", "troubleshooting.md"))


def test_import_is_cheap_and_side_effect_free():
    code = ("import sys, tensorscope; "
            "print(json.dumps(['torch' in sys.modules, 'IPython' in sys.modules, 'pyarrow' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [False, False, False]


def test_cli_summary_sql_export(tmp_path):
    with tensorscope.trace() as t:
        torch.randn(4, 4).relu().sum()
    path = t.save(tmp_path / "run")
    def run(*a):
        return subprocess.run([sys.executable, "-m", "tensorscope", *a], capture_output=True, text=True)

    r = run("summary", path)
    assert r.returncode == 0 and "aten.relu.default" in r.stdout
    r = run("sql", path, "select count(*) as n from ops")
    assert r.returncode == 0 and r.stdout.split()[-1] == str(t.ops.num_rows)
    r = run("export", path, "--perfetto", str(tmp_path / "t.json"))
    assert r.returncode == 0 and json.load(open(tmp_path / "t.json"))
    r = run("summary", str(tmp_path / "nope"))
    assert r.returncode == 2 and "not a tensorscope trace" in r.stderr
