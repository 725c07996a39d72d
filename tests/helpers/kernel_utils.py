"""A real ipykernel driven through jupyter_client, for end-to-end magic tests."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List

from jupyter_client.manager import KernelManager


@dataclass
class CellResult:
    status: str
    execution_count: Any
    streams: List[str] = field(default_factory=list)
    displays: List[Dict[str, Any]] = field(default_factory=list)
    results: List[Dict[str, Any]] = field(default_factory=list)
    error: Dict[str, Any] = None

    @property
    def stdout(self) -> str:
        return "".join(self.streams)

    def html(self) -> str:
        return "".join(d.get("text/html", "") for d in self.displays)

    def text(self) -> str:
        return "".join(d.get("text/plain", "") for d in self.results)


class Kernel:
    def __init__(self, cwd=None, env=None):
        kenv = dict(os.environ)
        kenv.update(env or {})
        kenv.setdefault("MPLBACKEND", "Agg")
        # the kernel runs this very interpreter (the venv's), not whatever "python" is on PATH
        self.km = KernelManager(kernel_cmd=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]) \
            if _kernel_cmd_supported() else KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=cwd, env=kenv)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = 120) -> CellResult:
        out = CellResult(status="?", execution_count=None)

        def hook(msg):
            t = msg["msg_type"]
            c = msg["content"]
            if t == "stream":
                out.streams.append(c["text"])
            elif t == "display_data":
                out.displays.append(c["data"])
            elif t == "execute_result":
                out.results.append(c["data"])
            elif t == "error":
                out.error = c

        reply = self.kc.execute_interactive(code, output_hook=hook, timeout=timeout, allow_stdin=False)
        content = reply["content"]
        out.status = content["status"]
        out.execution_count = content.get("execution_count")
        if out.status == "error" and out.error is None:   # e.g. UsageError: printed, reported in the reply
            out.error = {"ename": content.get("ename"), "evalue": content.get("evalue")}
        for p in content.get("payload", []):               # %magic? help is a "page" payload
            if p.get("source") == "page":
                out.displays.append(p.get("data", {}))
        return out

    def value(self, expr: str):
        r = self.run(f"print(repr({expr}))")
        assert r.status == "ok", r.error
        import ast

        return ast.literal_eval(r.stdout.strip().splitlines()[-1])

    def close(self):
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=True)


def _kernel_cmd_supported() -> bool:
    try:

        return "kernel_cmd" in KernelManager.class_traits()
    except Exception:
        return False
