"""torch's fast paths keep their eager answer under a trace.

Some of torch's Python code takes a fused fast path only when no ``__torch_function__`` override is
in play: ``nn.TransformerEncoder``/``TransformerEncoderLayer`` (``aten._transformer_encoder_layer_fwd``)
and ``nn.MultiheadAttention`` (``aten._native_multi_head_attention``) in inference ask
``torch.overrides.has_torch_function(tensor_args)``, which is true whenever a TorchFunctionMode is on
the stack: tensorscope's own function mode turned them onto the slow path, a different program with
different bits. While a trace records, ``torch.overrides.has_torch_function`` (the attribute those
modules look up at each call) answers as eager would: tensorscope's function modes do not count, a
user's mode or a tensor subclass with an override still does. Code that imported the function by name
(``torch.nn.functional``'s override protocol) keeps the original, so the calls it routes to the
function mode are still recorded. Installed by the session at start, removed at restore (counted: one
patch for the traces of every thread); the stack is thread-local, so another thread's answer is
unchanged."""
from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

_ORIG = torch.overrides.has_torch_function
_lock = threading.Lock()
_ours: dict[int, object] = {}   # id -> the function mode objects of the traces recording now


def has_torch_function(args: Iterable[object]) -> bool:
    """``torch.overrides.has_torch_function(args)`` as without tensorscope's function modes."""
    if not _ORIG(args):
        return False
    if torch.compiler.is_compiling():   # Dynamo traces the original (the modes are hidden from it)
        return True
    n = torch._C._len_torch_function_stack()
    if n == 0 or not _ours:
        return True   # an override on an argument
    if any(id(torch._C._get_function_stack_at(i)) not in _ours for i in range(n)):
        return True   # another mode: eager would see it too
    popped = [torch._C._pop_torch_function_stack() for _ in range(n)]   # only tensorscope's: ask without them
    try:
        return bool(_ORIG(args))
    finally:
        for m in reversed(popped):
            torch._C._push_on_torch_function_stack(m)


def install(mode: object) -> None:
    with _lock:
        _ours[id(mode)] = mode
        torch.overrides.has_torch_function = has_torch_function


def remove(mode: object) -> None:
    """Idempotent; the original comes back with the last trace's mode."""
    with _lock:
        _ours.pop(id(mode), None)
        if not _ours and torch.overrides.has_torch_function is has_torch_function:
            torch.overrides.has_torch_function = _ORIG
