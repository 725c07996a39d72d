"""Op hooks: Python callbacks for the recorded ops of chosen namespaces (the collectives table).

Both engines call a trace's :class:`OpHooks` right after each recorded op of the hooked
namespaces, on the recording thread; see docs/development/architecture.md ("Op hooks").
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

#: an op hook: ``fn(seq, op name, inputs, outputs)``
OpHook = Callable[[int, str, Any, Any], Any]

_OP_HOOKS: dict[int, tuple[frozenset[str], OpHook]] = {}
_next_hook = [0]


def add_op_hook(namespaces: Union[str, Iterable[str]], fn: OpHook) -> int:
    """Call ``fn(seq, op, inputs, outputs)`` for every recorded op of ``namespaces`` (e.g.
    ``("c10d", "_c10d_functional")``), under both engines, in traces started afterwards.

    ``op`` is ``str(OpOverload)`` (``"c10d.allreduce_.default"``), ``inputs`` the op's
    arguments in schema order as Python objects (tensors, ``torch.ScriptObject`` process
    groups and reduce ops, lists, scalars), ``outputs`` a tuple, or None when the kernel
    raised. It runs on the recording thread right after the op; an exception in it is
    counted in ``metadata["tracer_errors"]``, never raised into the program. Keep no
    reference to the tensors. Returns a handle for :func:`remove_op_hook`.
    """
    if isinstance(namespaces, str):
        namespaces = (namespaces,)
    _next_hook[0] += 1
    _OP_HOOKS[_next_hook[0]] = (frozenset(namespaces), fn)
    return _next_hook[0]


def remove_op_hook(handle: int) -> None:
    _OP_HOOKS.pop(handle, None)


class OpHooks:
    """The hooks of one trace (a snapshot taken at its start)."""

    def __init__(self) -> None:
        #: before-op hooks ``fn(seq, op name, inputs)`` for ops that write an argument (in-place,
        #: ``out=``), called by the python engine; the session's capture= copies what such an op
        #: will overwrite
        self.before: list[Callable[[int, str, Any], Any]] = []
        #: the native engine's counterpart (it calls no Python before an op): it copies the bytes of
        #: the CPU tensor arguments an op of ``written_namespaces`` (hooked too) writes in C++ when the
        #: op starts (within ``written_limit`` bytes in all, only near ``written_seqs`` when set), and calls
        #: ``fn(seq, op name, {tensor number: memoryview})`` right before that op's hooks; the views
        #: end when the hooks return; ``fn`` returns the bytes it may still keep (the next limit)
        self.written: Optional[Callable[[int, str, dict[int, memoryview]], int]] = None
        self.written_limit = 0
        self.written_seqs: Optional[frozenset[int]] = None
        self.written_namespaces: frozenset[str] = frozenset()
        self.hooks = list(_OP_HOOKS.values())
        self.namespaces = frozenset(ns for nss, _ in self.hooks for ns in nss)
        self.errors: list[str] = []

    def __bool__(self) -> bool:
        return bool(self.hooks)

    def add(self, namespaces: Iterable[str], fn: OpHook) -> None:
        """A hook of this trace only (the session's own probes: the collectives table)."""
        self.hooks.append((frozenset(namespaces), fn))
        self.namespaces = frozenset(ns for nss, _ in self.hooks for ns in nss)

    def call_before(self, seq: int, name: str, inputs: Any) -> None:
        for fn in self.before:
            try:
                fn(seq, name, inputs)
            except Exception as e:
                if len(self.errors) < 20:
                    self.errors.append(f"op hook {getattr(fn, '__name__', fn)!s} before {name}: {type(e).__name__}: {e}")

    def __call__(self, seq: int, name: str, inputs: Any, outputs: Any) -> None:
        import torch

        name = name.replace("::", ".", 1)
        ns = name.split(".", 1)[0]
        for nss, fn in self.hooks:
            if ns in nss:
                try:
                    with torch._C.DisableTorchFunction():   # reading the tensors is no call of the program's
                        fn(seq, name, inputs, outputs)
                except Exception as e:   # a hook's bug never reaches the program
                    if len(self.errors) < 20:
                        self.errors.append(f"op hook {getattr(fn, '__name__', fn)!s} on {name}: {type(e).__name__}: {e}")

