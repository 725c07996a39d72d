"""Shared fixtures: every test leaves torch's global state as it found it."""
from __future__ import annotations

import os

import pytest
from torch.nn.modules import module as _mod
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def pytest_report_header(config):
    try:
        from tensorscope import native

        st = native.status()
        eng = st.get("engine") or {}
        return [f"tensorscope native hooks: {st.get('state')} ({st.get('reason', '')})",
                f"tensorscope recording engine: {'python (forced)' if st.get('forced_fallback') else eng.get('state')} "
                f"({eng.get('reason', '')})",
                f"TENSORSCOPE_FORCE_FALLBACK={os.environ.get('TENSORSCOPE_FORCE_FALLBACK', '')}"]
    except Exception as e:  # the native part reports itself; never break collection
        return [f"tensorscope native hooks: unavailable ({type(e).__name__}: {e})"]


def _global_hooks():
    return (dict(_mod._global_forward_pre_hooks), dict(_mod._global_forward_hooks),
            dict(getattr(_mod, "_global_forward_hooks_always_called", {})))


@pytest.fixture(autouse=True)
def _restore_global_state():
    hooks = _global_hooks()
    dstack = list(_get_current_dispatch_mode_stack())
    fstack = list(_get_current_function_mode_stack())
    yield
    from tensorscope.recording import session

    leaked = []
    if session.active_session() is not None:
        leaked.append("an active tensorscope session")
        session.active_session()._restore()
    if list(_get_current_dispatch_mode_stack()) != dstack:
        leaked.append(f"dispatch modes {_get_current_dispatch_mode_stack()}")
        while len(_get_current_dispatch_mode_stack()) > len(dstack):
            _get_current_dispatch_mode_stack()[-1].__exit__(None, None, None)
    if list(_get_current_function_mode_stack()) != fstack:
        leaked.append(f"function modes {_get_current_function_mode_stack()}")
        while len(_get_current_function_mode_stack()) > len(fstack):
            _get_current_function_mode_stack()[-1].__exit__(None, None, None)
    if _global_hooks() != hooks:
        leaked.append("global module hooks")
        for d, saved in zip((_mod._global_forward_pre_hooks, _mod._global_forward_hooks,
                             getattr(_mod, "_global_forward_hooks_always_called", {})), hooks):
            d.clear()
            d.update(saved)
    assert not leaked, f"test left global state behind: {leaked}"
