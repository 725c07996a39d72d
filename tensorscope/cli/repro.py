"""``python -m tensorscope repro DIR SEQ [-o script.py]``: a standalone script for one recorded op.

DIR is a saved trace directory; SEQ the op's ``ops.seq``. The script (and, when the run was recorded
with ``--capture``, its inputs as a safetensors file beside it) reruns the op with inputs of the
same shapes, strides, storage offsets, dtypes and devices and checks the recorded outcome.
"""
from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser("repro", help="write a standalone script that reruns one recorded op and checks its outcome")
    p.add_argument("path", help="saved trace directory")
    p.add_argument("seq", type=int, help="the op's seq (ops.seq)")
    p.add_argument("-o", "--output", metavar="PY", default=None, help="where to write the script "
                   "(default: repro_SEQ.py here)")
    return p


def main(ns) -> int:
    from .._trace import load

    out = ns.output or f"repro_{ns.seq}.py"
    print(load(ns.path).repro(ns.seq, out))
    return 0
