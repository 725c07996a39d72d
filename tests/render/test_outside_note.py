"""The advisor's note on the time outside ops states what was measured: the gaps between ops against
the wall time, never less than they were. On a busy machine the time the thread waited for a CPU
(``metadata["run_delay_ns"]``) may explain the gaps: the note says how much of them, and only the
rest counts toward the ``outside_ops`` finding (it once read "0 ns ... was outside ops" beside a
headline whose own numbers left milliseconds between the ops)."""
from __future__ import annotations

import re
import time

import pytest
import torch

import tensorscope
from tensorscope._common import fmt_ns
from tensorscope._trace import Trace


def _gappy(engine: str) -> Trace:
    with tensorscope.trace(engine=engine, leaks=False) as t:
        x = torch.ones(8)
        for _ in range(4):
            x = x + 1
            time.sleep(0.01)   # 10 ms of Python between two ops, four times
        x = x + 1
    return t.result


def _with_delay(t: Trace, delay_ns: int) -> Trace:
    return Trace(t.tables, t.metadata.replace(run_delay_ns=delay_ns))


def _note(t: Trace) -> str:
    (line,) = [n for n in t.advice().to_text().splitlines() if "was outside ops" in n]
    return line


def _ms(text: str, before: str) -> float:
    """The duration written just before ``before`` in ``text``, in ms."""
    m = re.search(r"([\d.]+) (ns|µs|ms|s) ?" + re.escape(before), text)
    assert m, (before, text)
    return float(m.group(1)) * {"ns": 1e-6, "µs": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]


@pytest.mark.parametrize("engine", ["native", "python"])
def test_the_note_states_the_gaps_and_what_waiting_for_a_cpu_may_explain(engine):
    _gappy(engine)   # warm: a first run's timings draw no timing finding (first_run)
    t = _gappy(engine)
    wall_ms = t.metadata["wall_ns"] / 1e6
    in_ops_ms = sum(t.ops.column("cpu_ns").to_pylist()) / 1e6

    quiet = _with_delay(t, 0)
    note = _note(quiet)
    gaps = _ms(note, f"of {fmt_ns(t.metadata['wall_ns'])}")
    assert 40 <= gaps <= wall_ms - in_ops_ms + 0.01, (note, wall_ms, in_ops_ms)   # the four sleeps, within the headline's numbers
    assert "waited" not in note
    assert "outside_ops" in {f["kind"] for f in quiet.advice().findings.to_pylist()}

    busy = _with_delay(t, 10**10)   # the thread waited 10 s for a CPU: that may explain every gap
    note = _note(busy)
    assert _ms(note, f"of {fmt_ns(t.metadata['wall_ns'])}") == gaps   # the gaps are still said as measured
    assert "waited 10.00 s for a CPU" in note and "may explain all of it" in note and "the rest (0 ns)" in note
    assert "outside_ops" not in {f["kind"] for f in busy.advice().findings.to_pylist()}

    some = _with_delay(t, 10_000_000)   # 10 ms of waiting: at most that is explained, the rest is the program's
    note = _note(some)
    assert "may explain 10.00 ms of it" in note
    assert abs(_ms(note.split("counts the rest (")[1], ")") - (gaps - 10)) < 0.02, note
    assert "outside_ops" in {f["kind"] for f in some.advice().findings.to_pylist()}
