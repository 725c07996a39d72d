"""``python -m tensorscope install-kernel [--name NAME]``: a kernelspec whose kernels load tensorscope at start.

The kernel runs this Python (``sys.executable``) with ``ipykernel`` and
``--IPKernelApp.extensions=tensorscope``, so ``%%tensorscope`` works in every
notebook that picks the kernel, without ``%load_ext``.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile


def add_parser(sub):
    p = sub.add_parser("install-kernel", help="install a Jupyter kernel that loads tensorscope at start")
    p.add_argument("--name", default="tensorscope", help="kernel name (default: tensorscope)")
    p.add_argument("--display-name", default=None, help="name shown in Jupyter (default: 'Python (tensorscope)')")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for this user (default)")
    where.add_argument("--sys-prefix", action="store_true", help="install into this Python's prefix (venv)")
    where.add_argument("--prefix", default=None, help="install under PREFIX/share/jupyter/kernels")
    return p


def kernel_spec(display_name: str) -> dict:
    return {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                     "--IPKernelApp.extensions=tensorscope"],
            "display_name": display_name, "language": "python", "metadata": {"debugger": True}}


def install(name: str, display_name=None, user=False, prefix=None) -> str:
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "kernel.json"), "w", encoding="utf-8") as f:
            json.dump(kernel_spec(display_name or "Python (tensorscope)"), f, indent=1)
        return KernelSpecManager().install_kernel_spec(d, kernel_name=name, user=user, prefix=prefix)


def main(ns) -> int:
    prefix = sys.prefix if ns.sys_prefix else ns.prefix
    dest = install(ns.name, ns.display_name, user=prefix is None, prefix=prefix)
    print(f"installed kernelspec {ns.name!r} in {dest}")
    return 0
