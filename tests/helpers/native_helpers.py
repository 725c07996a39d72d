"""Helpers for tests/native/test_native.py: minimal modes that drive a native Capture.

The modes here are deliberately small stand-ins for tensorscope's own: a
TorchDispatchMode calling ``op_begin``/``op_end`` around every ATen op, and a
TorchFunctionMode calling ``call_begin``/``call_end`` around each outermost
torch-level call, logging what the capture reports. A dispatch mode can also
run a different callable for an op (``substitute``), so a test op can be made
to run inside a real torch binding (torch.neg), whose PyWarningHandler turns
its C++ warnings into Python warnings.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import TESTS

#: the test-op library's source: tests only, so it lives here and not in the package (nor the wheel)
TEST_OPS_CPP = os.path.join(TESTS, "native", "test_ops.cpp")


def cpp_line_of(text: str, path: str = TEST_OPS_CPP) -> int:
    """1-based line of ``path`` containing ``text`` (exactly one)."""
    with open(path) as f:
        hits = [i + 1 for i, line in enumerate(f) if text in line]
    assert len(hits) == 1, (text, hits)
    return hits[0]


class Log:
    def __init__(self) -> None:
        self.op_errors: List[tuple] = []     # (op, exc type, info)
        self.op_warnings: List[tuple] = []   # (op, warning dict, in_backward)
        self.call_errors: List[tuple] = []   # (call name, exc type, info)
        self.call_warnings: List[tuple] = []  # (call name, warning dict)

    def op_warning_messages(self) -> List[str]:
        return [w["message"] for _op, w, _bw in self.op_warnings]


class MiniDispatch(TorchDispatchMode):
    def __init__(self, cap, log: Log, substitute: Optional[Dict[Any, Callable]] = None, bare: bool = False):
        super().__init__()
        self.cap, self.log, self.substitute, self.bare = cap, log, substitute or {}, bare

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.bare:
            return func(*args, **kwargs)
        cap = self.cap
        run = self.substitute.get(func, func)
        cap.op_begin()
        try:
            return run(*args, **kwargs)
        except BaseException as e:
            self.log.op_errors.append((str(func), type(e), cap.error_info(e)))
            raise
        finally:
            ws = cap.op_end()
            if ws:
                bw = torch._C._current_autograd_node() is not None
                self.log.op_warnings.extend((str(func), w, bw) for w in ws)


class MiniFunction(TorchFunctionMode):
    def __init__(self, cap, log: Log):
        super().__init__()
        self.cap, self.log, self.depth = cap, log, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        tok = self.cap.call_begin(func) if self.depth == 0 else None
        self.depth += 1
        try:
            return func(*args, **kwargs)
        except BaseException as e:
            self.log.call_errors.append((name, type(e), self.cap.error_info(e)))
            raise
        finally:
            self.depth -= 1
            if tok is not None:
                ws = self.cap.call_end(tok)
                if ws:
                    self.log.call_warnings.extend((name, w) for w in ws)


@contextlib.contextmanager
def traced(cap, substitute=None, function=True):
    """Both minimal modes around a block; yields the Log."""
    log = Log()
    with contextlib.ExitStack() as stack:
        if function:
            stack.enter_context(MiniFunction(cap, log))
        stack.enter_context(MiniDispatch(cap, log, substitute))
        yield log
