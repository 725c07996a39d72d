"""The device/build report: ``tensorscope.env()``, ``%tensorscope env`` and every saved trace's metadata.

Role: say in one place what the numbers of a trace were measured on — torch,
CUDA and cuDNN versions, each visible GPU (name, ``sm_XX``, SM count,
memory) and whether this torch build carries machine code (SASS) for that
architecture or relies on PTX JIT compilation at first use, the TF32 and
precision switches, bf16 support, the default dtype and thread counts.
A CPU-only machine gets the CPU half and ``gpus == []``.

``env(init_cuda=True) -> EnvReport``. ``EnvReport.to_dict()`` is JSON-able
(the trace metadata stores it under ``"device"``); ``_repr_mimebundle_``
gives escaped HTML and text/plain (drawn by render/env.py); ``str()`` is the text.

Side effects: reading GPU properties initialises CUDA (a context per
device). ``env(init_cuda=False)`` — what the trace builder uses for metadata
— reports versions, device count and settings always, per-GPU details only
when the program has already initialised CUDA, so building or saving a trace
never creates a CUDA context the user did not ask for.
"""
from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from ._common import Displayable

__all__ = ["env", "EnvReport", "GpuInfo", "arch_support"]


def arch_support(capability: tuple[int, int], arch_list: Sequence[str]) -> tuple[str, Optional[str]]:
    """How a torch build runs on a GPU of compute ``capability`` given ``torch.cuda.get_arch_list()``.

    Returns ``("sass", "sm_80")`` when the build ships machine code that runs
    on it (same major, minor <= the device's: cubins are forward compatible
    within a major; ``sm_90a``-style arch-specific cubins only on that exact
    arch), ``("ptx", "compute_80")`` when only PTX of an older-or-equal arch
    is there (the driver JIT-compiles every kernel on first use: slow first
    calls, and it needs a driver as new as the PTX), else ``("none", None)``
    (kernels fail with "no kernel image is available").
    """
    major, minor = int(capability[0]), int(capability[1])
    dev = major * 10 + minor
    best_sass = None
    best_ptx = None
    for a in arch_list:
        kind, _, num = a.partition("_")
        suffix = ""
        while num and not num[-1].isdigit():
            suffix = num[-1] + suffix
            num = num[:-1]
        if not num.isdigit():
            continue
        v = int(num)
        amaj, amin = divmod(v, 10)
        if kind == "sm":
            if suffix == "a":
                ok = v == dev
            elif suffix == "f":     # family-specific: same major, minor >= the cubin's
                ok = amaj == major and amin <= minor
            else:
                ok = amaj == major and amin <= minor
            if ok and (best_sass is None or v > best_sass[0]):
                best_sass = (v, a)
        elif kind == "compute" and v <= dev and not suffix and (best_ptx is None or v > best_ptx[0]):
            best_ptx = (v, a)
    if best_sass is not None:
        return "sass", best_sass[1]
    if best_ptx is not None:
        return "ptx", best_ptx[1]
    return "none", None


@dataclass
class GpuInfo:
    index: int
    name: str
    capability: str                 # "sm_90"
    sm_count: Optional[int]
    total_memory: Optional[int]     # bytes
    code: str                       # sass / ptx / none: what this torch build has for the arch
    code_arch: Optional[str]        # the arch-list entry used (sm_80, compute_90)
    bf16: Optional[bool]


@dataclass
class EnvReport(Displayable):
    """What the numbers of a trace were measured on (data; render/env.py draws it)."""


    python: str
    platform: str
    torch: str
    torch_git: Optional[str]
    debug_build: Optional[bool]
    cuda_runtime: Optional[str]             # torch.version.cuda (build), null on CPU builds
    hip: Optional[str]
    cudnn: Optional[int]
    cuda_available: bool
    cuda_initialized: bool
    device_count: int
    arch_list: list[str]
    gpus: list[GpuInfo]
    gpu_details: str                        # reported / skipped (CUDA not initialised) / unavailable
    tf32_matmul: Optional[bool]             # torch.backends.cuda.matmul.allow_tf32
    tf32_cudnn: Optional[bool]              # torch.backends.cudnn.allow_tf32
    fp32_precision: dict[str, Optional[str]]  # the newer per-backend precision switches where present
    float32_matmul_precision: Optional[str]
    cudnn_enabled: Optional[bool]
    cudnn_benchmark: Optional[bool]
    cudnn_deterministic: Optional[bool]
    deterministic_algorithms: Optional[bool]
    default_dtype: str
    num_threads: int
    num_interop_threads: Optional[int]
    cpu_count: Optional[int]
    cpu_capability: Optional[str]
    cpu_bf16: Optional[bool]
    mkldnn: Optional[bool]
    openmp: Optional[bool]
    notes: list[str] = field(default_factory=list)
    #: measured machine peaks per device type (``_peaks.all_peaks``): None when not measured/cached
    peaks: Optional[dict[str, dict[str, Any]]] = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_text(self) -> str:
        from .render.env import env_text

        return env_text(self)

    def to_html(self) -> str:
        from .render.env import env_html

        return env_html(self)


def _try(fn, default=None):
    try:
        return fn()
    except Exception:
        return default


def _gpu_infos(torch, count: int, arch_list: list[str], notes: list[str]) -> list[GpuInfo]:
    out = []
    for i in range(count):
        try:
            p = torch.cuda.get_device_properties(i)
        except Exception as e:
            notes.append(f"cuda:{i}: properties unavailable: {type(e).__name__}: {e}")
            continue
        cap = (p.major, p.minor)
        code, code_arch = arch_support(cap, arch_list)
        bf16 = None
        if cap[0] >= 8:
            bf16 = True
        elif cap[0] > 0:
            bf16 = False     # emulated at best: no bf16 tensor cores before sm_80
        out.append(GpuInfo(index=i, name=str(p.name), capability=f"sm_{cap[0]}{cap[1]}",
                           sm_count=_try(lambda p=p: int(p.multi_processor_count)),
                           total_memory=_try(lambda p=p: int(p.total_memory)), code=code, code_arch=code_arch, bf16=bf16))
        if code == "ptx":
            notes.append(f"cuda:{i} ({out[-1].capability}) runs this torch build through PTX JIT: the first call of "
                         "each kernel compiles it, so early timings include compilation")
        elif code == "none":
            notes.append(f"cuda:{i} ({out[-1].capability}) is not supported by this torch build "
                         f"(arch list: {' '.join(arch_list) or 'empty'})")
    return out


def env(init_cuda: bool = True) -> EnvReport:
    """The report for this process now. ``init_cuda=False``: never initialise CUDA just to describe GPUs."""
    import torch

    notes: list[str] = []
    cuda_rt = getattr(torch.version, "cuda", None)
    hip = getattr(torch.version, "hip", None)
    available = bool(_try(torch.cuda.is_available, False))
    initialized = bool(_try(torch.cuda.is_initialized, False))
    count = int(_try(torch.cuda.device_count, 0) or 0) if available else 0
    arch_list = list(_try(torch.cuda.get_arch_list, []) or []) if (available and (init_cuda or initialized)) else []
    gpus: list[GpuInfo] = []
    if count and (init_cuda or initialized):
        gpus = _gpu_infos(torch, count, arch_list, notes)
        details = "reported"
    elif count:
        details = "not queried (CUDA was not initialised by the program; tensorscope.env() reports them)"
    else:
        details = "none"
    cudnn_ver = _try(torch.backends.cudnn.version) if (cuda_rt or hip) else None

    fp32: dict[str, Optional[str]] = {}
    # the per-backend fp32_precision settings are newer than some supported torch versions (_try
    # guards them) and torch's stubs do not declare the cudnn/mkldnn sub-modules
    for key, getter in (("matmul", lambda: torch.backends.cuda.matmul.fp32_precision),
                        ("cudnn_conv", lambda: torch.backends.cudnn.conv.fp32_precision),  # type: ignore[attr-defined]
                        ("cudnn_rnn", lambda: torch.backends.cudnn.rnn.fp32_precision),  # type: ignore[attr-defined]
                        ("mkldnn_matmul",
                         lambda: torch.backends.mkldnn.matmul.fp32_precision)):  # type: ignore[attr-defined]
        v = _try(getter)
        if v is not None:
            fp32[key] = str(v)
    mkldnn = _try(torch.backends.mkldnn.is_available)
    cpu_bf16 = _try(lambda: bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())) if mkldnn else None
    from ._peaks import all_peaks

    # env() measures them on first use (cached on disk); the trace builder's env(init_cuda=False) only reads the cache
    peaks = _try(lambda: all_peaks(measure=init_cuda))
    return EnvReport(
        python=platform.python_version(),
        platform=platform.platform(),
        torch=torch.__version__,
        torch_git=getattr(torch.version, "git_version", None),
        debug_build=_try(lambda: bool(torch.version.debug)),
        cuda_runtime=cuda_rt,
        hip=hip,
        cudnn=int(cudnn_ver) if cudnn_ver is not None else None,
        cuda_available=available,
        cuda_initialized=bool(_try(torch.cuda.is_initialized, False)),
        device_count=count,
        arch_list=arch_list,
        gpus=gpus,
        gpu_details=details,
        tf32_matmul=_try(lambda: bool(torch.backends.cuda.matmul.allow_tf32)),
        tf32_cudnn=_try(lambda: bool(torch.backends.cudnn.allow_tf32)),
        fp32_precision=fp32,
        float32_matmul_precision=_try(torch.get_float32_matmul_precision),
        cudnn_enabled=_try(lambda: bool(torch.backends.cudnn.enabled)),
        cudnn_benchmark=_try(lambda: bool(torch.backends.cudnn.benchmark)),
        cudnn_deterministic=_try(lambda: bool(torch.backends.cudnn.deterministic)),
        deterministic_algorithms=_try(torch.are_deterministic_algorithms_enabled),
        default_dtype=str(torch.get_default_dtype()).replace("torch.", ""),
        num_threads=int(torch.get_num_threads()),
        num_interop_threads=_try(torch.get_num_interop_threads),
        cpu_count=os.cpu_count(),
        cpu_capability=_try(torch.backends.cpu.get_cpu_capability),
        cpu_bf16=cpu_bf16,
        mkldnn=mkldnn,
        openmp=_try(torch.backends.openmp.is_available),
        notes=notes,
        peaks=peaks or None,
    )
