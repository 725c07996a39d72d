"""The ``%%tensorscope`` cell magic and the ``%tensorscope`` line magic.

Options come from ``TraceOptions`` and ``DisplayOptions`` (one declaration) plus
the magic's own ``-o/--output``, ``--save`` and ``--quiet``, so ``%%tensorscope?``
lists them all. The flags are parsed once, into those typed objects, when the cell
is read; the cell's number and source travel beside them as a ``RunContext``.
"""
from __future__ import annotations

import shlex

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .. import options as O
from ..errors import TensorscopeError
from .controller import CellRequest, deliver

MAGIC_ONLY = [
    (("-o", "--output"), dict(dest="output", metavar="VAR", default=None,
                              help="store the Trace in this variable of the user namespace")),
    (("--save",), dict(dest="save", metavar="PATH", default=None,
                       help="save the trace as a parquet directory at PATH after the cell")),
    (("-q", "--quiet"), dict(dest="quiet", action="store_true", default=False,
                             help="do not display the summary")),
    (("--predict",), dict(dest="predict", action="store_true", default=False,
                          help="do not run the cell: predict its ops and memory under FakeTensorMode "
                               "(tensorscope.predict); the notebook's names are left as they were")),
]


def _with_options(func):
    for flags, kw in reversed(O.argparse_arguments()):
        func = argument(*flags, **kw)(func)
    for flags, kw in reversed(MAGIC_ONLY):
        func = argument(*flags, **kw)(func)
    return magic_arguments(name="%tensorscope")(func)


def _parse(func, argline: str):
    args = parse_argstring(func, argline)
    try:
        opts, display = O.parse_namespace(args)   # validated now: a bad value runs nothing
    except TensorscopeError as e:
        raise UsageError(str(e)) from None
    return args, opts, display


class _NotTraced(Exception):
    """A ``%%tensorscope`` line the input transformer leaves to the cell magic (``--predict``)."""


def parse_cell_args(argline: str) -> CellRequest:
    args, opts, display = _parse(TensorscopeMagics.tensorscope_cell, argline)
    if args.predict:
        raise _NotTraced("--predict")   # the cell magic runs it (nothing of the cell runs for real)
    return CellRequest(token=0, options=opts, display=display, output=args.output, save=args.save, quiet=args.quiet)


def _predict_cell(shell, cell: str):
    """The cell's code run by ``tensorscope.predict`` over a copy of the notebook's namespace whose
    tensors are fake: its assignments stay in the copy, its ops compute nothing."""
    from ..prediction import predict

    code = compile(shell.transform_cell(cell), "<tensorscope --predict>", "exec")

    def run(ns):
        exec(code, ns)

    return predict(run, dict(shell.user_ns))


LINE_HELP = """%tensorscope SUBCOMMAND

  last              display the most recent trace (tensorscope.last())
  save PATH         save the most recent trace as a parquet directory
  on [OPTIONS]      trace every following cell (one Trace per cell, see tensorscope.history());
                    OPTIONS are those of %%tensorscope (see %%tensorscope?)
  off               stop tracing every cell
  history           list the traces kept this session
  leaks [--min-bytes N] [--device D] [-o VAR]
                    every live tensor storage of the notebook, who holds it, and the fix
  diff A B          compare two runs (variables, tensorscope.history() indices or trace directories)
  diverge A B [--rtol X]
                    where two runs' values part ways (runs recorded with --fingerprints)
  env               torch/CUDA/cuDNN versions, GPUs, arch support, TF32/bf16 settings, machine peaks
  help              this text
"""


@magics_class
class TensorscopeMagics(Magics):
    """``%%tensorscope``, ``%tensorscope`` and their sibling magics; the work is the controller's."""

    def __init__(self, shell, controller):
        super().__init__(shell)
        self.ctl = controller

    @_with_options
    @cell_magic("tensorscope")  # type: ignore[arg-type]  # IPython types the result as decorator | function
    def tensorscope_cell(self, line, cell):
        """Trace the cell: every torch-level call and ATen op, as Arrow tables.

        The cell runs exactly as without the magic (its last expression displays,
        Out, line numbers, %-magics and top-level await are unchanged), then a
        summary is displayed. ``-o t`` keeps the Trace in ``t``; ``tensorscope.last()``
        always has it.
        """
        # Reached only when the input transformer did not take the cell (options
        # that fail to parse raise UsageError here and nothing runs), or when the
        # magic is called programmatically: then run the body as a nested cell.
        args, opts, display_opts = _parse(TensorscopeMagics.tensorscope_cell, line)
        if args.predict:
            t = _predict_cell(self.shell, cell)
            if args.output:
                self.shell.user_ns[args.output] = t
            deliver(t, save=args.save, quiet=args.quiet, display=display_opts)
            return None
        from ..recording.session import trace

        if opts.baseline is not None:
            from .diff import resolve_trace

            opts = opts.replace(baseline=resolve_trace(opts.baseline, self.shell.user_ns))

        ctx = O.RunContext(cell=getattr(self.shell, "execution_count", None), cell_source=cell, origin="magic",
                           keep_history=True)
        cm = trace(opts, context=ctx, display=display_opts)
        with cm:
            self.shell.run_cell(cell, store_history=False)
        t = cm.result
        if args.output:
            self.shell.user_ns[args.output] = t
        deliver(t, save=args.save, quiet=args.quiet, display=display_opts)

    @line_magic("tensorscope")  # type: ignore[arg-type]  # IPython types the result as decorator | function
    def tensorscope_line(self, line):
        """%tensorscope last | save PATH | on [OPTIONS] | off | history | leaks | diff A B | diverge A B | env | help"""
        parts = shlex.split(line)
        if not parts or parts[0] in ("help", "-h", "--help"):
            print(LINE_HELP)
            return None
        cmd, rest = parts[0], line.strip()[len(parts[0]):].strip()
        from ..recording import history as session

        if cmd == "last":
            t = session.last()
            if t is None:
                raise UsageError("no trace yet: run a cell with %%tensorscope first")
            return t
        if cmd == "save":
            if len(parts) != 2:
                raise UsageError("usage: %tensorscope save PATH")
            t = session.last()
            if t is None:
                raise UsageError("no trace to save: run a cell with %%tensorscope first")
            try:
                path = t.save(parts[1])
            except TensorscopeError as e:   # one line, as --save reports it: no internal traceback
                raise UsageError(f"tensorscope: {e}") from None
            print(f"tensorscope: saved to {path}")
            return None
        if cmd == "on":
            req = parse_cell_args(rest)
            self.ctl.always_on = req
            if req.options.kernels:
                # one Kineto session for every cell (restarting per cell drifts and drops GPU events)
                from ..timing.kernels import KernelCollector

                KernelCollector.shared().keep_alive = True
            print("tensorscope: tracing every cell from now on (%tensorscope off to stop; tensorscope.history() keeps them)")
            return None
        if cmd == "off":
            was = self.ctl.always_on is not None
            kernels = was and self.ctl.always_on.options.kernels
            self.ctl.always_on = None
            if kernels:
                from ..timing.kernels import KernelCollector

                KernelCollector.shared().close()   # harvest what is pending, end the session
            print("tensorscope: always-on tracing is off" if was else "tensorscope: always-on tracing was not on")
            return None
        if cmd == "history":
            for t in session.history():
                print(repr(t))
            return None
        if cmd == "leaks":
            from .leaks import leaks_magic

            return leaks_magic(self.shell, rest)
        if cmd == "diff":
            from .diff import diff_magic

            return diff_magic(self.shell, rest)
        if cmd == "diverge":
            from .diverge import diverge_magic

            return diverge_magic(self.shell, rest)
        if cmd == "env":
            from .._env import env

            return env()
        raise UsageError(f"unknown %tensorscope subcommand {cmd!r}\n\n{LINE_HELP}")
