"""On a busy machine the op times hold other processes' time: the recording thread waited for a CPU
(``metadata["run_delay_ns"]``, Linux schedstat) inside the ops too. A roofline finding (compute_bound,
memory_bound, below_roof, amp) that this wait could explain whole is not proven by the rows: it is left
out, and the advisor says how many and why; the headline's totals say the machine was busy. (A cell
traced beside a compiler read "1. below_roof: aten.convolution_backward ... 2% of the cpu roof" as the
first thing to look at, with the thread having waited 247 ms of the 531 ms wall for a CPU.)"""
from __future__ import annotations

import pytest
import torch

import tensorscope
from tensorscope._trace import Trace

ROOF_KINDS = {"compute_bound", "memory_bound", "below_roof", "amp"}


@pytest.fixture(scope="module")
def gemm_trace() -> Trace:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    x = torch.randn(512, 512)
    with torch.no_grad():
        for _ in range(2):   # the second trace is warm: no first executions in its timings
            with tensorscope.trace(leaks=False) as t:
                for _ in range(3):
                    mlp(x)
    return t.result


def _with_delay(t: Trace, delay_ns: int, wall_ns: int = 0) -> Trace:
    md = t.metadata.replace(run_delay_ns=delay_ns, worker_run_delay_ns=delay_ns,
                            **({"wall_ns": wall_ns} if wall_ns else {}))
    return Trace(t.tables, md)


def _roof(t: Trace, peaks: dict) -> list[dict]:
    return [f for f in t.advice(peaks=peaks).findings.to_pylist() if f["kind"] in ROOF_KINDS]


def test_a_finding_the_wait_could_explain_is_left_out_and_said(gemm_trace):
    peaks = {"cpu": tensorscope._peaks.machine_peaks()}
    calm = _roof(_with_delay(gemm_trace, 0), peaks)
    assert calm, "a gemm-heavy cell has a roofline finding"
    cost = max(f["cost_ns"] for f in calm)
    wall = gemm_trace.metadata.wall_ns
    # a wait shorter than each finding's cost and than a tenth of the wall: all stay
    short = _with_delay(gemm_trace, min(min(f["cost_ns"] for f in calm) // 4, wall // 20))
    assert [f["subject"] for f in _roof(short, peaks)] == [f["subject"] for f in calm]
    assert short.advice(peaks=peaks).busy_left == 0
    assert "read from op times left out" not in short.advice(peaks=peaks).to_text()
    # a wait as long as every finding's cost (in a block whose wall is long enough for it to be under a
    # tenth of it): none is proven by the op times
    long_wall = _with_delay(gemm_trace, cost, wall_ns=20 * cost + wall)
    adv = long_wall.advice(peaks=peaks)
    assert _roof(long_wall, peaks) == [] and adv.busy_left == len(calm)
    n = len(calm)
    text = adv.to_text()
    assert f"{n} finding{'s' * (n != 1)} read from op times left out: the thread waited " in text
    assert f"as much as {'each' if n != 1 else 'it'} cost; run the cell again on an idle machine" in text
    # a wait of a tenth of the wall or more: a busy machine, no finding read from op times at all
    busy = _with_delay(gemm_trace, wall // 2)
    adv = busy.advice(peaks=peaks)
    assert _roof(busy, peaks) == [] and adv.busy_left == len(calm)
    assert "hold), 50% of the wall; run the cell again on an idle machine" in adv.to_text()


def _totals(t: Trace) -> tuple[str, list[str]]:
    lines = t.summary().to_text().splitlines()
    (totals,) = [line for line in lines[:8] if " in ops of " in line and " wall" in line]
    return totals, lines


def test_the_headline_says_the_machine_was_busy(gemm_trace):
    wall = gemm_trace.metadata.wall_ns
    totals, lines = _totals(_with_delay(gemm_trace, wall // 50))   # under a tenth of the wall: only in the numbers
    assert "for a CPU" not in totals
    assert any(line.strip().startswith("waiting for a CPU: ") for line in lines)
    totals, _ = _totals(_with_delay(gemm_trace, wall // 2))
    assert " wall · waited " in totals
    assert totals.split(" wall · waited ")[1].split(" · ")[0].endswith("for a CPU (a busy machine)")
    totals, lines = _totals(_with_delay(gemm_trace, 0))
    assert "for a CPU" not in totals and not any("waiting for a CPU" in line for line in lines)


def test_a_quiet_machine_is_no_likely_reason_for_a_slow_kernel(gemm_trace):
    """below_roof's generic reason named "a competing load" and its fix "run the cell again on an idle
    machine" also when the thread was measured not to wait for a CPU: a fix that does not apply."""
    far = {"cpu": {"flops": {"float32": 1e18}, "bytes_per_s": 1e18, "overhead_ns": None}}   # every op far below

    def below(t: Trace) -> dict:
        (f,) = [f for f in t.advice(peaks=far).findings.to_pylist() if f["kind"] == "below_roof"]
        return f
    quiet = below(_with_delay(gemm_trace, 0))
    assert "competing load" not in quiet["seen"] and "idle machine" not in quiet["fix"]
    assert quiet["fix"].endswith("check torch.get_num_threads() and the input layouts (strides, memory format) of these calls")
    unknown = below(_with_delay(gemm_trace, None))   # not measured (not Linux, or an older trace)
    assert "or a competing load while the trace ran" in unknown["seen"]
    assert "run the cell again on an idle machine to confirm" in unknown["fix"]
