"""nn.Module path of the running code, from global forward hooks.

``register_module_forward_pre_hook`` pushes, ``register_module_forward_hook(always_call=True)``
pops (also when forward raises). The outermost module called is the root; names
come from a cached ``root.named_modules()``, so modules in ModuleList/ModuleDict get
their qualified names (containers are never called themselves). A module not under
the root gets its parent's path plus ``<ClassName>``.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional

import torch


class ModuleTracker:
    def __init__(self, rec):
        self.rec = rec
        self.stack: List[int] = []       # module path ids
        self.current = 0                 # module id of the innermost running module (0: none)
        self._names: Dict[int, str] = {}
        self._root_ref: Optional[weakref.ref] = None
        self._handles = []

    def install(self):
        reg = torch.nn.modules.module
        self._handles = [
            reg.register_module_forward_pre_hook(self._pre),
            reg.register_module_forward_hook(self._post, always_call=True),
        ]

    def remove(self):
        for h in self._handles:
            try:
                h.remove()
            except Exception:
                pass
        self._handles = []
        self.stack.clear()
        self.current = 0

    def _name_of(self, module) -> str:
        if not self.stack:
            root = self._root_ref() if self._root_ref is not None else None
            if root is not module:
                self._root_ref = weakref.ref(module)
                # ids are only valid while the root (and so its children) is alive
                self._names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
        name = self._names.get(id(module))
        if name is None:
            parent = self.rec.modules.values[self.current] if self.current else ""
            name = f"{parent}.<{type(module).__name__}>" if parent else f"<{type(module).__name__}>"
        elif name == "":
            name = f"<{type(module).__name__}>"   # the root itself
        return name

    def _pre(self, module, args):
        try:
            name = self._name_of(module)
            mid = self.rec.modules(name)
            self.stack.append(mid)
            self.current = mid
        except Exception as e:  # never reach user code
            self.stack.append(self.current)
            self.rec.tracer_error("module pre-hook", e)

    def _post(self, module, args, output):
        if self.stack:
            self.stack.pop()
        self.current = self.stack[-1] if self.stack else 0
