"""The Protocols of the engine-specific pairs: what the context's fields hold under either engine.

Each pair is one concept with a python and a native implementation; the recording context types
its fields with these (``context.py``), so a caller that holds either sees the same surface:

* :class:`Storages` -- ``tracking.storages.StorageTracker`` (python engine) / ``NativeStorages``
  (native engine, at finish): the storages the leak finder reads;
* :class:`Screen` -- ``NonfiniteScreen`` / ``NativeScreen``: the non-finite screen as the table build
  and the summary read it; :class:`OpScreen` adds the per-op calls only the python engine makes;
* :class:`Capture` -- ``native._fallback.FallbackCapture`` / ``native._capture.NativeCapture``: the
  warning/error capture the modes call; :class:`NativeSiteCapture` adds what the native engine arms;
* :class:`FunctionMode` -- ``TracingFunctionMode`` / ``NativeFunctionMode``: the torch-level calls' mode;
* :class:`Shadow` -- the numerics shadow (``numerics=``, the python engine's only).

The two contexts need no Protocol: ``NativeRecordingContext`` is a ``RecordingContext`` (the same
fields, some forwarded to the observer), and a write the native one cannot keep raises.

This module imports nothing of tensorscope: it sits below the context and both engines.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Callable, Optional, Protocol


class Storages(Protocol):
    """The storages of a trace as the finish reads them (leaks); their records (data pointers
    included) are the recorder's ``tensors`` (``storage_rows.StorageRows``)."""

    def live_created(self) -> list[tuple[int, Any]]:
        """(storage id, weak reference) of the storages created by the trace and still alive."""
        ...

    def close(self) -> None:
        """Stop watching (idempotent)."""
        ...


class Screen(Protocol):
    """The non-finite screen of a trace as the table build and the summary read it."""

    def screens(self, func: object) -> bool:
        """Whether ``func``'s outputs are screened at all (its ``nonfinite`` cells are not null)."""
        ...

    def finish(self) -> dict[int, tuple[int, bool]]:
        """Verdicts resolved at the end: ``{seq: (count, produced)}``."""
        ...

    def report(self) -> dict[str, Any]:
        """The counters for ``t.metadata``."""
        ...


class OpScreen(Screen, Protocol):
    """The python engine's screen, which its dispatch mode calls around each op."""

    def pre(self, func: object, args: Sequence[object], kwargs: Optional[Mapping[str, object]],
            inplace: bool = True) -> object:
        ...

    def post(self, seq: int, func: object, args: Sequence[object], kwargs: Optional[Mapping[str, object]],
             outs: Sequence[Any], state: Any) -> Optional[tuple[int, bool]]:
        ...


class Capture(Protocol):
    """The warning/error capture of a trace (``native.open_capture()``)."""

    #: whether it is the C++ hooks' capture
    native: bool
    #: the native recording engine when it records this trace (call_end drains its warnings)
    engine: Any
    #: per op, around the kernel (the python engine's dispatch mode)
    op_begin: Callable[[], object]
    op_end: Callable[[], Any]

    @property
    def description(self) -> str: ...

    def call_begin(self, func: object = None) -> Optional[int]: ...

    def call_end(self, token: Any) -> Optional[list[dict[str, Any]]]: ...

    def count_call_warnings(self, fn: object) -> None: ...

    def take_call_warnings(self, n_tap: int, engine: object = None) -> list[dict[str, Any]]: ...

    def error_info(self, exc: Optional[BaseException]) -> Optional[dict[str, Any]]: ...

    def swallowed_count(self) -> Optional[int]: ...

    def close(self) -> None: ...


class NativeSiteCapture(Capture, Protocol):
    """The C++ hooks' capture: it also arms the native engine's c10 error sites."""

    #: why error sites are not armed ("ok" when they are)
    sites_reason: str

    def arm_error_sites(self, engine: object) -> bool: ...


class FunctionMode(Protocol):
    """The mode that records the torch-level calls (a TorchFunctionMode; entered by the session)."""

    def __enter__(self) -> object: ...

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> object: ...


class Shadow(Protocol):
    """The numerics shadow (``numerics=``): re-runs each op in higher precision."""

    def compare(self, seq: int, func: object, args: Sequence[object], kwargs: Optional[Mapping[str, object]],
                outs: Sequence[Any]) -> Optional[tuple[float, float]]: ...

    def report(self) -> dict[str, Any]: ...
