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


def test_a_write_the_native_context_cannot_keep_raises():
    """``seq`` is the native observer's row count: writing it used to be dropped silently."""
    with tensorscope.trace(engine="native"):
        torch.ones(2) + 1
        sess = active_session()
        assert sess is not None
        ctx = sess.ctx
        if type(ctx) is not NativeRecordingContext:
            pytest.skip(f"the native engine does not record here: {sess.engine.choice.reason}")
        before = ctx.seq
        with pytest.raises(AttributeError, match="read-only"):
            ctx.seq = before + 5
        assert ctx.seq == before
    from tensorscope.recording.ophooks import OpHooks
    from tensorscope.recording.recorder import Recorder

    py = RecordingContext(Recorder(), OpHooks(), want_source=False, want_modules=False, track_storages=False)
    py.seq = 7   # the python engine's dispatch mode numbers its rows itself
    assert py.seq == 7


def _protocol_members(proto: type) -> set:
    names = set(getattr(proto, "__annotations__", {}))
    for klass in proto.__mro__:
        if klass.__name__ in ("Protocol", "Generic", "object"):
            continue
        names |= {n for n in vars(klass) if not n.startswith("_") or n in ("__enter__", "__exit__")}
        names |= set(getattr(klass, "__annotations__", {}))
    return names


def test_each_engine_pair_has_the_members_of_its_protocol():
    """The python and native halves of each pair answer every member of the Protocol the context
    types the field with (mypy checks the assignments it sees; ``open_capture`` is untyped)."""
    from tensorscope.native._capture import NativeCapture
    from tensorscope.native._fallback import FallbackCapture
    from tensorscope.recording import protocols as P
    from tensorscope.recording.engines.native import NativeScreen, NativeStorages
    from tensorscope.recording.engines.python.numerics import NonfiniteScreen
    from tensorscope.recording.engines.python.shadow import NumericsShadow
    from tensorscope.tracking.storages import StorageTracker

    instance_attrs = {"op_begin", "op_end", "engine", "native", "sites_reason"}   # set in __init__ / class
    pairs = [(P.Storages, (StorageTracker, NativeStorages)), (P.Screen, (NonfiniteScreen, NativeScreen)),
             (P.OpScreen, (NonfiniteScreen,)), (P.Capture, (FallbackCapture, NativeCapture)),
             (P.NativeSiteCapture, (NativeCapture,)), (P.FunctionMode, (TracingFunctionMode, NativeFunctionMode)),
             (P.Shadow, (NumericsShadow,))]
    for proto, classes in pairs:
        members = _protocol_members(proto)
        assert members, proto
        for cls in classes:
            missing = {m for m in members if not hasattr(cls, m) and m not in instance_attrs}
            assert not missing, f"{cls.__name__} lacks {sorted(missing)} of {proto.__name__}"
    assert {"live_created", "close"} <= _protocol_members(P.Storages) and {"pre", "post"} <= _protocol_members(P.OpScreen)
