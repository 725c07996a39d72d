"""The main job behind `make demo`: execute examples/quickstart.ipynb headless in a real
kernel (nbclient), then print the trace's summary from the parquet it wrote.

    python examples/run_demo.py [--notebook examples/quickstart.ipynb] [--cwd DIR]
    python examples/run_demo.py --notebook examples/compiled_regions.ipynb   # any example notebook
    python examples/run_demo.py --all                                       # every examples/*.ipynb
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--notebook", default=os.path.join(HERE, "quickstart.ipynb"))
    ap.add_argument("--cwd", default=ROOT, help="working directory of the kernel (runs/ is written there)")
    ap.add_argument("--all", action="store_true", help="execute every notebook in examples/ (quickstart last)")
    a = ap.parse_args(argv)

    import nbformat
    from nbclient import NotebookClient

    books = [a.notebook]
    if a.all:
        books = [os.path.join(HERE, f) for f in sorted(os.listdir(HERE))
                 if f.endswith(".ipynb") and f != "quickstart.ipynb"] + [os.path.join(HERE, "quickstart.ipynb")]
    os.makedirs(os.path.join(a.cwd, "runs"), exist_ok=True)
    for book in books:
        nb = nbformat.read(book, as_version=4)
        t0 = time.time()
        client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": a.cwd}})
        client.execute()
        name = os.path.splitext(os.path.basename(book))[0]
        executed = os.path.join(a.cwd, "runs", f"{name}.executed.ipynb")
        nbformat.write(nb, executed)
        print(f"executed {os.path.relpath(book, a.cwd)} in a real kernel in {time.time() - t0:.1f} s -> {executed}")

    import tensorscope

    path = os.path.join(a.cwd, "runs", "quickstart")
    if not os.path.isdir(path):   # a notebook other than the quickstart: it printed what it shows
        return 0
    t = tensorscope.load(path)
    print(t.summary().to_text())
    print(f"\nparquet trace: {path}/ ({', '.join(sorted(os.listdir(path)))})")
    top = t.sql("select op, count(*)::BIGINT as n, sum(cpu_ns)::BIGINT as cpu_ns from ops group by op "
                "order by cpu_ns desc limit 5")
    print("\ntop ops (DuckDB over the loaded trace):")
    print(top.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
