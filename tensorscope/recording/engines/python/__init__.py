"""The python engine: ``engines/python/dispatch.py``'s TorchDispatchMode records every ATen op.

The fallback when nothing can be compiled, the engine of ``numerics=`` (the shadow mode
re-runs ops in Python) and the test oracle the native engine is compared with.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...context import RecordingContext
from ..base import EngineChoice, exit_mode

if TYPE_CHECKING:
    from ....options import TraceOptions
    from ...ophooks import OpHooks
    from ...protocols import FunctionMode
    from ...recorder import Recorder


class PythonEngine:
    """The python engine behind the ``Engine`` seam: a TorchDispatchMode records the ops and a
    TorchFunctionMode the calls, both in Python."""

    name = "python"

    def __init__(self, choice: EngineChoice) -> None:
        self.choice = choice
        self._mode: Any = None   # a TracingDispatchMode (torch's TorchDispatchMode is unannotated)

    def make_context(self, rec: Recorder, op_hooks: OpHooks, options: TraceOptions) -> RecordingContext:
        return RecordingContext(rec, op_hooks, want_source=options.source, want_modules=options.modules,
                                track_storages=options.storages)

    def function_mode(self, ctx: RecordingContext) -> FunctionMode:
        from ...function import TracingFunctionMode

        return TracingFunctionMode(ctx)

    def setup_probes(self, ctx: RecordingContext, options: TraceOptions) -> None:
        if options.nonfinite:
            try:
                from .numerics import NonfiniteScreen

                ctx.screen = NonfiniteScreen()
            except Exception as e:
                ctx.rec.notes.append(f"non-finite screen unavailable: {e}")
        if options.fingerprints:
            from ...fingerprint import Fingerprinter

            ctx.fingerprints = Fingerprinter()
        import torch

        if options.cuda_timing and torch.cuda.is_available():
            try:
                from ....timing.cuda import CudaOpTimer

                ctx.cuda_timer = CudaOpTimer()
            except Exception as e:
                ctx.rec.notes.append(f"CUDA timing unavailable: {e}")

    def start(self, ctx: RecordingContext, options: TraceOptions) -> None:
        from .dispatch import TracingDispatchMode

        self._mode = TracingDispatchMode(ctx)
        self._mode.__enter__()

    def stop(self) -> None:
        if self._mode is None:
            return
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        mode, self._mode = self._mode, None
        exit_mode(mode, _get_current_dispatch_mode_stack)

    def finish(self, ctx: RecordingContext) -> None:
        pass   # the dispatch mode appended its rows to ctx.rec as the ops ran

    def release(self) -> None:
        self._mode = None   # stop() dropped it already, unless stop never ran
