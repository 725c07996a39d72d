"""Write the golden trace of the current schema version: ``python tests/data/make_golden.py``.

The program is the one every golden trace records (a Linear+ReLU forward and backward), run
from a ``<golden>`` pseudo-file so no machine path lands in the files. A released version's
directory is never rewritten: readers of later versions must keep loading it as it is.
"""
from __future__ import annotations

import os
import sys

import torch

import tensorscope
from tensorscope import schema as S

PROGRAM = """
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
x = torch.randn(2, 4)
with tensorscope.trace(leaks=False, fingerprints=True) as t:
    m(x).sum().backward()
"""


def main() -> int:
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"golden-schema-{S.SCHEMA_VERSION}")
    if os.path.exists(out):
        print(f"{out} exists: a released golden trace is never rewritten", file=sys.stderr)
        return 1
    ns = {"torch": torch, "tensorscope": tensorscope}
    exec(compile(PROGRAM, "<golden>", "exec"), ns)
    t = ns["t"]
    md = t.metadata.to_dict()
    md["cell_source"] = "m(x).sum().backward()"
    if isinstance(md.get("native"), dict):
        md["native"].pop("path", None)   # a path on the machine that wrote it
        if isinstance(md["native"].get("engine"), dict):
            md["native"]["engine"].pop("path", None)
    t = tensorscope.Trace({name: t.table(name) for name in S.RECORDED}, md)   # a Trace is read-only: a new one
    t.save(out)
    print(f"wrote {out}: {t.ops.num_rows} ops")
    return 0


if __name__ == "__main__":
    sys.exit(main())
