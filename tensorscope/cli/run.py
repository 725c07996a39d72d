"""``python -m tensorscope run [trace options] --out DIR target [args...]``.

* ``target.py``: runs the script as ``__main__`` (its own ``sys.argv``) inside one
  ``trace(dataset=DIR)``. Under ``torchrun --nproc-per-node N -m tensorscope run
  --out DIR train.py`` every rank does the same and writes its part of one dataset
  (run id and rank as in ``recording/ranks.py``). The script's exit status is ours;
  an exception is printed as Python prints it, after the trace is written.
* ``target.ipynb``: executes the notebook in a real kernel (nbclient) that loads
  the extension at start and traces every cell (``%tensorscope on --dataset DIR``):
  one trace per cell, with its cell number and source, in one run. The executed
  notebook is saved as ``DIR/<name>.ipynb``.
"""
from __future__ import annotations

import argparse
import os
import runpy
import shlex
import sys
import traceback
from typing import Optional

from .. import options as O
from ..errors import SpillError


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("run", help="trace a script or notebook headless into a dataset directory",
                       description="Trace a whole script (every rank under torchrun) or every cell of a notebook "
                                   "into the dataset DIR.")
    p.add_argument("--out", "-o", metavar="DIR", required=True, help="dataset directory (created if missing)")
    p.add_argument("--kernel", metavar="NAME", default=None,
                   help="notebooks: the kernel to run (default: this Python)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="notebooks: per-cell timeout in seconds")
    O.add_to_parser(p)
    p.add_argument("target", help="script.py or notebook.ipynb")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _options(ns: argparse.Namespace) -> tuple[O.TraceOptions, O.DisplayOptions]:
    """The command line's options, parsed once (bad ones fail here, before anything runs)."""
    given = getattr(ns, "dataset", None)
    if given and os.path.abspath(given) != os.path.abspath(ns.out):
        raise SystemExit("tensorscope run: give the dataset once (--out DIR)")
    return O.parse_namespace(ns, dataset=ns.out)


def main(ns: argparse.Namespace) -> int:
    target = ns.target
    if not os.path.isfile(target):
        print(f"tensorscope run: no such file: {target!r}", file=sys.stderr)
        return 2
    opts, display = _options(ns)   # an OptionsError: reported by __main__ (exit status 2), nothing ran
    if target.endswith(".ipynb"):   # the kernel parses the same flags again, from %tensorscope on
        return run_notebook(target, ns.out, O.to_flags(opts, display, skip=("dataset",)), kernel=ns.kernel,
                            timeout=ns.timeout)
    return run_script(target, list(ns.args), opts)


def run_script(path: str, args: list[str], opts: O.TraceOptions) -> int:
    from ..recording.session import trace

    path = os.path.abspath(path)
    old_argv = sys.argv
    sys.argv = [path] + args
    sys.path.insert(0, os.path.dirname(path))
    code = 0
    failure = None
    try:
        with trace(opts, context=O.RunContext(origin="cli")):
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as e:   # the script's own exit: its status is ours, the trace is kept
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=sys.stderr)
            except BaseException as e:
                failure = e
                raise
    except BaseException as e:
        if failure is None and isinstance(e, SpillError):
            # the spill directory filled, the dataset has the whole trace: said, the script's status kept
            print(f"tensorscope: {e}", file=sys.stderr)
            return code
        if failure is None:
            raise   # tensorscope's own failure (dataset write): ExportError, reported by __main__
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
    finally:
        sys.argv = old_argv
        if sys.path and sys.path[0] == os.path.dirname(path):
            del sys.path[0]
    return code


def run_notebook(path: str, out: str, flags: list[str], kernel: Optional[str] = None,
                 timeout: Optional[float] = None) -> int:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    from ..recording.ranks import local_run_id

    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    nb = nbformat.read(path, as_version=4)
    magic = "%tensorscope on " + " ".join(shlex.quote(f) for f in flags + ["--dataset", out])
    extra = ["--IPKernelApp.exec_lines=%load_ext tensorscope", "--IPKernelApp.exec_lines=" + magic]
    env_before = os.environ.get("TENSORSCOPE_RUN_ID")
    os.environ.setdefault("TENSORSCOPE_RUN_ID", local_run_id())   # every cell's trace: one run
    resources = {"metadata": {"path": os.path.dirname(os.path.abspath(path))}}
    if kernel is None:
        from jupyter_client.manager import KernelManager

        km = KernelManager(kernel_cmd=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"])
        client = NotebookClient(nb, km=km, timeout=timeout, extra_arguments=extra, resources=resources)
    else:
        client = NotebookClient(nb, kernel_name=kernel, timeout=timeout, extra_arguments=extra, resources=resources)
    code = 0
    try:
        client.execute()
    except CellExecutionError as e:
        print(f"tensorscope run: a cell failed; the executed notebook keeps its traceback\n{e}", file=sys.stderr)
        code = 1
    finally:
        if env_before is None:
            os.environ.pop("TENSORSCOPE_RUN_ID", None)
        dest = os.path.join(out, os.path.basename(path))
        nbformat.write(nb, dest)
        print(f"tensorscope: executed notebook saved to {dest}", file=sys.stderr)
    return code
