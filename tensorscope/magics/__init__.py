"""IPython integration: ``%load_ext tensorscope``, ``%%tensorscope`` and ``%tensorscope``.

Thin by design: every magic is parse → public API (``trace()``, ``Trace.save``) →
display. How a ``%%tensorscope`` cell runs, so that it behaves exactly as
without the magic:

1. an input transformer sees the raw cell; when its first line is
   ``%%tensorscope [options]`` and the options parse, it replaces that line (and
   only that line, so line numbers stay true) with a call that starts the trace;
2. an AST transformer wraps the value of the cell's last expression in a call
   that stops the trace and returns the value, so IPython itself still runs the
   cell: the last expression displays (outside the trace), ``Out`` and ``_``
   are set as usual, ``%`` magics and top-level ``await`` work;
3. the ``post_run_cell`` event stops a trace the cell left running (it raised
   or was interrupted), records the exception, then saves and displays.

Options that fail to parse leave the cell untouched, so the registered cell
magic runs and raises IPython's usual UsageError without running the body.
"""
from __future__ import annotations

from .controller import Controller, get_controller  # noqa: F401


def load_ipython_extension(ipython):
    from .magics import TensorscopeMagics, parse_cell_args

    ctl = get_controller(ipython)
    if ctl.installed:
        return
    ipython.register_magics(TensorscopeMagics(ipython, ctl))
    ctl.install(parse_cell_args)


def unload_ipython_extension(ipython):
    ctl = get_controller(ipython, create=False)
    if ctl is not None:
        ctl.uninstall()
