"""``tensorscope.advise(trace_or_traces)``: why a traced block is slow, as an ``Advice`` (data).

The computation is ``analyses.advisor.advise_tables`` (pure, over the tables); this module
gathers what it needs from one or several traces (the windows of ``tensorscope.schedule``,
or a list), the machine peaks (those the trace recorded in its device report, else this
machine's, measured once and cached: ``_peaks.machine_peaks``), and the step counts. The
result draws itself through ``render/sections_advice.py``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import pyarrow as pa

from ._common import Displayable
from .errors import OptionsError

__all__ = ["advise", "Advice"]


@dataclass
class Advice(Displayable):
    """The advisor's result: ``findings`` (ADVICE), ``syncs`` (SYNCS), ``roofline`` (ROOFLINE) tables,
    the time outside ops per window, the GPU idle split, the steps and the peaks used."""

    findings: pa.Table
    syncs: pa.Table
    roofline: pa.Table
    outside: list[Optional[dict[str, Any]]]
    gpu_idle: list[dict[str, Any]]
    steps: Optional[int]
    peaks: dict[str, dict[str, Any]]
    peaks_source: str
    n_windows: int = 1
    notes: list[str] = field(default_factory=list)
    #: the traces' wall time from enter to exit (the base of every percentage), their op time and how much
    #: of it was first executions (``ops.first_run``)
    wall_ns: int = 0
    op_ns: int = 0
    first_run_ns: int = 0
    #: the op time was mostly first executions: the only finding is ``first_run``
    cold: bool = False
    #: a prediction (``metadata["predicted"]``): no timing-based finding
    predicted: bool = False
    #: the time a thread of the process waited for a CPU in the traces (the longer of ``metadata["run_delay_ns"]``
    #: and ``["worker_run_delay_ns"]``: other processes' time, which the op times hold), and the findings read
    #: from op times it could explain whole (left out)
    run_delay_ns: int = 0
    busy_left: int = 0
    min_share: float = 0.01

    def section(self) -> Any:
        from .render.sections_advice import advice_to_section

        return advice_to_section(self)

    def to_text(self) -> str:
        from .render.section import Summary

        return Summary([self.section()]).to_text()

    def to_html(self) -> str:
        from .render.section import Summary

        return Summary([self.section()]).to_html()

    def rows(self, i: int) -> Any:
        """Every ``ops.seq`` finding ``i`` names, in order (a numpy array): its ``row_starts``/``row_counts``
        runs expanded."""
        from .analyses.findings import expand_runs

        r = self.findings.slice(i, 1).select(["row_starts", "row_counts"]).to_pylist()[0]
        return expand_runs(r["row_starts"] or [], r["row_counts"] or [])

    def to_arrow(self) -> pa.Table:
        """The findings (schema ``ADVICE``), as the views' ``to_arrow()``."""
        return self.findings

    def to_pandas(self) -> Any:
        """The findings as a pandas DataFrame."""
        from .render.views import TableView

        return TableView(self.findings, "advice").to_pandas()


def _is_trace(x: Any) -> bool:
    # duck-typed: importing _trace here would make a cycle (Trace.advice calls advise)
    return not isinstance(x, (list, tuple)) and all(hasattr(x, n) for n in ("ops", "calls", "kernels", "metadata"))


def _traces(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        out: list[Any] = []
        for t in x:
            out.extend(_traces(t))
        return out
    inner = getattr(x, "traces", None)     # a tensorscope.schedule
    if isinstance(inner, list):
        return list(inner)
    if _is_trace(x):
        return [x]
    raise OptionsError(f"advise() takes a Trace, a list of Traces or a tensorscope.schedule, not {type(x).__name__}")


def _peaks_of(traces: Sequence[Any]) -> tuple[dict[str, dict[str, Any]], str]:
    for t in traces:
        dev = (t.metadata.get("device") or {})
        rec = dev.get("peaks") if hasattr(dev, "get") else None
        if rec:
            from ._peaks import RECIPE, machine_peaks, same_machine

            out = {k: dict(v) for k, v in rec.items()}
            cpu = out.get("cpu") or {}
            if cpu and same_machine(cpu) and (cpu.get("recipe") != RECIPE or cpu.get("contended")):
                # recorded here by an older recipe or beside a load: this machine's peaks, measured again
                # when the cached ones are contended (at most once per _peaks.RETRY_S), if they are better
                now = machine_peaks("cpu")
                if now and (cpu.get("recipe") != RECIPE or (not now.get("contended")
                                                            and now.get("measured_at") != cpu.get("measured_at"))):
                    out["cpu"] = now
                    return out, "measured again on this machine (the recorded peaks were measured under load)"
            return out, "recorded with the trace (cached peaks of its machine)"
    from ._peaks import all_peaks

    p = all_peaks(measure=True)
    return p, "measured on this machine" if p else "none (could not measure: a profiler was running)"


def advise(traces: Any, *, peaks: Optional[dict[str, dict[str, Any]]] = None,
           steps: Union[None, int, Sequence[Optional[int]]] = None, min_share: Optional[float] = None) -> Advice:
    """The advisor's findings for ``traces``: a ``Trace``, a list of them, or a ``tensorscope.schedule``.

    ``peaks``: ``{"cpu": machine_peaks("cpu"), ...}`` to use instead of the recorded/measured ones;
    ``steps``: training steps per trace (one int for a single trace, one per trace for a list), else
    the schedule's, else the outermost ``backward`` calls of each trace; ``min_share``: the least cost of a
    performance finding as a share of the op time (``DisplayOptions().min_finding_share`` when None).

    Peaks measured on this machine that a traced op beats are measured again (``_peaks``), and the advice
    is drawn again with them."""
    from .analyses.advisor import advise_tables
    from .analyses.roofline import beats_peak
    from .options import DisplayOptions

    if min_share is None:
        min_share = DisplayOptions().min_finding_share
    elif isinstance(min_share, bool) or not isinstance(min_share, (int, float)) or not 0 <= min_share <= 1:
        raise OptionsError(f"min_share must be a number from 0 to 1, not {min_share!r}")
    ts = _traces(traces)
    sched_steps = getattr(traces, "steps", None)
    if steps is None and isinstance(sched_steps, (list, tuple)):
        steps = list(sched_steps)
    if isinstance(steps, int) and not isinstance(steps, bool):
        if len(ts) != 1:
            raise OptionsError("steps=N takes one trace; give one count per trace for a list")
        steps_each: list[Optional[int]] = [steps]
    elif steps is None:
        steps_each = [None] * len(ts)
    else:
        steps_each = list(steps)  # type: ignore[arg-type]
        if len(steps_each) != len(ts):
            raise OptionsError(f"steps has {len(steps_each)} entries for {len(ts)} traces")
    if peaks is None:
        pk, source = _peaks_of(ts)
    else:
        pk, source = dict(peaks), "given"
    wins = [{"ops": t.ops, "calls": t.calls, "kernels": t.kernels, "layout_changes": t.layout_changes,
             "wall_ns": t.metadata.get("wall_ns"), "steps": s, "engine": t.metadata.get("engine"),
             "run_delay_ns": t.metadata.get("run_delay_ns"), "tracer_op_ns": t.metadata.get("tracer_op_ns"),
             "worker_run_delay_ns": t.metadata.get("worker_run_delay_ns"),
             "cells": dict(t.metadata.get("cell_files") or {}),
             "flops_known": bool((t.metadata.get("options") or {}).get("flops", True))}
            for t, s in zip(ts, steps_each)]
    predicted = any(bool(t.metadata.get("predicted")) for t in ts)
    speedup = _same_shape_speedup if (peaks is None and _measured_here(pk)) else None
    out = advise_tables(wins, pk, min_share=min_share, predicted=predicted, speedup=speedup)
    notes = []
    beaten = beats_peak(out["roofline"]) if (peaks is None and not predicted) else {}
    if beaten.get("cpu") and _measured_here(pk):
        # an op ran faster than the cached peak: the peak was measured badly (a busy machine); measure again
        from ._peaks import machine_peaks

        old = (pk.get("cpu") or {}).get("flops") or {}
        fresh = machine_peaks("cpu", refresh=True)
        if fresh:
            pk = dict(pk, cpu=fresh)
            source = "measured again on this machine (an op beat the cached peak)"
            notes.append("the cached cpu peak (" + ", ".join(f"{k} {old.get(k, 0) / 1e9:.1f} GFLOP/s" for k in beaten["cpu"])
                         + ") was below what a traced op reached: measured again")
            out = advise_tables(wins, pk, min_share=min_share, predicted=predicted, speedup=speedup)
    if predicted:
        notes.append("predicted (FakeTensorMode): the times are not measured, so no timing-based finding is made "
                     "and structural findings carry no cost")
    for dev, p in sorted(pk.items()):
        if p.get("contended"):
            notes.append(f"the {dev} peaks were measured beside a competing load ("
                         + "; ".join(p.get("contended_why") or ["low CPU share"])
                         + "): roof fractions may read high; they are measured again on the next advice")
    if not all(w["flops_known"] for w in wins):
        notes.append("recorded with flops=False: no roofline bound (a matmul without its FLOPs would look "
                     "memory-bound)")
    if not ts:
        notes.append("no trace to advise on")
    return Advice(findings=out["findings"], syncs=out["syncs"], roofline=out["roofline"], outside=out["outside"],
                  gpu_idle=out["gpu_idle"], steps=out["steps"], peaks=pk, peaks_source=source, n_windows=len(ts),
                  notes=notes, wall_ns=sum(int(w["wall_ns"] or 0) for w in wins), op_ns=out["op_ns"],
                  first_run_ns=out["first_run_ns"], cold=out["cold"], predicted=predicted, min_share=min_share,
                  run_delay_ns=out["run_delay_ns"], busy_left=out["busy_left"])


def _measured_here(pk: dict[str, dict[str, Any]]) -> bool:
    """Whether the cpu peaks are this machine's (with these threads and torch): only then are they re-measured."""
    from ._peaks import same_machine

    p = pk.get("cpu")
    return p is not None and same_machine(p, "cpu")


def _same_shape_speedup(shape: tuple[int, int, int, int]) -> Optional[tuple[str, float, str]]:
    from ._peaks import gemm_speedup

    return gemm_speedup(shape)
