"""``tensorscope.schedule``: windowed tracing of a long loop, one Trace per active window.

Like ``torch.profiler.schedule``: after ``skip_first`` steps, cycles of ``wait`` steps
untraced, ``warmup`` steps untraced (kept so a torch.profiler schedule ports unchanged:
tensorscope needs no warm-up, the steps only run before the window), then ``active`` steps
traced into one Trace; ``repeat`` cycles (0: until the loop ends). The loop calls
``s.step()`` at the end of each step::

    with tensorscope.schedule(wait=1, warmup=1, active=2, repeat=2) as s:
        for batch in loader:
            train_step(batch)
            s.step()
    s.traces          # [Trace, Trace]: steps 2-3 and 6-7
    s.advice()        # the advisor over every window

Built on the public ``trace()``: every window takes the trace options given (``dataset=``
writes each window into the dataset as its own trace; ``expect=`` checks each window).

A window whose trace could not spill (its disk filled: ``SpillError``) never stops the loop: the
window's trace is kept whole in ``traces``, no further window is opened (it would fill the same
disk), and the ``SpillError`` is raised by the ``with`` statement after the loop, as ``trace()``
raises it after its block (a ``RuntimeWarning`` instead when the loop raised).
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from .errors import OptionsError, SpillError
from .options import resolve

__all__ = ["schedule", "Schedule"]


class Schedule:
    """The windows of one loop: ``traces`` (one per active window) and ``windows`` (their steps)."""

    def __init__(self, *, wait: int = 0, warmup: int = 0, active: int = 1, repeat: int = 0, skip_first: int = 0,
                 **trace_options: Any) -> None:
        for name, v, low in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1),
                             ("repeat", repeat, 0), ("skip_first", skip_first, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise OptionsError(f"schedule({name}=...) must be an integer >= {low}, not {v!r}")
        self.wait, self.warmup, self.active, self.repeat, self.skip_first = wait, warmup, active, repeat, skip_first
        self.options, self.display = resolve(None, None, trace_options)   # a bad option fails before the loop
        self.traces: list[Any] = []
        self.windows: list[list[int]] = []
        self._step = 0
        self._open: Optional[Any] = None
        self._entered = False
        #: the SpillError of a window that could not spill: raised after the loop (no window opens after it)
        self.spill_error: Optional[SpillError] = None

    # -- which step does what ----------------------------------------------------------------
    def action(self, step: int) -> str:
        """``skip`` / ``wait`` / ``warmup`` / ``active`` / ``done`` for step ``step`` (0-based)."""
        if step < self.skip_first:
            return "skip"
        k = step - self.skip_first
        cycle = self.wait + self.warmup + self.active
        if self.repeat and k // cycle >= self.repeat:
            return "done"
        pos = k % cycle
        if pos < self.wait:
            return "wait"
        if pos < self.wait + self.warmup:
            return "warmup"
        return "active"

    @property
    def steps(self) -> list[int]:
        """Steps each window traced (the advisor's per-step counts divide by them)."""
        return [len(w) for w in self.windows]

    @property
    def current_step(self) -> int:
        return self._step

    # -- the loop ------------------------------------------------------------------------------
    def __enter__(self) -> Schedule:
        if self._entered:
            raise OptionsError("a tensorscope.schedule runs one loop; make a new one for another loop")
        self._entered = True
        self._begin()
        return self

    def step(self) -> None:
        """The current step has ended: close its window if it was the window's last, start the next one's."""
        if not self._entered:
            raise OptionsError("call step() inside `with tensorscope.schedule(...) as s:`")
        self._step += 1
        if self._open is not None and (self.action(self._step) != "active" or self._window_start(self._step)):
            self._close(None, None, None)
        self._begin()

    def __exit__(self, et: Optional[type[BaseException]], ev: Optional[BaseException], tb: Any) -> Literal[False]:
        if self._open is not None:
            # the loop ended after step(): the step step() began never ran (with an error, it did)
            phantom = ev is None and self._step > 0 and self.windows and self.windows[-1] == [self._step]
            if ev is None and self._step > 0 and self.windows and self.windows[-1][-1] == self._step:
                self.windows[-1].pop()
            self._close(et, ev, tb)
            if phantom and self.traces:
                self.traces.pop()
                self.windows.pop()
        err, self.spill_error = self.spill_error, None
        if err is not None:
            if ev is None:
                raise err
            import warnings

            warnings.warn(f"{err} (the loop raised: its exception is reported, this is a warning)", RuntimeWarning,
                          stacklevel=2)
        return False

    def _window_start(self, step: int) -> bool:
        """Step ``step`` is the first active step of a cycle (consecutive windows when wait+warmup is 0)."""
        if step < self.skip_first:
            return False
        k = step - self.skip_first
        cycle = self.wait + self.warmup + self.active
        return k % cycle == self.wait + self.warmup

    def _begin(self) -> None:
        if self._open is None and self.spill_error is None and self.action(self._step) == "active":
            from .recording.session import trace

            tr = trace(self.options, display=self.display)
            tr.__enter__()
            self._open = tr
            self.windows.append([])
        if self._open is not None:
            self.windows[-1].append(self._step)

    def _close(self, et: Any, ev: Any, tb: Any) -> None:
        tr, self._open = self._open, None
        assert tr is not None
        try:
            tr.__exit__(et, ev, tb)
        except SpillError as e:
            if self.spill_error is None:   # the loop goes on; the with statement raises it after the loop
                self.spill_error = e
        finally:
            try:
                res = tr.result
            except AttributeError:
                res = None
            if res is not None:
                self.traces.append(res)
            elif self.windows:
                self.windows.pop()

    # -- results ---------------------------------------------------------------------------------
    def advice(self, **kw: Any) -> Any:
        """``tensorscope.advise(self)``: the advisor over every window."""
        from ._advice import advise

        return advise(self, **kw)

    def __repr__(self) -> str:
        return (f"<tensorscope.schedule wait={self.wait} warmup={self.warmup} active={self.active} "
                f"repeat={self.repeat}: {len(self.traces)} window(s), step {self._step}>")


def schedule(*, wait: int = 0, warmup: int = 0, active: int = 1, repeat: int = 0, skip_first: int = 0,
             **trace_options: Any) -> Schedule:
    """A ``Schedule`` (use it as ``with tensorscope.schedule(...) as s:`` and call ``s.step()`` per step);
    ``trace_options`` are ``trace()``'s keywords, applied to every window."""
    return Schedule(wait=wait, warmup=warmup, active=active, repeat=repeat, skip_first=skip_first, **trace_options)
