"""The ``collectives`` table: one row per ``c10d`` / ``_c10d_functional`` op a trace sees.

Engine-agnostic: whatever sees the op (the Python dispatch mode, or the native
engine's hook for chosen namespaces) calls ``CollectiveProbe.observe(seq, op,
args, kwargs, outputs, start_perf_ns, end_perf_ns)`` after the op returned.

What a mode can see (docs/development/architecture.md, multi-rank datasets) and so what the columns mean:

* the op call itself: ``start_ns`` and ``enqueue_ns`` (how long the call took —
  for an async backend that is the enqueue, not the communication);
* completion: for ``c10d`` ops the returned ``Work``'s future gets a done
  callback that stamps ``done_ns`` (it runs on the backend's thread). Functional
  collectives (``_c10d_functional``) return a tensor whose wait is implicit and
  invisible, so their ``done_ns`` is null, as it is for a collective still
  running when the trace ends or a backend without futures;
* what runs on the backend's thread is invisible: DDP comm-hook callbacks (the
  gradient division after the bucketed all-reduce) record no op.

``ProcessGroup`` and ``ReduceOp`` arguments arrive as ScriptObjects; they are
decoded to ``pg_name``/``pg_size``/``reduce_op``. Nothing keeps a tensor or a
``Work``: the done callback captures only this probe's dict.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import pyarrow as pa

_perf = time.perf_counter_ns

#: namespaces whose ops are collectives
NAMESPACES = frozenset({"c10d", "_c10d_functional"})
#: ops in those namespaces that move no data between ranks
NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd", "monitored_barrier_"})


def is_collective(op: Any) -> bool:
    name = str(op)
    ns, _, rest = name.partition(".")
    return ns in NAMESPACES and rest.split(".")[0] not in NOT_COLLECTIVES


def _tensor_bytes(x: Any) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        try:
            return x.numel() * x.element_size()
        except Exception:
            return 0
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


def _script_type(o: Any) -> str:
    try:
        return str(o._type().qualified_name())
    except Exception:
        return ""


def _reduce_op_name(o: Any) -> Optional[str]:
    try:
        import torch.distributed as dist

        return dist.ReduceOp.RedOpType(int(o.op())).name
    except Exception:
        return None


def _pg_from_name(name: str) -> Any:
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(name)  # type: ignore[arg-type]  # GroupName is a str NewType
    except Exception:
        return None


_OVERLOADS: dict[str, Any] = {}


def _overload(op: Any) -> Any:
    """The OpOverload of ``op`` (an OpOverload already, or its name ``c10d.allreduce_.default``)."""
    if not isinstance(op, str):
        return op
    found = _OVERLOADS.get(op)
    if found is None and op not in _OVERLOADS:
        try:
            import torch

            ns, name, overload = op.split(".")
            found = getattr(getattr(getattr(torch.ops, ns), name), overload)
        except Exception:
            found = None
        _OVERLOADS[op] = found
    return found


def _input_bytes(op: Any, args: Sequence[Any]) -> int:
    """Bytes this rank contributes: the tensor arguments the op does not write (allgather_'s
    inputs, not its outputs); for in-place collectives (allreduce_, broadcast_) the written ones."""
    schema = getattr(_overload(op), "_schema", None)
    if schema is not None:
        read = written = 0
        for a, v in zip(schema.arguments, args):
            b = _tensor_bytes(v)
            if not b:
                continue
            ai = a.alias_info
            if ai is not None and ai.is_write:
                written += b
            else:
                read += b
        return read or written
    for v in args:   # engine without a schema: the first tensor argument (group)
        b = _tensor_bytes(v)
        if b:
            return b
    return 0


class CollectiveProbe:
    """Collects collective rows while a trace records. ``on_first`` runs once, at the first one."""

    def __init__(self, on_first: Optional[Callable[[], None]] = None) -> None:
        self.rows: list[tuple[Any, ...]] = []   # the columns of table(), in its order
        self.done: dict[int, int] = {}          # row index -> perf_counter_ns at completion
        self.counts: dict[str, int] = {}        # pg_name -> collectives seen
        self.on_first = on_first   # dropped when the trace stops
        self._names: dict[Any, Optional[str]] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def observe(self, seq: int, op: Any, args: Sequence[Any], kwargs: Optional[Mapping[str, Any]], outputs: Any,
                start_perf_ns: Optional[int] = None, end_perf_ns: Optional[int] = None) -> None:
        """One op of the trace (an OpOverload or its name; args in schema order). Without times, the
        op's start and duration are taken from its ``ops`` row when the table is built."""
        name = self._names.get(op)
        if name is None and op not in self._names:
            name = self._names[op] = str(op) if is_collective(op) else None
        if name is None:
            return
        import torch

        pg_name: Optional[str] = None
        reduce_op: Optional[str] = None
        pg_size: Optional[int] = None
        short = name.split(".")[1] if "." in name else name
        args = tuple(args) + tuple((kwargs or {}).values())
        for a in args:
            if isinstance(a, torch.ScriptObject):
                t = _script_type(a)
                if t.endswith("ProcessGroup"):
                    try:
                        pg = torch._C._distributed_c10d.ProcessGroup.unbox(a)
                        pg_name, pg_size = pg.group_name, int(pg.size())
                    except Exception:
                        pass
                elif t.endswith("ReduceOp"):
                    reduce_op = _reduce_op_name(a)
        if name.startswith("_c10d_functional."):
            strs = [a for a in args if isinstance(a, str)]
            if strs:
                pg_name = strs[-1]
                pg = _pg_from_name(pg_name)
                if pg is not None:
                    try:
                        pg_size = int(pg.size())
                    except Exception:
                        pass
                if len(strs) > 1 and "reduce" in short:
                    reduce_op = strs[0].upper()
        key = pg_name if pg_name is not None else "?"
        k = self.counts.get(key, 0)
        self.counts[key] = k + 1
        i = len(self.rows)
        self.rows.append((seq, name, pg_name, pg_size, reduce_op, _input_bytes(op, args), start_perf_ns,
                          None if start_perf_ns is None or end_perf_ns is None else end_perf_ns - start_perf_ns, k))
        self._watch(i, outputs)
        if i == 0 and self.on_first is not None:
            cb, self.on_first = self.on_first, None
            cb()

    def on_op(self, seq: int, op: str, inputs: Any, outputs: Any) -> None:
        """The op hook (``OpHooks``) of the c10d namespaces: an op just returned (outputs None when it
        raised); its start and duration come from its ops row when the tables are built."""
        self.observe(seq, op, inputs, None, outputs if outputs is not None else (), None, None)

    def _watch(self, i: int, outputs: Any) -> None:
        import torch

        outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        done = self.done
        for o in outs:
            if isinstance(o, torch.ScriptObject) and _script_type(o).endswith("Work"):
                try:
                    fut = torch._C._distributed_c10d.Work.unbox(o).get_future()
                except Exception:   # a backend without futures: done_ns stays null
                    return

                def _done(_fut: Any, i: int = i) -> None:
                    done[i] = _perf()

                try:
                    fut.add_done_callback(_done)
                except Exception:
                    pass
                return

    def table(self, t0_perf_ns: int, ops: Optional[pa.Table] = None) -> pa.Table:
        """The collectives table; rows observed without times take start and duration from ``ops``."""
        from .. import schema as S

        if not self.rows:
            return S.empty("collectives")
        cols = [list(c) for c in zip(*self.rows)] if self.rows else [[] for _ in range(9)]
        if ops is not None and any(s is None for s in cols[6]) and ops.num_rows:
            seqs = ops.column("seq").to_pylist()
            starts = ops.column("start_ns").to_pylist()
            durs = ops.column("cpu_ns").to_pylist()
            at = {q: i for i, q in enumerate(seqs)}
            for r, q in enumerate(cols[0]):
                i = at.get(q)
                if cols[6][r] is None and i is not None and starts[i] is not None:
                    cols[6][r] = starts[i] + t0_perf_ns
                    cols[7][r] = durs[i]
        done = [self.done.get(i) for i in range(len(self.rows))]
        return pa.table({
            "seq": pa.array(cols[0], pa.int64()),
            "op": pa.array(cols[1], pa.string()),
            "pg_name": pa.array(cols[2], pa.string()),
            "pg_size": pa.array(cols[3], pa.int64()),
            "reduce_op": pa.array(cols[4], pa.string()),
            "nbytes": pa.array(cols[5], pa.int64()),
            "start_ns": pa.array([None if s is None else s - t0_perf_ns for s in cols[6]], pa.int64()),
            "enqueue_ns": pa.array(cols[7], pa.int64()),
            "done_ns": pa.array([None if d is None else d - t0_perf_ns for d in done], pa.int64()),
            "coll_index": pa.array(cols[8], pa.int64()),
        }, schema=S.COLLECTIVES)
