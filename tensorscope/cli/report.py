"""``python -m tensorscope report PATH -o report.html``: a self-contained HTML report.

PATH is a dataset (``trace(dataset=…)``, ``run --out``) or one saved trace
directory (``t.save``). The page has inline styles and images only: no script,
no network, no server; every string in it is escaped by the summary renderer.
"""
from __future__ import annotations

import os
import sys


def add_parser(sub):
    p = sub.add_parser("report", help="write a self-contained HTML report of a dataset or a saved trace")
    p.add_argument("path", help="dataset directory or saved trace directory")
    p.add_argument("-o", "--output", metavar="HTML", required=True, help="where to write the report")
    p.add_argument("--run", default=None, help="datasets: only this run")
    return p


def render(path: str, run=None) -> str:
    from ..io.parquet import METADATA_FILE
    from ..render.ranks import html_document

    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        from .._trace import load

        return html_document(f"tensorscope trace {os.path.basename(os.path.abspath(path))}",
                             load(path).summary().to_html())
    from .._dataset import open_dataset

    with open_dataset(path) as ds:
        body = ds.summary(run).to_html()
    return html_document(f"tensorscope dataset {os.path.basename(os.path.abspath(path))}", body)


def main(ns) -> int:
    from ..errors import ExportError

    doc = render(ns.path, ns.run)
    try:
        with open(ns.output, "w", encoding="utf-8") as f:
            f.write(doc)
    except OSError as e:
        raise ExportError(f"cannot write the report to {ns.output!r}: {e.strerror or e}") from e
    print(ns.output, file=sys.stdout)
    return 0
