"""On a CPU trace a sync finding is a claim about a GPU run ("on a GPU each one would wait for every
kernel queued before it"): it needs a value that would live on the GPU there, one derived from a
tensor of one dimension or more. torch.optim.Adam reads its step counters with .item() each step:
0-d CPU tensors that stay on the host when the model runs on a GPU. The summary named them as a sync at
`opt.step()` with the fix "keep the value on the device", a fix that does not apply."""
from __future__ import annotations

import pytest
import torch

import tensorscope

ENGINES = ("native", "python")


def _sync_lines(t) -> dict[int, int]:
    """source line -> rows of each sync finding."""
    return {f["source_line"]: f["n_rows"] for f in t.advice().findings.to_pylist() if f["kind"] == "sync"}


@pytest.mark.parametrize("engine", ENGINES)
def test_an_optimizers_step_counters_are_no_sync_but_the_loss_and_a_data_counter_are(engine):
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 3)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    seen = []
    correct = torch.zeros(())
    steps = torch.tensor(0.0)
    import inspect
    line = inspect.currentframe().f_lineno
    with tensorscope.trace(engine=engine, leaks=False) as t:
        for _ in range(4):
            out = m(x)
            loss = torch.nn.functional.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()                                        # line + 7: Adam's step.item() reads
            seen.append(loss.item())                          # line + 8: the loss, from the batch
            correct += (out.argmax(1) == y).sum()
            if correct.item() < 0:                            # line + 10: a counter made of the batch
                break
            steps += 1
            seen.append(steps.item())                         # line + 13: a counter of Python numbers
    lines = _sync_lines(t)
    assert line + 7 not in lines and line + 13 not in lines
    assert lines.get(line + 8) == 4 and lines.get(line + 10) == 4


@pytest.mark.parametrize("engine", ENGINES)
def test_a_read_whose_producer_is_far_back_or_before_the_trace_is_still_a_sync(engine):
    """Not proven host-only is a sync: a loss read after a long backward (its producer past the rows
    read back), and a 0-d tensor made before the trace."""
    x = torch.randn(64, 64, requires_grad=True)
    made_before = (x * 2).sum().detach()
    import inspect
    line = inspect.currentframe().f_lineno
    with tensorscope.trace(engine=engine, leaks=False) as t:
        for _ in range(3):
            loss = (x * 3).sum()
            y = torch.ones(4)
            for _ in range(300):                              # 600 rows between the loss and its read
                y = y.add(1.0).mul(1.0)
            loss.item()                                       # line + 7
            made_before.item()                                # line + 8
    lines = _sync_lines(t)
    assert lines.get(line + 7) == 3 and lines.get(line + 8) == 3
