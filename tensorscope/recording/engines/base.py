"""The engine seam: what a recording engine is (:class:`Engine`), and the choice of one.

An engine observes the ATen ops of one trace. The session drives it through this protocol
only, never asking which engine it is::

    ctx = engine.make_context(rec, op_hooks, options)   # the recording context its observers share
    fmode = engine.function_mode(ctx)                   # the torch-level calls' mode (entered by the session)
    engine.setup_probes(ctx, options)                   # its own per-op probes (screen, CUDA timer, error sites)
    engine.start(ctx, options)                          # install the observer (after the function mode)
    engine.stop()                                       # remove it, first thing on exit; idempotent
    engine.finish(ctx)                                  # hand what it recorded to ctx.rec

Everything an engine keeps between those calls is the context (never the session).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from ...options import TraceOptions
    from ..context import RecordingContext
    from ..ophooks import OpHooks
    from ..protocols import FunctionMode
    from ..recorder import Recorder


@dataclass
class EngineChoice:
    """Which engine a trace records with, and why (``t.metadata["engine"]``, ``["engine_reason"]``)."""

    name: str                 # "native" / "python"
    reason: str               # why (always set; shown in the summary when it is the fallback)
    ext: Any = None           # the native extension module


class Engine(Protocol):
    """A recording engine (``engines/python/``, ``engines/native/``)."""

    name: str
    choice: EngineChoice

    def make_context(self, rec: Recorder, op_hooks: OpHooks, options: TraceOptions) -> RecordingContext:
        """The recording context of one trace, for this engine's observers."""

    def function_mode(self, ctx: RecordingContext) -> FunctionMode:
        """The TorchFunctionMode that records the torch-level calls (not yet entered)."""

    def setup_probes(self, ctx: RecordingContext, options: TraceOptions) -> None:
        """Install this engine's per-op probes on ``ctx`` (never raises: a probe that cannot be
        made is a note)."""

    def start(self, ctx: RecordingContext, options: TraceOptions) -> None:
        """Start observing ops (the function mode is entered already)."""

    def stop(self) -> None:
        """Stop observing; idempotent, also on errors and KeyboardInterrupt."""

    def finish(self, ctx: RecordingContext) -> None:
        """After stop: hand everything recorded to ``ctx.rec`` (and ``ctx``'s probes)."""

    def release(self) -> None:
        """Once the Trace is built: drop what the engine holds of the recording (its context), so
        that nothing of it waits for the garbage collector. Idempotent, never raises."""


def exit_mode(mode: Any, stack_fn: Callable[[], Sequence[Any]]) -> None:
    """Pop ``mode``, also when user code left other modes above it (they are re-pushed)."""
    stack = stack_fn()
    if not any(m is mode for m in stack):
        return
    above: list[Any] = []
    if stack and stack[-1] is not mode:
        while stack_fn() and stack_fn()[-1] is not mode:
            top = stack_fn()[-1]
            top.__exit__(None, None, None)
            above.append(top)
    mode.__exit__(None, None, None)
    for m in reversed(above):
        m.__enter__()
