"""Shared fixtures: every test leaves the process as it found it (tests/helpers/state.py lists what that means)."""
from __future__ import annotations

import os

import pytest
import torch._dynamo  # noqa: F401  (see below)

from tests.helpers.state import GlobalState

# A library the first trace imports registers its own warning filter on import (torch._dynamo
# pulls in sympy, whose filter is "once" for its deprecations): imported here, before any test,
# so that the guard below sees what a test changed, not what an import order did.


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


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Puts back every piece of process-wide state after the test, and fails a test that changed one it
    must not (a mode left on the stack, a hook, a warning filter, frozen objects, ...)."""
    state = GlobalState.take()
    yield
    leaked = state.restore()
    assert not leaked, f"test left global state behind: {leaked}"
