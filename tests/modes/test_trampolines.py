"""The trampolines (recording/frames.py) never keep a namespace of exec'd code alive after a trace.

A trampoline is a function whose globals are the caller's (so warnings and tracebacks look untraced);
a cached one would keep those globals, and every tensor in them, alive: the trace would hold a
strong reference to user tensors. Only a module's own globals are cached.
"""
from __future__ import annotations

import gc
import weakref

import pytest

ENGINES = ("native", "python")   # engine="native" falls back to python (and says so) where it cannot be built

CODE = """
import torch
import tensorscope
t = torch.zeros(1000)
with tensorscope.trace(engine=ENGINE, leaks=False) as tr:
    y = torch.nn.functional.softmax(t, 0)   # a Python-level torch function: called through a trampoline
    z = t * 2
"""


@pytest.mark.parametrize("engine", ENGINES)
def test_an_exec_namespace_is_released_after_the_trace(engine):
    ns = {"__name__": "not_a_module", "ENGINE": engine}
    exec(compile(CODE, "<notebook-like>", "exec"), ns)
    assert ns["tr"].ops.num_rows >= 2
    w = weakref.ref(ns["t"].untyped_storage())
    del ns
    gc.collect()
    assert w() is None
