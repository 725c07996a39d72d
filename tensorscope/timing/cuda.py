"""CUDA time per op: a pair of CUDA events around each op, resolved once per trace.

Fills ``ops.cuda_ns`` without synchronising per op: ``CudaOpTimer`` (``begin_for`` / ``begin``
at dispatch, ``end`` in ``finally``, ``resolve`` at the end of the trace: one synchronise per
used device). The dispatch mode (``recording/engines/python/dispatch.py``) calls it; its event, stream and
synchronise hooks are injectable so the bookkeeping is testable without a GPU.

Rules and details: docs/development/timing.md
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

__all__ = ["CudaOpTimer"]


def _default_event():
    import torch

    return torch.cuda.Event(enable_timing=True)


class _StreamCache:
    """``torch.cuda.current_stream(d)`` without its Python overhead on every op.

    ``torch._C._cuda_getCurrentStream`` returns the packed ``(stream_id,
    device_index, device_type)`` of the current stream; the ``Stream`` object
    for a given packed value is built once and reused.
    """

    def __init__(self):
        import torch

        self._get = getattr(torch._C, "_cuda_getCurrentStream", None)
        self._streams: dict[tuple, Any] = {}

    def __call__(self, device_index):
        import torch

        get = self._get
        if get is None:
            return torch.cuda.current_stream(device_index)
        key = get(device_index)
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        return s


def _default_sync(device_index):
    import torch

    torch.cuda.synchronize(device_index)


def _default_capturing(device_index):
    import torch

    return torch.cuda.is_current_stream_capturing()


class CudaOpTimer:
    """Per-trace CUDA event pairs (the protocol and its rules: docs/development/timing.md)."""

    __slots__ = ("_new_event", "_stream", "_sync", "_capturing", "_pending", "_pool", "_devices",
                 "max_pending", "notes", "dropped", "_closed")

    def __init__(self, *, event_factory: Optional[Callable[[], Any]] = None,
                 current_stream: Optional[Callable[[int], Any]] = None,
                 synchronize: Optional[Callable[[int], None]] = None,
                 is_capturing: Optional[Callable[[int], bool]] = None,
                 max_pending: int = 2_000_000):
        self._new_event = event_factory or _default_event
        self._stream = current_stream or _StreamCache()
        self._sync = synchronize or _default_sync
        self._capturing = is_capturing or _default_capturing
        self._pending: list[list] = []
        self._pool: list[Any] = []
        self._devices: set = set()
        #: a bound on outstanding pairs (two events each): past it, ops go untimed rather than exhausting the driver
        self.max_pending = max_pending
        self.notes: list[str] = []
        self.dropped = 0
        self._closed = False

    # -- hot path ---------------------------------------------------------------
    def begin_for(self, seq: int, tensors: Sequence[Any], kwargs: Optional[dict] = None):
        """Start timing op ``seq`` if one of its tensors (or a ``device=`` kwarg) is on CUDA; else None.

        The first CUDA tensor decides the device (ops with inputs on several
        CUDA devices are rejected by ATen itself, except scalars-as-tensors).
        Never raises: a tracer failure here must not reach the user's op.
        """
        try:
            for t in tensors:
                if t.is_cuda:
                    return self.begin(seq, t.get_device())
            if kwargs:
                dev = kwargs.get("device")
                if dev is not None and getattr(dev, "type", None) == "cuda":
                    idx = dev.index
                    if idx is None:
                        import torch

                        idx = torch.cuda.current_device()
                    return self.begin(seq, idx)
        except Exception as e:
            self._failed("begin", e)
        return None

    def begin(self, seq: int, device_index: int):
        """Record a start event on the current stream of ``device_index``; returns the token (or None)."""
        if self._closed or len(self._pending) >= self.max_pending:
            self.dropped += 1
            return None
        try:
            if self._capturing(device_index):
                return None
            stream = self._stream(device_index)
            pool = self._pool
            ev = pool.pop() if pool else self._new_event()
            ev.record(stream)
        except Exception as e:
            self._failed("begin", e)
            return None
        tok = [seq, ev, None, stream, device_index]
        self._pending.append(tok)
        self._devices.add(device_index)
        return tok

    def end(self, token) -> None:
        """Record the end event on the stream the start was recorded on (the op's stream)."""
        if token is None or token[2] is not None:
            return
        pool = self._pool
        try:
            ev = pool.pop() if pool else self._new_event()
            ev.record(token[3])
        except Exception as e:
            self._failed("end", e)
            return
        token[2] = ev

    def _failed(self, where: str, e: BaseException) -> None:
        if len(self.notes) < 20:
            self.notes.append(f"CUDA event {where} failed: {type(e).__name__}: {e}")

    # -- end of trace -------------------------------------------------------------
    def resolve(self) -> dict[int, int]:
        """One synchronise per used device, then ``{seq: cuda_ns}`` for every complete pair.

        Pairs without an end event (the op raised before ``end``), or whose
        events cannot be read, are left out: ``cuda_ns`` stays null for them.
        Events go back to the pool, so a long always-on session reuses them.
        """
        pending, self._pending = self._pending, []
        devices, self._devices = sorted(self._devices), set()
        if not pending:
            return {}
        for d in devices:
            try:
                self._sync(d)
            except Exception as e:  # a sticky device error from the user's kernels: no timings, no crash
                self.notes.append(f"CUDA op timings dropped: synchronize(cuda:{d}) failed: {type(e).__name__}: {e}")
                return {}
        out: dict[int, int] = {}
        skipped = 0
        pool = self._pool
        for tok in pending:
            seq, ev0, ev1 = tok[0], tok[1], tok[2]
            if ev1 is None:
                skipped += 1
                pool.append(ev0)
                continue
            try:
                ms = ev0.elapsed_time(ev1)
            except Exception:
                skipped += 1
            else:
                ns = int(round(ms * 1e6))
                # a pair reads the GPU time between two points of one stream: it can't be negative
                out[seq] = ns if ns >= 0 else 0
            pool.append(ev0)
            pool.append(ev1)
            tok[1] = tok[2] = tok[3] = None
        if skipped:
            self.notes.append(f"{skipped} CUDA op(s) have no CUDA time (the op raised before its end event)")
        if self.dropped:
            self.notes.append(f"{self.dropped} CUDA op(s) were not timed (more than {self.max_pending} pending pairs)")
            self.dropped = 0
        # keep the pool bounded: a huge trace must not pin its events forever
        del pool[65536:]
        return out

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Drop every event; the timer refuses new pairs afterwards."""
        self._closed = True
        self._pending = []
        self._pool = []
