"""The seam between the session and the modes (recording/context.py).

The session makes one RecordingContext per trace and hands it, never itself, to the modes, the
trackers and the engine: from the installed modes no Session is reachable, under both engines.
The context holds exactly its documented fields (``__slots__``), none of which the session keeps
a second copy of.
"""
from __future__ import annotations

import gc
import sys
import types
from typing import Any, Iterable, List

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import tensorscope
from tensorscope.recording.context import FIELDS, NATIVE_FIELDS, NativeRecordingContext, RecordingContext
from tensorscope.recording.engines.python.dispatch import TracingDispatchMode
from tensorscope.recording.function import NativeFunctionMode, TracingFunctionMode
from tensorscope.recording.session import Session, active_session

_MODES = (TracingDispatchMode, TracingFunctionMode, NativeFunctionMode)


def _reachable(roots: Iterable[Any], cls: type, limit: int = 2_000_000) -> List[Any]:
    """Instances of ``cls`` reachable from ``roots`` through the objects' references
    (``gc.get_referents``: attributes, slots, containers, bound methods' ``__self__``, closures,
    what C objects report), not through the global namespaces: modules, classes, code, frames and
    a function's ``__globals__`` end a path (every object reaches every module through those)."""
    module_dicts = {id(vars(m)) for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)}
    stop = (type, types.ModuleType, types.FrameType, types.CodeType)
    seen: set = set()
    keep: List[Any] = []   # visited objects stay alive, so an id is never reused during the walk
    todo = list(roots)
    found: List[Any] = []
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        keep.append(o)
        if isinstance(o, cls):
            found.append(o)
            continue
        if isinstance(o, stop) or id(o) in module_dicts:
            continue
        if isinstance(o, types.FunctionType):
            refs = [o.__closure__, o.__defaults__, o.__kwdefaults__, o.__dict__]
        else:
            refs = gc.get_referents(o)
        todo.extend(r for r in refs if r is not None)
        assert len(seen) < limit, "the walk did not end: the mode reaches too much to tell"
    return found


def test_the_walk_finds_a_session_when_one_is_reachable():
    sess = object.__new__(Session)
    holder = type("Holder", (), {})()
    holder.stuff = [{"a": (1, sess)}]
    assert _reachable([holder], Session) == [sess]
    assert _reachable([lambda: sess], Session) == [sess]   # through a closure
    assert _reachable([type("Holder", (), {"s": sess})()], Session) == []   # a class is where a path ends


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu()


@pytest.mark.parametrize("engine", ["native", "python"])
def test_the_modes_hold_the_context_and_no_session(engine, tmp_path):
    net = _Net()
    with tensorscope.trace(engine=engine, dataset=str(tmp_path / "ds")) as t:
        y = net(torch.randn(2, 4))
        try:
            torch.ones(3) + torch.ones(4)
        except RuntimeError:
            pass
        sess = active_session()
        assert sess is not None
        modes = [m for m in (*_get_current_function_mode_stack(), *_get_current_dispatch_mode_stack())
                 if isinstance(m, _MODES)]
        ctx = sess.ctx
        native = sess.engine.name == "native"   # the fallback pass records engine="native" with python
        assert type(ctx) is (NativeRecordingContext if native else RecordingContext)
        assert modes and all(m.ctx is ctx for m in modes)
        assert any(isinstance(m, TracingDispatchMode) for m in modes) == (not native)
        found = _reachable([*modes, ctx, sess.engine], Session)
    assert found == [], f"a Session is reachable from the {engine} engine's modes"
    assert y.shape == (2, 4)
    assert t.ops.num_rows > 0 and t.calls.num_rows > 0 and t.errors.num_rows == 1
    assert t.metadata.get("tracer_errors", 0) == 0, t.metadata.get("tracer_error_messages")


def test_the_context_has_exactly_its_documented_fields():
    assert RecordingContext.__slots__ == tuple(FIELDS)
    assert NativeRecordingContext.__slots__ == tuple(NATIVE_FIELDS)
    assert not set(FIELDS) & set(NATIVE_FIELDS)
    assert all(isinstance(doc, str) and doc for doc in (*FIELDS.values(), *NATIVE_FIELDS.values()))
    from tensorscope.recording.ophooks import OpHooks
    from tensorscope.recording.recorder import Recorder

    ctx = RecordingContext(Recorder(), OpHooks(), want_source=True, want_modules=True, track_storages=True)
    assert not hasattr(ctx, "__dict__")   # no field beyond the slots can be added by mistake
    with pytest.raises(AttributeError):
        ctx.options = None   # type: ignore[attr-defined]
    assert {f: getattr(ctx, f) is not None or f in ("last_exc_key", "capture", "screen", "shadow", "cuda_timer", "fingerprints")
            for f in FIELDS} == dict.fromkeys(FIELDS, True)


@pytest.mark.parametrize("engine", ["native", "python"])
def test_one_owner_per_field(engine):
    """The session keeps its lifecycle and nothing the context holds."""
    with tensorscope.trace(engine=engine):
        torch.ones(2) + 1
        sess = active_session()
        assert sess is not None
        own = set(vars(sess))
    assert "ctx" in own
    assert not own & set(FIELDS), own & set(FIELDS)
