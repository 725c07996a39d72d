"""``%tensorscope diverge A B [--rtol X]``: where two runs part ways (``tensorscope.diverge``).

A and B name runs as ``%tensorscope diff`` does: variables, ``tensorscope.history()`` indices or
saved trace directories, each recorded with ``fingerprints=True`` (``%%tensorscope --fingerprints``).
"""
from __future__ import annotations

import shlex

from IPython.core.error import UsageError

USAGE = ("usage: %tensorscope diverge A B [--rtol X]   (variables, tensorscope.history() indices or trace "
         "directories, recorded with --fingerprints)")


def diverge_magic(shell, rest: str):
    parts = shlex.split(rest)
    rtol = None
    if "--rtol" in parts:
        i = parts.index("--rtol")
        try:
            rtol = float(parts[i + 1])
        except (IndexError, ValueError):
            raise UsageError(USAGE) from None
        del parts[i:i + 2]
    if len(parts) != 2:
        raise UsageError(USAGE)
    from ..divergence import diverge
    from ..errors import TensorscopeError
    from .diff import resolve_trace

    ns = getattr(shell, "user_ns", {})
    try:
        d = diverge(resolve_trace(parts[0], ns), resolve_trace(parts[1], ns), rtol=rtol)
    except TensorscopeError as e:
        raise UsageError(f"tensorscope: {e}") from None
    d.label_a, d.label_b = parts[0], parts[1]
    return d
