"""Timing beyond the CPU clock: CUDA event pairs per op and Kineto/CUPTI kernels.

CPU time per op is measured in the dispatch mode itself (``perf_counter_ns``
around ``func``, relative to the trace's ``t0``). This package adds:

* ``timing.cuda.CudaOpTimer`` — ``ops.cuda_ns`` from CUDA event pairs
  recorded on each op's stream, resolved with one synchronise per trace;
* ``timing.kernels`` — the ``kernels`` table from the profiler's CUDA
  activity (``KernelCollector`` owns the Kineto session);
* ``timing.kernel_link`` — each kernel linked to the ``ops.seq`` that
  launched it, with timestamp checks (``link_kernels`` is pure).

Importing this package imports neither torch.cuda nor the profiler.
"""
from __future__ import annotations

__all__ = ["CudaOpTimer", "KernelCollector", "link_kernels"]


def __getattr__(name):
    if name == "CudaOpTimer":
        from .cuda import CudaOpTimer

        return CudaOpTimer
    if name == "KernelCollector":
        from .kernels import KernelCollector

        return KernelCollector
    if name == "link_kernels":
        from .kernel_link import link_kernels

        return link_kernels
    raise AttributeError(name)
