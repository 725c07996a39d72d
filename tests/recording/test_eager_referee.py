"""Eager is the referee: the default engine's ops against torch.profiler's events of the same step.

Each workload runs twice from the same state: once under ``tensorscope.trace()`` (the default
engine), once under ``torch.profiler.profile(record_shapes=True, profile_memory=True)`` with no
dispatch mode on the stack (plain eager). The profiler's CPU events are projected to the level a
Python dispatch mode sees, and the projection must equal the trace's ``ops`` (op names in order,
the tensor inputs' dtypes) and its memory timeline (live bytes while each op runs).

Why the profiler and not the python engine: a Python dispatch mode changes what eager runs
(autograd accumulates a gradient with ``add`` where eager uses ``add_``, ``reshape`` runs ``view``
where eager runs ``_reshape_alias``, and autograd saves outputs through the interpreter, which adds
``detach`` rows); the profiler observes without changing the program.

The projection (eager's events -> the ops a dispatch mode would see), on the profiler's event tree
(nesting by time on the one thread):

1. Events that are not ``aten::`` ops (``autograd::engine::evaluate_function: ...``, autograd node
   names, ``[memory]``) are transparent: their children are considered at their level.
2. An ``aten::`` event that no row encloses is a row.
3. An ``aten::`` event inside a row is a row of its own when it was dispatched at the autograd level
   (the profiler records autograd's sequence number for those, ``sequence_nr >= 0``): it was
   called by the enclosing op's autocast kernel (casts, then the op again on the cast inputs) or
   autograd kernel (the ``clone`` an in-place op saves), above the Python key. Events its kernel
   calls run with autograd excluded (``sequence_nr == -1``): kernel internals, no row. The
   profiler records the sequence number only while grad mode is on, so the workloads here run with
   grad enabled (in backward, grad mode is off and nothing nests at that level).
4. A CompositeImplicitAutograd op with no kernel of its own for the CPU (``linear``, ``to``,
   ``matmul``) is transparent: eager decomposed it, its children are considered at its level; one
   without children is no row (``.to`` to the dtype a tensor has dispatches nothing). One with a CPU
   kernel (``silu_backward``) is a row, as eager ran that kernel. The profiler names ops without
   their overload: the overloads whose arguments match the event's (as many, tensors where it
   recorded a dtype, scalars where it recorded ``Scalar``: ``where(cond, x, 0.5)`` is a composite,
   ``where(cond, x, y)`` is not) decide; if they still disagree, whether a child was dispatched at
   the autograd level (a composite's children are, a kernel's are not).
5. A row that has a row of the same op inside it is a shell (autocast re-issued the op on the cast
   inputs): the inner one is the row.
6. Rows are ordered by their end (a dispatch mode sees the clone before the in-place op that
   saved it: the op reaches the Python key after its autograd kernel returned from the clone).

Memory: torch.profiler's ``[memory]`` events (allocations and frees, with their times) summed up to
the end of each projected op, plus the bytes of the storages that existed before the step (the
trace's ``start_bytes``), are the bytes live while that op ran: its inputs (also those that die when
it returns), its outputs, what was live before. The trace's ``memory`` table must give the same
numbers for every op.

Residual differences, principled: none on these workloads. (Ops that bindings run with the Python
key excluded, such as ``nn.Parameter()``'s ``detach``, are outside the steps compared here.)
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorscope

# torch.profiler's dtype names -> torch's (tensor arguments; 'Scalar', 'TensorList', '' are not tensors)
_DTYPES = {"float": "float32", "double": "float64", "c10::Half": "float16", "c10::BFloat16": "bfloat16",
           "long int": "int64", "int": "int32", "short int": "int16", "signed char": "int8",
           "unsigned char": "uint8", "bool": "bool"}
_has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key


@pytest.fixture(scope="module", autouse=True)
def _need_native():
    from tensorscope.recording.engines import _native_ext

    ext, reason = _native_ext(wait=True)
    if ext is None:
        pytest.skip(f"the default engine is the python one here ({reason}): the referee checks the native engine")


class _Node:
    __slots__ = ("ev", "name", "start", "end", "seq", "children")

    def __init__(self, ev: Any) -> None:
        self.ev = ev
        ov = ev.overload_name()
        self.name = ev.name() + ("." + ov if ov else "")
        self.start = ev.start_ns()
        self.end = ev.start_ns() + ev.duration_ns()
        self.seq = ev.sequence_nr()
        self.children: list[_Node] = []


_COMPOSITE: dict[tuple[str, int], list[bool]] = {}


def _transparent_composite(n: _Node) -> bool:
    """Rule 4 (see the module docstring)."""
    types = tuple("T" if t in _DTYPES else "S" if t == "Scalar" else "?" for t in n.ev.dtypes())
    key = (n.name, types)
    cands = _COMPOSITE.get(key)
    if cands is None:
        cands = []
        packet = getattr(torch.ops.aten, n.name.split("::", 1)[1], None)
        for ov in packet.overloads() if packet is not None else ():
            op = getattr(packet, ov)
            args = op._schema.arguments
            if len(args) != len(types) or any(a.is_out for a in args):
                continue
            kinds = ["T" if str(a.type) in ("Tensor", "Optional[Tensor]") else "S" if str(a.type) == "Scalar" else "?"
                     for a in args]
            if any(k != "?" and t != "?" and k != t for k, t in zip(kinds, types)):
                continue
            name = op._schema.name + ("." + op._schema.overload_name if op._schema.overload_name else "")
            try:
                cands.append(bool(_has_kernel(name, "CompositeImplicitAutograd")) and not _has_kernel(name, "CPU"))
            except RuntimeError:   # TorchScript's prim overloads: no dispatcher entry
                continue
        _COMPOSITE[key] = cands
    if cands and all(cands):
        return True
    if not any(cands):
        return False
    return any(c.seq >= 0 for c in n.children)


def _seen_memory(mem: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The allocations and frees of storages an op saw. A Python number an op receives is a 0-d tensor
    to eager (the argument parser allocates it outside every op, and autograd may keep it with the
    graph: ``x * 0.125`` saves it); to a dispatch mode and to the trace it is a scalar. So an
    allocation made outside every op event, and a later free of the same size outside every op
    event, are left out."""
    import bisect

    merged: list[list[int]] = []   # the outermost op spans, disjoint
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts = [a for a, _ in merged]

    def outside(t: int) -> bool:
        i = bisect.bisect_right(starts, t) - 1
        return i < 0 or t > merged[i][1]

    out, unseen = [], {}
    for t, nb in mem:
        if nb > 0 and outside(t):
            unseen[nb] = unseen.get(nb, 0) + 1
            continue
        if nb < 0 and unseen.get(-nb) and outside(t):
            unseen[-nb] -= 1
            continue
        out.append((t, nb))
    return out


def eager(run) -> tuple[list[dict[str, Any]], list[tuple[int, int]]]:
    """``run()`` under torch.profiler, no mode on the stack: (the projected rows as dicts with ``op``,
    ``in_dtypes`` (None where an argument is a tensor list: the profiler has no element dtypes),
    ``end``), and the (time, bytes) of its allocations and frees)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as p:
        run()
    evs = p.profiler.kineto_results.events()
    ops = [e for e in evs if e.name() != "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    ops.sort(key=lambda e: (e.start_ns(), -e.duration_ns()))
    mem = _seen_memory(sorted((e.start_ns(), e.nbytes()) for e in evs if e.name() == "[memory]"),
                       [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in ops if e.name().startswith("aten::")])
    roots: list[_Node] = []
    stack: list[_Node] = []
    for e in ops:
        n = _Node(e)
        while stack and stack[-1].end <= n.start and not (stack[-1].end == n.start == n.end):
            stack.pop()
        (stack[-1].children if stack else roots).append(n)
        stack.append(n)
    rows: list[tuple[int, int, _Node]] = []   # (end, depth, node)
    shells: set[int] = set()

    def visit(n: _Node, row: _Node | None, depth: int) -> None:
        if not n.name.startswith("aten::"):                        # 1.
            for c in n.children:
                visit(c, row, depth + 1)
            return
        if row is not None and n.seq < 0:                          # 3. kernel internals
            return
        if _transparent_composite(n):                             # 4.
            for c in n.children:
                visit(c, row, depth + 1)
            return
        if row is not None and row.name == n.name:                 # 5.
            shells.add(id(row))
        rows.append((n.end, -depth, n))                            # 2. / 3.
        for c in n.children:
            visit(c, n, depth + 1)

    for r in roots:
        visit(r, None, 0)
    rows.sort(key=lambda x: (x[0], x[1]))                          # 6.
    out = []
    for end, _, n in rows:
        if id(n) in shells:
            continue
        types, shapes = n.ev.dtypes(), n.ev.shapes()
        # a Python number the arg parser wrapped into a 0-d long/double tensor is a scalar to a
        # dispatch mode (and to the trace): the profiler cannot tell it from a 0-d tensor, so a 0-d
        # int64/float64 entry is compared only when the trace has as many tensors
        dts = None if "TensorList" in types else \
            [(_DTYPES[t], len(s) == 0 and t in ("long int", "double")) for t, s in zip(types, shapes) if t in _DTYPES]
        out.append(dict(op=n.name.split(".")[0], in_dtypes=dts, end=end))
    return out, mem


def _ours(t) -> list[dict[str, Any]]:
    return [dict(op=r["op"].rsplit(".", 1)[0].replace(".", "::", 1), in_dtypes=r["in_dtypes"])
            for r in t.ops.select(["op", "in_dtypes"]).to_pylist()]


def referee(run, *, memory: bool = True):
    """Trace ``run`` with the default engine and run it under the profiler; assert they agree."""
    run()   # warm: lazy initialisation allocates outside the ops
    with tensorscope.trace(leaks=False) as t:
        run()
    assert t.metadata["engine"] == "native"
    prof, mem = eager(run)
    ours = _ours(t)
    assert [r["op"] for r in ours] == [r["op"] for r in prof], \
        "\n".join(f"{a['op'] if a else '-':32} {b['op'] if b else '-'}" for a, b in
                  zip(ours + [None] * (len(prof) - len(ours)), prof + [None] * (len(ours) - len(prof))))
    for i, (a, b) in enumerate(zip(ours, prof)):
        if b["in_dtypes"] is not None:
            entries = list(b["in_dtypes"])
            for j in range(len(entries) - 1, -1, -1):   # wrapped numbers: the trailing scalar operands
                if len(entries) > len(a["in_dtypes"]) and entries[j][1]:
                    del entries[j]
            dts = [d for d, _ in entries]
            assert a["in_dtypes"] == dts, (i, a, b)
    if memory:
        from tensorscope.analyses.memory import memory_peak

        live = t.memory.filter(pa_eq(t.memory, "device", "cpu")).column("live_bytes").to_pylist()
        start = memory_peak(t.memory)["cpu"]["start_bytes"]
        k, acc, expect = 0, 0, []
        for r in prof:
            while k < len(mem) and mem[k][0] <= r["end"]:
                acc += mem[k][1]
                k += 1
            expect.append(start + acc)
        assert live == expect, [(i, ours[i]["op"], a, b) for i, (a, b) in enumerate(zip(live, expect)) if a != b][:8]
    return t, prof


def pa_eq(table, col, value):
    import pyarrow.compute as pc

    return pc.equal(table.column(col), value)


def _ops(t) -> list[str]:
    return t.ops.column("op").to_pylist()


# ---------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------
class GPT2Block(nn.Module):
    """A GPT-2-like block from torch.nn: pre-norm causal self-attention and a GELU MLP."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (z.view(B, T, self.h, D // self.h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (D // self.h) ** 0.5)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Conv1D(nn.Module):
    """GPT-2's projection as Hugging Face writes it: ``addmm`` on its own parameters (no ``linear``)."""

    def __init__(self, n_out: int, n_in: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


class HFGPT2Block(nn.Module):
    """A GPT-2 block as Hugging Face's GPT2Block computes it (Conv1D projections, matmul attention
    with a ``where`` mask, tanh GELU): its matmuls are not composites, so autocast casts inside them."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = Conv1D(3 * d, d), Conv1D(d, d)
        self.c_fc, self.c_out = Conv1D(4 * d, d), Conv1D(d, 4 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(D, 2)
        q, k, v = (z.view(B, T, self.h, -1).permute(0, 2, 1, 3) for z in (q, k, v))
        w = torch.matmul(q, k.transpose(-1, -2)) / (v.size(-1) ** 0.5)
        w = torch.where(torch.ones(T, T, dtype=torch.bool).tril(), w, torch.finfo(w.dtype).min).softmax(-1)
        a = torch.matmul(w, v).permute(0, 2, 1, 3).reshape(B, T, D)
        x = x + self.c_proj(a)
        return x + self.c_out(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class MobileBlock(nn.Module):
    """A MobileNetV3 inverted residual: expand, depthwise, squeeze-excite, project; hardswish in place."""

    def __init__(self, c: int = 8, e: int = 24) -> None:
        super().__init__()
        self.pw, self.bn1 = nn.Conv2d(c, e, 1, bias=False), nn.BatchNorm2d(e)
        self.dw, self.bn2 = nn.Conv2d(e, e, 3, padding=1, groups=e, bias=False), nn.BatchNorm2d(e)
        self.se1, self.se2 = nn.Conv2d(e, 4, 1), nn.Conv2d(4, e, 1)
        self.pj, self.bn3 = nn.Conv2d(e, c, 1, bias=False), nn.BatchNorm2d(c)
        self.act = nn.Hardswish(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.bn2(self.dw(self.act(self.bn1(self.pw(x))))))
        s = F.hardsigmoid(self.se2(F.relu(self.se1(y.mean((2, 3), keepdim=True)), inplace=True)), inplace=True)
        return x + self.bn3(self.pj(y * s))


class BasicBlock(nn.Module):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.b1(self.c1(x)), inplace=True)
        return F.relu(self.b2(self.c2(y)) + x, inplace=True)


def test_autocast_mm_casts_then_runs_on_bf16():
    x, w = torch.randn(8, 16), torch.randn(16, 8)

    def run():
        with torch.autocast("cpu", torch.bfloat16):
            torch.mm(x, w)

    t, prof = referee(run)
    assert _ops(t) == ["aten._to_copy.default"] * 2 + ["aten.mm.default"]
    assert t.ops.column("in_dtypes").to_pylist()[-1] == ["bfloat16", "bfloat16"]
    assert t.casts.num_rows == 2 and set(t.casts.column("kind").to_pylist()) == {"autocast"}


def test_autocast_cat_of_mixed_dtypes():
    a, b = torch.randn(4, 4), torch.randn(4, 4, dtype=torch.bfloat16)

    def run():
        with torch.autocast("cpu", torch.bfloat16):
            torch.cat([a, b])

    t, _ = referee(run)
    assert _ops(t) == ["aten._to_copy.default", "aten.cat.default"]
    assert t.ops.column("in_dtypes").to_pylist() == [["bfloat16"], ["float32", "float32"]]


def test_autocast_gpt2_like_block():
    torch.manual_seed(0)
    m = nn.Sequential(GPT2Block(), GPT2Block())
    x = torch.randn(2, 8, 32)

    def run():
        with torch.autocast("cpu", torch.bfloat16):
            m(x)

    t, prof = referee(run)
    n_casts = _ops(t).count("aten._to_copy.default")
    assert n_casts >= 8 and n_casts == [r["op"] for r in prof].count("aten::_to_copy")
    mm_like = [r for r in t.ops.to_pylist() if r["op"] in ("aten.addmm.default", "aten.bmm.default", "aten.mm.default")]
    assert mm_like and all(set(r["in_dtypes"]) == {"bfloat16"} for r in mm_like)


def test_autocast_hf_gpt2_block_forward_backward():
    torch.manual_seed(0)
    m = nn.Sequential(HFGPT2Block(), HFGPT2Block())
    x = torch.randn(2, 8, 32)

    def run():
        with torch.autocast("cpu", torch.bfloat16):
            y = m(x)
        y.float().sum().backward()
        m.zero_grad(set_to_none=True)

    t, prof = referee(run)
    ops = _ops(t)
    # every addmm/bmm ran on bfloat16, after its casts (the native engine used to record them on float32)
    assert ops.count("aten._to_copy.default") == [r["op"] for r in prof].count("aten::_to_copy") >= 12
    fwd = [r for r in t.ops.to_pylist() if r["phase"] == "forward" and r["op"] in ("aten.addmm.default", "aten.bmm.default")]
    assert len(fwd) == 12 and all(set(r["in_dtypes"]) == {"bfloat16"} for r in fwd)


def test_mobilenet_blocks_forward_backward():
    torch.manual_seed(0)
    m = nn.Sequential(MobileBlock(), MobileBlock())
    x = torch.randn(2, 8, 8, 8)

    def run():
        m(x).sum().backward()
        m.zero_grad(set_to_none=True)

    t, prof = referee(run)
    # each in-place hardswish and hardsigmoid under grad: autograd saves a clone of its input
    assert _ops(t).count("aten.clone.default") == [r["op"] for r in prof].count("aten::clone") == 6


@pytest.mark.parametrize("act", ["hardswish", "relu"])
def test_inplace_activation_under_grad(act):
    torch.manual_seed(0)
    p = torch.randn(64, 64, requires_grad=True)
    f = getattr(F, act)

    def run():
        f(p * 2, inplace=True).sum().backward()
        p.grad = None

    t, _ = referee(run)
    ops = _ops(t)
    # hardswish_'s backward needs its input: autograd saves a clone (a full copy, a row of its own)
    if act == "hardswish":
        i = ops.index("aten.hardswish_.default")
        assert ops[i - 1] == "aten.clone.default"
        clone = t.ops.to_pylist()[i - 1]
        assert clone["bytes_written"] == 64 * 64 * 4 and clone["cpu_ns"] > 0
    else:
        assert "aten.clone.default" not in ops   # relu_ saves its result: no copy


def test_residual_basic_block_forward_backward():
    torch.manual_seed(0)
    m = BasicBlock()
    x = torch.randn(2, 8, 8, 8)

    def run():
        m(x).sum().backward()
        m.zero_grad(set_to_none=True)

    t, _ = referee(run)
    assert "aten.convolution_backward.default" in _ops(t)


def test_inputs_count_while_the_op_runs():
    a = torch.randn(256, 1024, requires_grad=True)   # 1 MiB

    def run():
        torch.relu(a * 2)

    t, _ = referee(run)
    from tensorscope.analyses.memory import memory_peak

    # a, a * 2 (dies when relu returns) and relu's result are live while relu runs
    assert memory_peak(t.memory)["cpu"]["peak_bytes"] == 3 * 2 ** 20
