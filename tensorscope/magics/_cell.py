"""Runtime entry points called by the code injected into a traced cell. Keep them tiny."""
from __future__ import annotations


def _ctl():
    from IPython import get_ipython

    from .controller import get_controller

    shell = get_ipython()
    return get_controller(shell, create=False) if shell is not None else None


def begin(token: int) -> None:
    ctl = _ctl()
    if ctl is not None:
        ctl.begin(token)


def end(token: int, value=None):
    ctl = _ctl()
    if ctl is None:
        return value
    return ctl.end(token, value)
