"""FLOPs of ops whose formula needs their arguments (conv) are the same trace after trace and per shape.

The native engine computes each distinct (op, arguments, outputs) once per process; a later trace of
the same shapes reuses it, a new shape or argument is computed anew.
"""
from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

import tensorscope
from tensorscope.recording import engines


def _conv_flops(x, conv, engine):
    with tensorscope.trace(leaks=False, engine=engine) as t:
        conv(x).sum().backward()
    return sum(f for f in t.ops.column("flops").to_pylist() if f)


def _reference(x, conv):
    with FlopCounterMode(display=False) as fc:
        conv(x).sum().backward()
    return fc.get_total_flops()


def test_conv_flops_repeat_and_follow_shapes_and_arguments():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3, padding=1)
    strided = torch.nn.Conv2d(3, 8, 3, padding=1, stride=2)
    a, b = torch.randn(2, 3, 16, 16), torch.randn(4, 3, 8, 8)
    for engine in ("native", "python"):
        first = _conv_flops(a, conv, engine)
        assert first == _reference(a, conv) > 0
        assert _conv_flops(a, conv, engine) == first            # the same shapes again
        assert _conv_flops(b, conv, engine) == _reference(b, conv) != first
        assert _conv_flops(a, strided, engine) == _reference(a, strided) != first
    if engines._FLOPS:   # the native engine ran: one entry per distinct call
        assert all(isinstance(v, int) for v in engines._FLOPS.values())
