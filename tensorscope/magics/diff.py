"""``%tensorscope diff A B`` and the resolution of a run named in a magic (``--baseline VAR``).

A run is named by a variable of the user namespace (holding a Trace, a finished
``trace()`` object or a path), an index into ``tensorscope.history()`` (``-1`` is
the latest), or a saved trace directory. Anything else is a UsageError that
says which of the three was expected.
"""
from __future__ import annotations

import os
import shlex

from IPython.core.error import UsageError


def resolve_trace(spec, user_ns):
    """The Trace a magic argument names (see the module docstring)."""
    from .._diff import as_trace
    from ..errors import TensorscopeError

    if not isinstance(spec, str):
        try:
            return as_trace(spec)
        except (TypeError, TensorscopeError) as e:
            raise UsageError(f"tensorscope: {e}") from None
    if spec in (user_ns or {}):
        value = user_ns[spec]
        try:
            return as_trace(value)
        except (TypeError, TensorscopeError) as e:
            raise UsageError(f"tensorscope: variable {spec!r} does not hold a trace: {e}") from None
    try:
        idx = int(spec)
    except ValueError:
        idx = None
    if idx is not None:
        from ..recording.history import history

        h = history()
        if not -len(h) <= idx < len(h):
            raise UsageError(f"tensorscope: no trace #{idx} in tensorscope.history() ({len(h)} kept)")
        return h[idx]
    if os.path.isdir(spec):
        try:
            return as_trace(spec)
        except TensorscopeError as e:
            raise UsageError(f"tensorscope: {e}") from None
    raise UsageError(f"tensorscope: {spec!r} is not a variable, a tensorscope.history() index or a trace directory")


def diff_magic(shell, rest: str):
    parts = shlex.split(rest)
    if len(parts) != 2:
        raise UsageError("usage: %tensorscope diff A B   (variables, tensorscope.history() indices or trace directories)")
    from .._diff import diff

    ns = getattr(shell, "user_ns", {})
    d = diff(resolve_trace(parts[0], ns), resolve_trace(parts[1], ns))
    d.label_a, d.label_b = parts[0], parts[1]
    return d
