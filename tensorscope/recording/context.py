"""The recording context: the one object the modes, the module and storage trackers and the
native observer's Python side read and write while a trace records.

The engine makes one per trace (``Engine.make_context``); the session (``recording/session.py``)
hands it, never itself, to the function mode, the dispatch mode, the engine and the trackers. The context holds the per-op
state and the helpers the modes call, and nothing about the session's lifecycle (options,
start/stop, probes setup, building, the dataset, the history): those stay on the session,
which reads what it needs back from ``session.ctx``.

Two classes, one per engine:

* :class:`RecordingContext` -- the python engine: the modes keep every field in Python.
* :class:`NativeRecordingContext` -- the native engine: the same fields, but ``seq`` is the C
  observer's row count, and what the function mode and the module tracker set
  (``current_call``, ``modules.current``, ``recording``) is forwarded to the observer and the C
  function mode through their setters (``set_call``, ``set_module``, ``set_recording``), so the
  modes are the same code for both engines.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Optional, Protocol

from ..native import site_error_info
from ..tracking.storages import StorageTracker
from .modules import ModuleTracker
from .recorder import C_SRC, Recorder
from .source import user_frame_location

if TYPE_CHECKING:
    from ..timing.cuda import CudaOpTimer
    from .fingerprint import Fingerprinter
    from .ophooks import OpHooks
    from .protocols import Capture, Screen, Shadow, Storages


class ObserverEngine(Protocol):
    """What the native context needs of its engine (``engines/native/``): the compiled
    observer and the warnings it recorded per op."""

    ext: Any

    def take_warnings(self) -> list[dict[str, Any]]: ...

#: the fields of :class:`RecordingContext`, each with who writes it (tests/modes/test_context.py
#: checks ``__slots__`` against this table)
FIELDS: dict[str, str] = {
    "rec": "the Recorder: the columnar buffers every observer appends to (set once)",
    "seq": "the number of the next ops row (the dispatch mode counts it; natively the observer's row count)",
    "recording": "whether the modes record now (the session sets it at start/stop and around its own work)",
    "current_call": "calls row id of the innermost running torch-level call, -1 outside any "
                    "(the function mode sets it; every op inherits it)",
    "call_stack": "calls row ids of the torch-level calls running now, outermost first (the function mode)",
    "node_names": "autograd node class -> interned node name id (the dispatch mode's cache)",
    "opaque_ops": "ops outside any torch-level call (the dispatch mode; natively the engine at finish)",
    "compiled_ops": "of those, the ones torch.compile'd code dispatched (the dispatch mode)",
    "last_exc_key": "frames.exc_mark() of the last exception recorded (its exc_key and calls row), so one "
                    "exception seen by several observers is recorded once (the modes; the session for the "
                    "block's exception; frames.seen_exc)",
    "last_error_id": "errors row id of that exception (written with last_exc_key)",
    "modules": "the ModuleTracker: the module of the running call (modules.current; set by the function mode)",
    "tracker": "the StorageTracker (python engine, storages=True), else None; the native engine puts "
               "its NativeStorages here at finish",
    "op_hooks": "the OpHooks of this trace (recording/ophooks.py; the session adds its own hooks before start)",
    "t0": "perf_counter_ns() at the start: times are relative to it (the session sets it at start)",
    "want_source": "whether calls record the user's source line (options.source)",
    "want_modules": "whether calls record their module path (options.modules)",
    "capture": "the warning/error capture (native.open_capture()), or None (the session, at start)",
    "screen": "the non-finite screen: NonfiniteScreen (python engine), NativeScreen (native: its counters at finish), or None "
              "(the engine's setup_probes)",
    "shadow": "the NumericsShadow of numerics=, or None (the session, at start)",
    "cuda_timer": "the CudaOpTimer of cuda_timing= (python engine), or None (the engine's setup_probes)",
    "fingerprints": "the Fingerprinter of fingerprints= (python engine), or None (the engine's setup_probes)",
    "own_ns": "tensorscope's own time so far in the python engine's modes, outside the ops and calls they wrap "
              "(the modes add their segments; ops.probe_ns is its growth between two ops)",
    "own_mark": "own_ns when the last ops row ended (the dispatch mode)",
    "own_row": "the seq of that row, -1 before the first (the dispatch mode)",
}


class RecordingContext:
    """What the modes read and write while a trace records (python engine). See :data:`FIELDS`."""

    __slots__ = tuple(FIELDS)

    rec: Recorder
    seq: int
    recording: bool
    current_call: int
    call_stack: list[int]
    node_names: dict[type, int]
    opaque_ops: int
    compiled_ops: int
    last_exc_key: Any
    last_error_id: int
    modules: ModuleTracker
    tracker: Optional[Storages]
    op_hooks: OpHooks
    t0: int
    want_source: bool
    want_modules: bool
    capture: Optional[Capture]
    screen: Optional[Screen]
    shadow: Optional[Shadow]
    cuda_timer: Optional[CudaOpTimer]
    fingerprints: Optional[Fingerprinter]
    own_ns: int
    own_mark: int
    own_row: int

    def __init__(self, rec: Recorder, op_hooks: OpHooks, *, want_source: bool, want_modules: bool,
                 track_storages: bool) -> None:
        self.rec = rec
        self.op_hooks = op_hooks
        self.want_source = want_source
        self.want_modules = want_modules
        _SEQ.__set__(self, 0)   # the slot (the native context's seq is the observer's, read-only)
        self.recording = False
        self.current_call = -1
        self.call_stack = []
        self.node_names = {}
        self.opaque_ops = 0
        self.compiled_ops = 0
        self.last_exc_key = None
        self.last_error_id = -1
        self.t0 = 0
        self.capture = None
        self.screen = None
        self.shadow = None
        self.cuda_timer = None
        self.fingerprints = None
        self.own_ns = self.own_mark = 0
        self.own_row = -1
        self.modules = self._module_tracker()
        self.tracker = self._storage_tracker() if track_storages else None

    def _module_tracker(self) -> ModuleTracker:
        return ModuleTracker(self.rec)

    def _storage_tracker(self) -> Optional[Storages]:
        # seq - 1: the op running or last finished when the storage appeared or died
        return StorageTracker(self.rec, self._last_seq)

    def _last_seq(self) -> int:
        return self.seq - 1

    # -- helpers the modes call ------------------------------------------------
    def printing(self) -> contextlib.AbstractContextManager[None]:
        """Around tensor printing (``repr``/``str``): torch disables dispatch modes for it, so the
        python engine records none of its ops; the native engine pauses to agree."""
        return contextlib.nullcontext()

    def record_exception(self, e: BaseException, *, seq: Optional[int], call_id: Optional[int], op: Optional[str],
                         info: Optional[Mapping[str, Any]]) -> int:
        """An errors row for exception ``e`` (at op row ``seq`` / call ``call_id``); its id."""
        file, line = user_frame_location(3) if self.want_source else (None, None)
        if call_id is not None and call_id >= 0:
            src = self.rec.calls.field(call_id, C_SRC)
            if src:
                file, line = self.rec.sources.values[src]
        info = info or {}
        msg = info.get("message") or first_line_message(e)
        return self.rec.add_error(
            kind="exception", py_type=type(e).__name__, cpp_type=info.get("cpp_type"), message=msg,
            cpp_file=info.get("cpp_file"), cpp_line=info.get("cpp_line"), cpp_function=info.get("cpp_function"),
            seq=seq, call_id=call_id if (call_id is not None and call_id >= 0) else None, op=op,
            source_file=file, source_line=line, native=bool(info.get("native", False)), count=1,
        )

    def record_warnings(self, ws: Iterable[Mapping[str, Any]], *, call_id: Optional[int], seq: Optional[int],
                        op: Optional[str] = None) -> None:
        """Errors rows of kind "warning" for the warning dicts ``ws`` (native.open_capture()'s format)."""
        rec = self.rec
        file: Optional[str] = None
        line: Optional[int] = None
        if call_id is not None and call_id >= 0:
            src = rec.calls.field(call_id, C_SRC)
            if src:
                file, line = rec.sources.values[src]
        for w in ws:
            wseq = seq if seq is not None else w.get("seq")   # the native engine dates each warning itself
            if wseq is None:
                wseq = self.seq - 1 if self.seq > 0 else None
            wop = op
            if wop is None and wseq is not None and wseq >= 0:
                wop = "?"   # resolved to the op name when the tables are built
            rec.add_error(
                kind="warning", py_type=w.get("category") or "UserWarning", cpp_type=None,
                message=w.get("message"), cpp_file=w.get("cpp_file"), cpp_line=w.get("cpp_line"),
                cpp_function=w.get("cpp_function"), seq=wseq, call_id=call_id if (call_id is not None and call_id >= 0) else None,
                op=None if wop == "?" else wop, source_file=file, source_line=line, native=bool(w.get("native", False)), count=1,
            )


_SEQ = RecordingContext.__dict__["seq"]
_CURRENT_CALL = RecordingContext.__dict__["current_call"]   # the slot, under the property below
_RECORDING = RecordingContext.__dict__["recording"]

#: the fields :class:`NativeRecordingContext` adds
NATIVE_FIELDS: dict[str, str] = {
    "engine": "the NativeEngine: the observer that records the ops (its warnings are drained by the "
              "function mode)",
    "ext": "engine.ext, the compiled extension: seq(), set_call(), set_module(), take_error_seq() (with the "
           "kernel's c10 source location), pause()",
    "fmode": "the C function mode (native.function_mode()) when it records the calls, else None: "
             "``recording`` is forwarded to its set_recording()",
}


class NativeRecordingContext(RecordingContext):
    """The recording context when the native engine observes the ops.

    The modes and the module tracker are the same code for both engines: here the attributes they
    set (``current_call``, ``modules.current``, ``recording``) are forwarded to the observer and the
    C function mode through C setters, and ``seq`` is the observer's row count. No storage tracker
    in Python: the observer tracks storages itself (the engine hands them over at finish).
    """

    __slots__ = tuple(NATIVE_FIELDS)

    engine: ObserverEngine
    ext: Any
    fmode: Any

    def __init__(self, rec: Recorder, op_hooks: OpHooks, engine: ObserverEngine, *, want_source: bool,
                 want_modules: bool, track_storages: bool) -> None:
        self.engine = engine
        self.ext = engine.ext
        self.fmode = None
        super().__init__(rec, op_hooks, want_source=want_source, want_modules=want_modules,
                         track_storages=track_storages)

    @property
    def seq(self) -> int:
        return int(self.ext.seq())

    @seq.setter
    def seq(self, v: int) -> None:
        raise AttributeError("the native observer numbers the ops rows: seq of a native recording context is "
                             "read-only (only the python engine's dispatch mode writes it)")

    @property
    def current_call(self) -> int:
        return int(_CURRENT_CALL.__get__(self))

    @current_call.setter
    def current_call(self, v: int) -> None:
        _CURRENT_CALL.__set__(self, v)
        self.ext.set_call(v)

    @property
    def recording(self) -> bool:
        return bool(_RECORDING.__get__(self))

    @recording.setter
    def recording(self, v: bool) -> None:
        _RECORDING.__set__(self, v)
        if self.fmode is not None:
            self.fmode.set_recording(bool(v))

    def _module_tracker(self) -> ModuleTracker:
        return _NativeModuleTracker(self.rec, self.ext)

    def _storage_tracker(self) -> Optional[Storages]:
        return None   # the observer tracks storages natively; build reads them at finish

    @contextlib.contextmanager
    def printing(self) -> Iterator[None]:
        self.ext.pause(True)
        try:
            yield
        finally:
            self.ext.pause(False)

    def record_exception(self, e: BaseException, *, seq: Optional[int], call_id: Optional[int], op: Optional[str],
                         info: Optional[Mapping[str, Any]]) -> int:
        row = None
        if seq is None:
            row = self.ext.take_error_seq()   # the row whose kernel threw, if an op threw
            if row is not None:
                seq, op = row[0], native_op_name(row[1])
                # the c10 error's source location, read by the observer while it unwound
                info = site_error_info(e, dict(info) if info is not None else None, row[2], row[3], row[4])
        eid = super().record_exception(e, seq=seq, call_id=call_id, op=op, info=info)
        if row is not None:
            self.rec.op_errors[row[0]] = eid   # row[0] is seq here
        return eid


class _NativeModuleTracker(ModuleTracker):
    """The module tracker whose ``current`` is forwarded to the observer (``set_module``)."""

    def __init__(self, rec: Recorder, ext: Any) -> None:
        self._ext = ext
        self._cur = 0
        super().__init__(rec)

    @property
    def current(self) -> int:
        return self._cur

    @current.setter
    def current(self, v: int) -> None:
        self._cur = v
        self._ext.set_module(v)


def native_op_name(native_name: str) -> str:
    """'aten::add.Tensor' -> 'aten.add.Tensor' (str(OpOverload))."""
    return native_name.replace("::", ".", 1)


def first_line_message(e: BaseException) -> str:
    """``str(e)``, or ``repr(e)`` when ``str`` raises."""
    try:
        msg = str(e)
    except Exception:
        msg = repr(e)
    return msg
