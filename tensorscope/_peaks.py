"""Machine peaks for the roofline: GEMM FLOP/s per dtype, copy bandwidth, the per-op floor, measured once.

``machine_peaks(device="cpu")`` returns ``{"flops": {dtype: FLOP/s}, "bytes_per_s": ...,
"overhead_ns": ..., ...}`` for this machine, read from a JSON file beside the native build
cache (``native.cache_dir()``, ``$TENSORSCOPE_CACHE``) keyed by the device (CPU model or GPU
name), torch's thread count, the torch version and the recipe; on a miss it is measured
(a short GEMM per dtype, a stream copy, a tiny op in a loop: under a second) and written there.
``measure=False`` only reads the cache; ``refresh=True`` measures again and keeps, per figure, the best
of the two (a peak is what the machine reached: a run on a busy machine does not lower it).

The micro-benchmark runs with every Python mode off (ours and the user's), with RecordFunction
off on this thread when the native engine is loaded (so no trace and no ``torch.profiler``
sees it), without autograd or autocast, and draws no random numbers (tensors are ``empty``
then ``fill_``). With a profiler running and no native engine to hide from it, nothing is
measured (``None``). CUDA: the same on the current device, timed by events, with the
spec-sheet figures of known GPUs (``SPEC_SHEETS``) as a cross-check.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import time
from typing import Any, Callable, Optional

RECIPE = 1
_MEMO: dict[str, dict[str, Any]] = {}

#: (name substring, lower case) -> dense FLOP/s (fp32 without TF32, bf16 and fp16 tensor cores) and bytes/s
SPEC_SHEETS: tuple[tuple[str, dict[str, float]], ...] = (
    ("h200", {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12, "bytes_per_s": 4.8e12}),
    ("h100 pcie", {"float32": 51e12, "bfloat16": 756e12, "float16": 756e12, "bytes_per_s": 2.0e12}),
    ("h100", {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12, "bytes_per_s": 3.35e12}),
    ("a100-sxm4-80gb", {"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12, "bytes_per_s": 2.039e12}),
    ("a100", {"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12, "bytes_per_s": 1.555e12}),
    ("l40s", {"float32": 91.6e12, "bfloat16": 362e12, "float16": 362e12, "bytes_per_s": 0.864e12}),
    ("l4", {"float32": 30.3e12, "bfloat16": 121e12, "float16": 121e12, "bytes_per_s": 0.3e12}),
    ("a10", {"float32": 31.2e12, "bfloat16": 125e12, "float16": 125e12, "bytes_per_s": 0.6e12}),
    ("v100", {"float32": 15.7e12, "float16": 125e12, "bytes_per_s": 0.9e12}),
    ("t4", {"float32": 8.1e12, "float16": 65e12, "bytes_per_s": 0.32e12}),
    ("rtx 4090", {"float32": 82.6e12, "bfloat16": 165e12, "float16": 165e12, "bytes_per_s": 1.008e12}),
)


def spec_sheet(name: str) -> Optional[dict[str, float]]:
    """The spec-sheet figures of a GPU by its name (``NVIDIA H200``), or None when unknown."""
    low = name.lower()
    for key, figs in SPEC_SHEETS:
        if key in low:
            return dict(figs)
    return None


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (read once per process: every trace's metadata asks for it)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _identity(device: str) -> dict[str, Any]:
    import torch

    if device == "cuda":
        i = torch.cuda.current_device()
        name = torch.cuda.get_device_name(i)
    else:
        name = cpu_model()
    return {"device": device, "name": name, "threads": int(torch.get_num_threads()), "torch": torch.__version__,
            "recipe": RECIPE}


def cache_path(ident: dict[str, Any]) -> str:
    from .native import cache_dir

    return _cache_path(cache_dir(), json.dumps(ident, sort_keys=True), ident["device"])


@functools.lru_cache(maxsize=64)
def _cache_path(root: str, ident_json: str, device: str) -> str:
    key = hashlib.sha256(ident_json.encode()).hexdigest()[:16]
    return os.path.join(root, f"peaks-{device}-{key}.json")


def _read(path: str, ident: dict[str, Any]) -> Optional[dict[str, Any]]:
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or any(d.get(k) != v for k, v in ident.items()) or not isinstance(d.get("flops"), dict):
        return None
    return d


def _write(path: str, d: dict[str, Any]) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(d, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass   # a read-only cache: measured again next process


def machine_peaks(device: str = "cpu", *, measure: bool = True, refresh: bool = False) -> Optional[dict[str, Any]]:
    """This machine's peaks on ``device`` (``cpu`` or ``cuda``: the current CUDA device); cached on disk.

    None when ``measure=False`` and nothing is cached, when CUDA is asked for but unavailable, or when
    a profiler is running that the benchmark could not be hidden from."""
    import torch

    if device not in ("cpu", "cuda"):
        from .errors import OptionsError

        raise OptionsError(f"machine_peaks(device=...) takes 'cpu' or 'cuda', not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        return None
    ident = _identity(device)
    memo_key = json.dumps(ident, sort_keys=True)
    if not refresh and memo_key in _MEMO:
        return dict(_MEMO[memo_key])
    path = cache_path(ident)
    old = _read(path, ident)
    d = None if refresh else old
    if d is None:
        if not measure:
            return None
        d = _hidden(_measure_cuda if device == "cuda" else _measure_cpu)
        if d is None:
            return None
        if old is not None:
            d = _best_of(old, d)
        d.update(ident)
        d["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        _write(path, d)
    d["cache_file"] = path
    _MEMO[memo_key] = d
    return dict(d)


def _best_of(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A peak is the best the machine reached: a refresh on a busy machine only raises what is cached."""
    out = dict(new)
    fl = dict(old.get("flops") or {})
    for k, v in (new.get("flops") or {}).items():
        fl[k] = max(v, fl.get(k) or 0.0)
    out["flops"] = fl
    out["bytes_per_s"] = max(new.get("bytes_per_s") or 0.0, old.get("bytes_per_s") or 0.0)
    floors = [v for v in (new.get("overhead_ns"), old.get("overhead_ns")) if v]
    out["overhead_ns"] = min(floors) if floors else None
    return out


def all_peaks(measure: bool = True) -> dict[str, dict[str, Any]]:
    """``{"cpu": ..., "cuda": ...}``: the devices with peaks (CUDA only when the program initialised it)."""
    import torch

    out: dict[str, dict[str, Any]] = {}
    p = machine_peaks("cpu", measure=measure)
    if p:
        out["cpu"] = p
    try:
        cuda_ready = torch.cuda.is_available() and torch.cuda.is_initialized()
    except Exception:
        cuda_ready = False
    if cuda_ready:
        q = machine_peaks("cuda", measure=measure)
        if q:
            out["cuda"] = q
    return out


def _hidden(fn: Callable[[], Optional[dict[str, Any]]]) -> Optional[dict[str, Any]]:
    """``fn()`` with every Python mode off, no autograd/autocast, RecordFunction off when we can."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    from .native import loaded_engine

    def run() -> Optional[dict[str, Any]]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_disable_current_modes())
            stack.enter_context(torch._C.DisableTorchFunction())
            stack.enter_context(torch.no_grad())
            stack.enter_context(torch.autocast("cpu", enabled=False))
            if torch.cuda.is_available():
                stack.enter_context(torch.autocast("cuda", enabled=False))
            return fn()

    ext = loaded_engine()
    if ext is not None and hasattr(ext, "unobserved"):
        out: Optional[dict[str, Any]] = ext.unobserved(run)
        return out
    if torch.autograd._profiler_enabled():
        return None   # the profiler would record the benchmark: measure another time
    return run()


def _best_ns(fn: Callable[[], Any], budget_s: float, sync: Callable[[], Any] = lambda: None,
             max_reps: int = 50) -> float:
    fn()
    sync()
    best = float("inf")
    end = time.perf_counter() + budget_s
    reps = 0
    while reps < 2 or (time.perf_counter() < end and reps < max_reps):
        t0 = time.perf_counter_ns()
        fn()
        sync()
        best = min(best, time.perf_counter_ns() - t0)
        reps += 1
    return max(best, 1.0)


def _measure_cpu() -> Optional[dict[str, Any]]:
    import torch

    t0 = time.perf_counter()
    flops: dict[str, float] = {}
    for dtype, n, budget in ((torch.float32, 512, 0.15), (torch.bfloat16, 256, 0.1)):
        try:
            a = torch.empty(n, n, dtype=dtype).fill_(0.5)
            b = torch.empty(n, n, dtype=dtype).fill_(0.25)
            c = torch.empty(n, n, dtype=dtype)
            ns = _best_ns(functools.partial(torch.mm, a, b, out=c), budget, max_reps=20)
            flops[str(dtype).replace("torch.", "")] = 2.0 * n ** 3 / (ns / 1e9)
        except RuntimeError:
            continue
    n_el = 8 << 20                          # 32 MiB of float32 each: past the last-level cache
    src = torch.empty(n_el).fill_(1.0)
    dst = torch.empty(n_el)
    ns = _best_ns(functools.partial(dst.copy_, src), 0.15, max_reps=20)
    bw = 2.0 * src.numel() * 4 / (ns / 1e9)
    x, y, z = torch.empty(1).fill_(1.0), torch.empty(1).fill_(2.0), torch.empty(1)
    reps = 2000
    torch.add(x, y, out=z)
    t1 = time.perf_counter_ns()
    for _ in range(reps):
        torch.add(x, y, out=z)
    overhead = (time.perf_counter_ns() - t1) / reps
    try:
        bf16_native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        bf16_native = None
    return {"flops": flops, "bytes_per_s": bw, "overhead_ns": overhead, "bf16_native": bf16_native,
            "seconds": time.perf_counter() - t0, "spec": None, "method": "torch.mm best of reps; copy_ of 32 MiB; "
            "torch.add on 1 element"}


def _measure_cuda() -> Optional[dict[str, Any]]:
    import torch

    t0 = time.perf_counter()
    dev = torch.device("cuda", torch.cuda.current_device())
    sync = torch.cuda.synchronize
    flops: dict[str, float] = {}
    for dtype, n in ((torch.float32, 4096), (torch.bfloat16, 8192), (torch.float16, 8192)):
        try:
            a = torch.empty(n, n, dtype=dtype, device=dev).fill_(0.5)
            b = torch.empty(n, n, dtype=dtype, device=dev).fill_(0.25)
            c = torch.empty(n, n, dtype=dtype, device=dev)
            ns = _event_ns(functools.partial(torch.mm, a, b, out=c), reps=10)
            flops[str(dtype).replace("torch.", "")] = 2.0 * n ** 3 / (ns / 1e9)
            del a, b, c
        except RuntimeError:
            continue
    try:
        free = int(torch.cuda.mem_get_info(dev)[0])
    except Exception:
        free = 4 << 30
    n_el = max(min(256 << 20, free // 16), 16 << 20)   # up to 1 GiB of float32 each, a quarter of what is free
    src = torch.empty(n_el, device=dev).fill_(1.0)
    dst = torch.empty(n_el, device=dev)
    ns = _event_ns(functools.partial(dst.copy_, src), reps=10)
    bw = 2.0 * n_el * 4 / (ns / 1e9)
    x, y, z = (torch.empty(1, device=dev).fill_(v) for v in (1.0, 2.0, 0.0))
    reps = 1000
    torch.add(x, y, out=z)
    sync()
    t1 = time.perf_counter_ns()
    for _ in range(reps):
        torch.add(x, y, out=z)
    overhead = (time.perf_counter_ns() - t1) / reps
    sync()
    name = torch.cuda.get_device_name(dev)
    spec = spec_sheet(name)
    torch.cuda.empty_cache()
    return {"flops": flops, "bytes_per_s": bw, "overhead_ns": overhead, "seconds": time.perf_counter() - t0,
            "spec": spec, "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "method": f"torch.mm best of 10 (CUDA events); copy_ of {n_el * 4 >> 20} MiB; torch.add launches on 1 element"}


def _event_ns(fn: Callable[[], Any], reps: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e6)
    return max(best, 1.0)
