"""The on-disk layout every dataset must have (single-process and multi-rank writers alike)."""
from __future__ import annotations

import os
import re

import pyarrow.parquet as pq

from tensorscope import schema as S
from tensorscope.io.dataset import DATASET_TABLES

PART = re.compile(r"^part-a\d+-\d+\.parquet$")


def check_layout(root: str) -> None:
    """Only part-*.parquet under <table>/run=<id>/rank=<r>/, and one schema per table across ranks."""
    for table in os.listdir(root):
        if table.startswith("."):
            continue
        tdir = os.path.join(root, table)
        if not os.path.isdir(tdir):
            continue
        assert table in DATASET_TABLES, table
        schemas = []
        for dirpath, _dirnames, files in os.walk(tdir):
            rel = os.path.relpath(dirpath, tdir).split(os.sep)
            for f in files:
                assert len(rel) == 2 and rel[0].startswith("run=") and rel[1].startswith("rank="), dirpath
                assert PART.match(f), os.path.join(dirpath, f)
                schemas.append(pq.read_schema(os.path.join(dirpath, f)).remove_metadata())
        want = S.dataset_schema(table).remove_metadata()
        assert schemas and all(s.equals(want) for s in schemas), table
