"""A finished trace leaves nothing of tensorscope's in a reference cycle: the recording's parts (the
engine and its context, the function mode and its callbacks, the probes' hooks, the storage tracker,
the leak finder's frames) are freed by reference counting when the block ends, not at the garbage
collector's next full pass, which in a long notebook may come much later. What they hold is big: the
recorder's buffers, and for a spilled trace its mapped parts, files deleted but still on the disk
while mapped. Each case runs with the collector off and its DEBUG_SAVEALL flag on, so that what only
a collection would free is found and named."""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Any, Callable

import pytest
import torch

import tensorscope
from tensorscope.recording import history
from tests.helpers import cycles


def _cyclic_garbage(run: Callable[[], None]) -> list[str]:
    """What of tensorscope's only a collection frees once ``run()`` returned (its names, sorted)."""
    run()   # warm: first-use caches (peaks, compiled builds, imports) are not what is asked
    cycles.start()
    try:
        run()
    finally:
        found = cycles.found()   # the collector back on, also when run() failed
    return found


def _step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    loss = model(torch.randn(8, 16)).pow(2).sum()
    loss.backward()


def _raising() -> None:
    _step()
    torch.ones(2) @ torch.ones(3)   # a shape error raised through an op


def _warning() -> None:
    _step()
    warnings.warn("a user warning inside the block", UserWarning, stacklevel=1)


CASES: dict[str, tuple[dict[str, Any], Callable[[], None]]] = {
    "default": ({}, _step),
    "leaks": ({"leaks": True}, _step),
    "spilled": ({"chunk_rows": 64, "spill_rows": 128}, _step),
    "raises": ({}, _raising),
    "warns": ({}, _warning),
    "probes": ({"fingerprints": True, "numerics": True, "capture": "nonfinite", "cpp_errors": True}, _step),
}


@pytest.mark.parametrize("engine", ["native", "python"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_finished_trace_leaves_no_reference_cycle(engine, case, tmp_path):
    options, body = CASES[case]

    def run() -> None:
        with contextlib.suppress(RuntimeError), \
                warnings.catch_warnings(record=True), \
                tensorscope.trace(engine=engine, spill_dir=str(tmp_path), **options) as t:
            body()
        assert t.result.ops.num_rows > 0

    assert _cyclic_garbage(run) == []


@pytest.mark.parametrize("engine", ["native", "python"])
def test_a_dataset_trace_leaves_no_reference_cycle(engine, tmp_path):
    def run() -> None:
        with tensorscope.trace(engine=engine, dataset=str(tmp_path / "ds"), chunk_rows=64, spill_rows=128):
            _step()

    assert _cyclic_garbage(run) == []


def test_summary_save_and_load_leave_no_reference_cycle(tmp_path):
    with tensorscope.trace() as t:
        _step()
    trace = t.result

    def run() -> None:
        str(trace.summary())
        trace.summary().to_html()
        trace.save(str(tmp_path / "t.parquet"))
        back = tensorscope.load(str(tmp_path / "t.parquet"))
        str(back.summary())
        back.sql("select count(*) from ops")

    assert _cyclic_garbage(run) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("engine", ["native", "python"])
def test_a_spilled_trace_gives_its_files_back_when_dropped_without_a_collection(engine, tmp_path):
    """The recorder's parts and the trace's tables are mapped files in ``spill_dir``, deleted or
    removed with the trace: dropped, no mapping of them is left, with the collector off."""
    history.set_history_limits(max_traces=1)

    def mapped() -> list[str]:
        with open("/proc/self/maps") as f:
            return [line.split(maxsplit=5)[5].strip() for line in f
                    if len(line.split(maxsplit=5)) == 6 and str(tmp_path) in line]

    with cycles.no_collector():
        with tensorscope.trace(engine=engine, chunk_rows=64, spill_rows=128, spill_dir=str(tmp_path)) as t:
            for _ in range(4):
                _step()
        trace = t.result
        assert trace.metadata["spilled_rows"] > 0
        assert trace.ops.num_rows > 0 and mapped()   # read from the mapped files
        # the block has ended: what is mapped is the trace's tables, nothing of the recording's
        (tables,) = [p for p in tmp_path.iterdir() if p.name.startswith("tensorscope-tables-")]
        assert all(path.startswith(str(tables) + os.sep) for path in mapped()), mapped()
        del t, trace
        with tensorscope.trace(engine=engine):   # takes the spilled trace's place in last()
            torch.ones(1)
        assert mapped() == []
        assert [p.name for p in tmp_path.iterdir()] == []


class _Sub(torch.Tensor):
    """A subclass torch's default ``__torch_function__`` keeps (check_substitution's input)."""


def _entry_points() -> dict[str, Callable[[], None]]:
    def schedule() -> None:
        with tensorscope.schedule(wait=1, warmup=1, active=2, leaks=False) as s:
            for _ in range(4):
                _step()
                s.step()
        tensorscope.advise(s)

    def predict() -> None:
        model = torch.nn.Linear(16, 4)
        tensorscope.predict(lambda x: model(x).sum().backward(), torch.randn(8, 16))

    def diverge_and_diff() -> None:
        runs = []
        for _ in range(2):
            with tensorscope.trace(fingerprints=True, leaks=False) as t:
                _step()
            runs.append(t.result)
        tensorscope.diverge(*runs).to_text()
        str(tensorscope.diff(*runs))

    def substitution() -> None:
        w = torch.randn(4, 4)
        tensorscope.check_substitution(lambda x: (x @ w).relu(), torch.randn(4, 4),
                                       wrap=lambda t: t.as_subclass(_Sub))

    def leaks() -> None:
        tensorscope.find_leaks(user_ns={"kept": torch.ones(4)}, frames=True)

    return {"schedule": schedule, "predict": predict, "diverge_and_diff": diverge_and_diff,
            "substitution": substitution, "find_leaks": leaks}


@pytest.mark.parametrize("entry", ["schedule", "predict", "diverge_and_diff", "substitution", "find_leaks"])
def test_the_other_entry_points_leave_no_reference_cycle(entry):
    assert _cyclic_garbage(_entry_points()[entry]) == []
