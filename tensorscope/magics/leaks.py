"""``%tensorscope leaks [--min-bytes N] [--device D] [-o VAR]``: the notebook's live tensors and their holders.

Thin: parse the line, call ``tensorscope.find_leaks``, return the ``LeakReport``
(IPython displays it: HTML in Jupyter, text in a terminal). ``-o VAR`` also stores
the report in the user namespace. The report holds strings and integers only,
so keeping it in ``Out`` or ``VAR`` keeps no memory alive.
"""
from __future__ import annotations

import argparse
import re
import shlex

USAGE = "%tensorscope leaks [--min-bytes N] [--device D] [-o VAR]"

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "ki": 1024, "mi": 1024 ** 2, "gi": 1024 ** 3}


def parse_bytes(text: str) -> int:
    """``1000``, ``1e6``, ``10MB``, ``4 MiB`` → bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte count: {text!r} (use e.g. 1000000, 1e6, 10MB or 4MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _usage_error(f"{message}\nusage: {USAGE}")


def _usage_error(msg: str) -> Exception:
    try:
        from IPython.core.error import UsageError

        return UsageError(msg)
    except ImportError:  # pragma: no cover - the magic only runs inside IPython
        return ValueError(msg)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="%tensorscope leaks", add_help=False,
                description="Every live tensor storage the notebook holds, grouped by holder, with the fix.")
    p.add_argument("--min-bytes", dest="min_bytes", default="0", metavar="N",
                   help="only storages of at least N bytes (1e6, 10MB, 4MiB)")
    p.add_argument("--device", dest="device", default=None, metavar="D", help="only this device (cpu, cuda, cuda:1)")
    p.add_argument("-o", dest="out", default=None, metavar="VAR", help="also store the LeakReport in VAR")
    return p


def leaks_magic(shell, line: str):
    """Run ``find_leaks`` for the shell's namespace; returns the ``LeakReport``."""
    try:
        args = _parser().parse_args(shlex.split(line or ""))
    except ValueError as e:
        raise _usage_error(f"{e}\nusage: {USAGE}") from None
    try:
        min_bytes = parse_bytes(args.min_bytes)
    except ValueError as e:
        raise _usage_error(str(e)) from None
    if args.out is not None and not args.out.isidentifier():
        raise _usage_error(f"-o needs a variable name, not {args.out!r}")
    from ..tracking.leaks import find_leaks

    report = find_leaks(min_bytes=min_bytes, device=args.device, shell=shell)
    if args.out is not None:
        shell.user_ns[args.out] = report
    return report
