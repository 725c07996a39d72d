"""The autouse fixture's guard (tests/helpers/state.py): a leaked change is caught and put back."""
from __future__ import annotations

import gc
import sys
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

import tensorscope
from tests.helpers.state import GlobalState


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_left_on_the_stack_is_caught_and_popped():
    state = GlobalState.take()
    _Mode().__enter__()
    assert state.restore() == ["dispatch modes"]
    assert list(_get_current_dispatch_mode_stack()) == []


def test_a_global_module_hook_is_caught_and_removed():
    state = GlobalState.take()
    torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    assert state.restore() == ["global module hooks"]
    assert not torch.nn.modules.module._global_forward_hooks


def test_a_warning_filter_is_caught_and_removed():
    state = GlobalState.take()
    before = list(warnings.filters)
    warnings.simplefilter("ignore", DeprecationWarning)
    assert state.restore() == ["warning filters"]
    assert warnings.filters == before


def test_gc_left_disabled_or_frozen_is_caught_and_undone():
    if gc.get_freeze_count():
        pytest.skip("objects are frozen already (by the interpreter or a plugin)")
    state = GlobalState.take()
    gc.disable()
    gc.freeze()
    assert sorted(state.restore()) == ["gc enabled", "gc freeze (objects left frozen)"]
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_leak_discovery_left_enabled_is_caught_and_disabled():
    state = GlobalState.take()
    tensorscope.enable_discovery()
    assert state.restore() == ["leak discovery (cell-boundary hooks)"]
    from tensorscope.tracking.leaks import boundary

    assert boundary.discovery() is None


def test_a_replaced_main_module_is_caught_and_put_back():
    state = GlobalState.take()
    main = sys.modules["__main__"]
    sys.modules["__main__"] = type(sys)("__main__")
    assert state.restore() == ["sys.modules['__main__']"]
    assert sys.modules["__main__"] is main


def test_grad_mode_and_default_dtype_are_caught_and_restored():
    state = GlobalState.take()
    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)
    assert sorted(state.restore()) == ["torch default dtype", "torch grad mode"]
    assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32


def test_what_tests_change_on_purpose_is_put_back_without_failing():
    state = GlobalState.take()
    last = tensorscope.last()
    with tensorscope.trace(leaks=False) as t:
        torch.ones(2).add(1)
    assert tensorscope.last() is not last and tensorscope.last().ops.num_rows == t.ops.num_rows
    assert state.restore() == []
    assert tensorscope.last() is last


def test_the_ipython_singleton_and_its_builtins_are_put_back():
    pytest.importorskip("IPython")
    import builtins

    from IPython.core.interactiveshell import InteractiveShell

    before = InteractiveShell._instance
    state = GlobalState.take()
    main = sys.modules["__main__"]
    InteractiveShell.instance()
    assert InteractiveShell.initialized()
    assert state.restore() == []
    assert InteractiveShell._instance is before
    assert sys.modules["__main__"] is main          # the shell's namespace no longer reachable from there
    assert before is not None or not hasattr(builtins, "__IPYTHON__")
