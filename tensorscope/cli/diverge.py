"""``python -m tensorscope diverge DIR_A DIR_B``: where two saved runs' values part ways.

Prints the text summary; ``--html OUT`` writes the HTML one (a self-contained page), ``--pairs OUT``
the aligned pairs as a parquet file. Both runs must be recorded with ``--fingerprints``. The exit
status is 0 with no divergence, 1 with one, 2 on bad input.
"""
from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser("diverge", help="where two saved runs' values part ways (runs recorded with --fingerprints)")
    p.add_argument("a", help="saved trace directory of run a")
    p.add_argument("b", help="saved trace directory of run b")
    p.add_argument("--rtol", type=float, default=None,
                   help="relative difference beyond which an op diverged (default: from its dtypes)")
    p.add_argument("--html", metavar="OUT", default=None, help="also write the summary as an HTML page")
    p.add_argument("--pairs", metavar="OUT", default=None, help="also write the aligned pairs as a parquet file")
    return p


def main(ns) -> int:
    from ..divergence import diverge
    from ..errors import ExportError

    d = diverge(ns.a, ns.b, rtol=ns.rtol)
    print(d.to_text())
    try:
        if ns.html:
            from ..render.ranks import html_document

            with open(ns.html, "w", encoding="utf-8") as f:
                f.write(html_document("tensorscope diverge", d.to_html()))
        if ns.pairs:
            import pyarrow.parquet as pq

            pq.write_table(d.pairs, ns.pairs)
    except OSError as e:
        raise ExportError(f"cannot write {e.filename!r}: {e.strerror or e}") from e
    return 1 if d.first is not None else 0
