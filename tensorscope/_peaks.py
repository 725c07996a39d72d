"""Machine peaks for the roofline: GEMM FLOP/s per dtype, copy bandwidth, the per-op floor; validated, cached.

``machine_peaks(device="cpu")`` returns ``{"flops": {dtype: FLOP/s}, "bytes_per_s": ...,
"overhead_ns": ..., "bound": {...}, "detail": {...}, "contended": bool, ...}`` for this machine,
read from a JSON file beside the native build cache (``native.cache_dir()``, ``$TENSORSCOPE_CACHE``)
keyed by the device (CPU model or GPU name), torch's thread count, the torch version and the
recipe; on a miss it is measured and written there.

How a peak is measured (``RECIPE`` 2): ``torch.mm`` of square matrices at each of ``SIZES``
(the same sizes for every dtype), each size warmed up first (oneDNN builds its kernels on the
first calls), then timed ``MIN_REPS`` to ``MAX_REPS`` times within ``REP_BUDGET_S``, on torch's own
intra-op threads. The peak of a dtype is the best rate over sizes; ``detail`` keeps per size
the best and the median rate, the repetitions and their spread (``(median - best) / median`` of the
times). On CPU the repetitions of each size also read this process's CPU time: when torch's
threads got less than ``CLEAN_SHARE`` of ``threads x wall`` while the GEMMs ran (over the whole
measurement, or at the largest size), they ran beside a competing load; that, or a figure under
``SANE_SHARE`` of the theoretical bound, marks the result ``contended``: it is used (the best seen) but not trusted, and the next call
that may measure measures again (at most once per ``RETRY_S``).

Each figure is bounded by the hardware's theoretical peak (``theoretical_peaks``): on CPU
``threads x SIMD lanes x FMA units x 2 x clock`` from ``/proc/cpuinfo``'s flags (``avx512f``,
``avx2``, ``fma``; ``amx_bf16``/``avx512_bf16``, ``amx_fp16``/``avx512_fp16`` for 16-bit) and
the clock (sysfs ``cpuinfo_max_freq``, else the ``@ x.xxGHz`` of the model name or the highest
``cpu MHz``, both times ``TURBO_HEADROOM`` since a turbo clock may be higher); on CUDA the spec sheet of a known GPU (``SPEC_SHEETS``). A measured op faster than
the cached peak (``analyses.roofline.beats_peak``) makes the caller re-measure (``machine_peaks(refresh=True)``).
``refresh=True`` measures again and keeps, per figure, the best of the clean runs.

The micro-benchmark runs with every Python mode off (ours and the user's), with RecordFunction
off on this thread when the native engine is loaded (so no trace and no ``torch.profiler``
sees it), without autograd or autocast, and draws no random numbers (tensors are ``empty``
then ``fill_``). With a profiler running and no native engine to hide from it, nothing is
measured (``None``).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import re
import statistics
import time
from typing import Any, Callable, Optional

RECIPE = 2
#: square GEMM sizes timed for every dtype (CPU; CUDA uses ``CUDA_SIZES``)
SIZES = (256, 512, 1024)
CUDA_SIZES = (2048, 4096, 8192)
MIN_REPS = 5
MAX_REPS = 2000
REP_BUDGET_S = 0.15
WARMUP_S = 0.05
#: a measurement is clean when torch's threads got at least this share of ``threads x wall`` of CPU time
#: (summed over all repetitions of a size: the kernel updates other threads' CPU time at scheduler ticks)
CLEAN_SHARE = 0.8
#: a clock read from ``cpu MHz`` or the model name is the current or base clock: turbo may run this much faster
TURBO_HEADROOM = 1.5
#: a measured figure under this share of its theoretical bound is suspect (a competing load, a throttled CPU)
SANE_SHARE = 0.05
#: a contended peak is measured again at most this often (seconds)
RETRY_S = 30.0
#: upper bound of the FMA units per core (server cores issue two 512-bit or 256-bit FMAs a cycle)
FMA_UNITS = 2
#: FLOP per cycle per core of Intel AMX (BF16 and FP16 tiles)
AMX_FLOP_PER_CYCLE = 1024
_MEMO: dict[str, dict[str, Any]] = {}
_LAST_TRY: dict[str, float] = {}
#: how many measurements this process ran (tests read it to see that a re-measure happened)
MEASUREMENTS = 0

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


@functools.cache
def _cpuinfo() -> tuple[frozenset[str], float, str]:
    """(the first CPU's flags, the clock in Hz, where the clock was read) from /proc/cpuinfo and sysfs."""
    flags: frozenset[str] = frozenset()
    mhz: list[float] = []
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "flags" and not flags:
                    flags = frozenset(val.split())
                elif key == "cpu MHz":
                    with contextlib.suppress(ValueError):
                        mhz.append(float(val))
                elif key == "model name" and not model:
                    model = val.strip()
    except OSError:
        pass
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
            return flags, float(f.read().strip()) * 1e3, "sysfs cpuinfo_max_freq"
    except (OSError, ValueError):
        pass
    m = re.search(r"@\s*([0-9.]+)\s*GHz", model)
    if m:
        return flags, float(m.group(1)) * 1e9, "the model name's clock"
    if mhz:
        return flags, max(mhz) * 1e6, "/proc/cpuinfo cpu MHz"
    return flags, 0.0, "unknown"


def theoretical_peaks(threads: Optional[int] = None) -> dict[str, Any]:
    """The CPU's theoretical FLOP/s per dtype on ``threads`` cores (torch's intra-op threads by default):
    ``{"flops": {dtype: FLOP/s}, "per_cycle": {dtype: FLOP per cycle per core}, "clock_hz", "clock_source",
    "cores", "how"}``; ``flops`` is empty when the clock or the SIMD width is unknown."""
    import torch

    flags, clock, source = _cpuinfo()
    cores = min(int(threads or torch.get_num_threads()), os.cpu_count() or 1)
    if "avx512f" in flags:
        lanes, isa = 16, "avx512f"
    elif "avx2" in flags or "avx" in flags:
        lanes, isa = 8, "avx2" if "avx2" in flags else "avx"
    elif "sse2" in flags or "asimd" in flags:
        lanes, isa = 4, "sse2" if "sse2" in flags else "asimd"
    else:
        lanes, isa = 0, "unknown SIMD"
    fma = FMA_UNITS if ("fma" in flags or "avx512f" in flags or "asimd" in flags) else 1
    fp32 = lanes * 2 * fma if "fma" in flags or "avx512f" in flags or "asimd" in flags else lanes * fma
    per: dict[str, float] = {"float32": float(fp32)}
    bf16 = "amx_bf16 (1024 FLOP/cycle)" if "amx_bf16" in flags else ("avx512_bf16" if "avx512_bf16" in flags else "none")
    per["bfloat16"] = (AMX_FLOP_PER_CYCLE if "amx_bf16" in flags else
                       2 * lanes * 2 * fma if "avx512_bf16" in flags else fp32)
    fp16 = "amx_fp16" if "amx_fp16" in flags else ("avx512_fp16" if "avx512_fp16" in flags else "none")
    per["float16"] = (AMX_FLOP_PER_CYCLE if "amx_fp16" in flags else
                      2 * lanes * 2 * fma if "avx512_fp16" in flags else fp32)
    turbo = 1.0 if source.startswith("sysfs") else TURBO_HEADROOM
    flops = {k: v * cores * clock * turbo for k, v in per.items()} if (clock and lanes) else {}
    how = (f"{cores} cores x {lanes} fp32 lanes ({isa}) x {fma} FMA units x 2 x {clock * turbo / 1e9:.2f} GHz "
           f"(clock from {source}" + (f", x{turbo:g} for turbo" if turbo != 1 else "")
           + f"); 16-bit units: bf16 {bf16}, fp16 {fp16}")
    return {"flops": flops, "per_cycle": per, "clock_hz": clock, "clock_source": source, "cores": cores,
            "how": how}


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

    A cached result marked ``contended`` (measured beside a competing load) is measured again when
    ``measure`` allows it (at most once per ``RETRY_S``). None when ``measure=False`` and nothing is
    cached, when CUDA is asked for but unavailable, or when a profiler is running that the benchmark
    could not be hidden from."""
    import torch

    if device not in ("cpu", "cuda"):
        from .errors import OptionsError

        raise OptionsError(f"machine_peaks(device=...) takes 'cpu' or 'cuda', not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        return None
    ident = _identity(device)
    memo_key = json.dumps(ident, sort_keys=True)
    path = cache_path(ident)
    retry = measure and time.monotonic() - _LAST_TRY.get(path, -1e9) >= RETRY_S
    if not refresh and memo_key in _MEMO and not (_MEMO[memo_key].get("contended") and retry):
        return dict(_MEMO[memo_key])
    old = _read(path, ident)
    d = None if (refresh or (old is not None and old.get("contended") and retry)) else old
    if d is None:
        if not measure:
            return None
        _LAST_TRY[path] = time.monotonic()
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


def same_machine(p: dict[str, Any], device: str = "cpu") -> bool:
    """Whether peaks ``p`` (recorded with a trace) were measured on this machine with these threads."""
    try:
        ident = _identity(device)
    except Exception:
        return False
    return all(p.get(k) == ident[k] for k in ("name", "threads", "torch"))


_SPEEDUPS: dict[tuple[int, int, int, int], Optional[tuple[str, float, str]]] = {}


def gemm_speedup(shape: tuple[int, int, int, int]) -> Optional[tuple[str, float, str]]:
    """``(dtype, rate / float32 rate, how)`` of the fastest 16-bit dtype on a CPU GEMM of ``shape``
    (batch, M, K, N), each dtype timed like a peak (warmed up, best of repetitions, hidden from every mode
    and profiler); None when it cannot be measured. Memoised per shape for the process."""
    if shape in _SPEEDUPS:
        return _SPEEDUPS[shape]

    def run() -> Optional[dict[str, Any]]:
        import torch

        bsz, m, k, n = (max(int(x), 1) for x in shape)
        threads = int(torch.get_num_threads())
        rates: dict[str, float] = {}
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            try:
                a = torch.empty(bsz, m, k, dtype=dtype).fill_(0.5)
                b = torch.empty(bsz, k, n, dtype=dtype).fill_(0.25)
                c = torch.empty(bsz, m, n, dtype=dtype)
                reps = _reps(functools.partial(torch.bmm, a, b, out=c), REP_BUDGET_S / 2, threads)
            except RuntimeError:
                continue
            rates[str(dtype).replace("torch.", "")] = 2.0 * bsz * m * k * n / (min(w for w, _ in reps) / 1e9)
        return {"rates": rates}

    got = _hidden(run)
    global MEASUREMENTS
    MEASUREMENTS -= 1          # not a peak measurement
    out: Optional[tuple[str, float, str]] = None
    rates = (got or {}).get("rates") or {}
    if rates.get("float32"):
        best = max(((k, v) for k, v in rates.items() if k != "float32"), key=lambda kv: kv[1], default=None)
        if best:
            b_, m_, k_, n_ = shape
            out = (best[0], best[1] / rates["float32"],
                   f"on a GEMM of the same shape ({f'{b_}x' if b_ > 1 else ''}{m_}x{k_} @ {k_}x{n_})")
    _SPEEDUPS[shape] = out
    return out


def _best_of(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A peak is the best the machine reached: per figure the higher of the two, except that a clean new run
    replaces a contended old one (whose figures are not to be trusted) and an old recipe's figures."""
    if (old.get("contended") and not new.get("contended")) or old.get("recipe") != RECIPE:
        return new
    out = dict(new)
    bound = (new.get("bound") or {}).get("flops") or {}
    fl = dict(new.get("flops") or {})
    detail = dict(new.get("detail") or {})
    for k, v in (old.get("flops") or {}).items():
        if v and v > (fl.get(k) or 0.0) and (not bound.get(k) or v <= float(bound[k])):
            fl[k] = v
            if k in (old.get("detail") or {}):
                detail[k] = old["detail"][k]
    out["flops"], out["detail"] = fl, detail
    if new.get("contended") and not old.get("contended"):   # a contended re-check keeps the clean figures
        out["contended"] = False
        out["contended_why"] = []
        out["cpu_share"] = old.get("cpu_share")
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

    global MEASUREMENTS
    MEASUREMENTS += 1

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


def _reps(fn: Callable[[], Any], budget_s: float, threads: int, sync: Callable[[], Any] = lambda: None,
          ) -> list[tuple[int, int]]:
    """``(wall_ns, cpu_ns)`` of each timed call of ``fn`` after a warm-up (at least ``MIN_REPS``)."""
    end = time.perf_counter() + WARMUP_S
    for i in range(20):
        fn()
        sync()
        if i >= 2 and time.perf_counter() > end:
            break
    out: list[tuple[int, int]] = []
    end = time.perf_counter() + budget_s
    while len(out) < MIN_REPS or (time.perf_counter() < end and len(out) < MAX_REPS):
        c0 = time.process_time_ns()
        t0 = time.perf_counter_ns()
        fn()
        sync()
        t1 = time.perf_counter_ns()
        out.append((max(t1 - t0, 1), time.process_time_ns() - c0))
    return out


def _summary(reps: list[tuple[int, int]], work: float, threads: int, cpu: bool) -> dict[str, Any]:
    """Per size: best and median rate over the repetitions, their spread, the CPU share torch's threads got."""
    walls = [w for w, _ in reps]
    best, med = min(walls), statistics.median(walls)
    share = sum(c for _, c in reps) / (sum(walls) * threads) if cpu else None
    return {"best": work / (best / 1e9), "median": work / (med / 1e9), "reps": len(reps),
            "spread": (med - best) / med if med else 0.0, "cpu_share": share}


def _measure_cpu() -> Optional[dict[str, Any]]:
    import torch

    t0 = time.perf_counter()
    threads = int(torch.get_num_threads())
    bound = theoretical_peaks(threads)
    flops: dict[str, float] = {}
    detail: dict[str, Any] = {}
    wall = cpu = 0
    contended_why: list[str] = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        sizes: dict[str, Any] = {}
        try:
            for n in SIZES:
                a = torch.empty(n, n, dtype=dtype).fill_(0.5)
                b = torch.empty(n, n, dtype=dtype).fill_(0.25)
                c = torch.empty(n, n, dtype=dtype)
                reps = _reps(functools.partial(torch.mm, a, b, out=c), REP_BUDGET_S, threads)
                wall += sum(w for w, _ in reps)
                cpu += sum(c_ for _, c_ in reps)
                sizes[str(n)] = _summary(reps, 2.0 * n ** 3, threads, True)
        except RuntimeError:
            continue
        best_n = max(sizes, key=lambda k: sizes[k]["best"])
        flops[name] = sizes[best_n]["best"]
        detail[name] = {"sizes": sizes, "best_size": int(best_n), "spread": sizes[best_n]["spread"]}
        big = sizes[str(SIZES[-1])]["cpu_share"]
        if big < CLEAN_SHARE:
            contended_why.append(f"torch's threads got {100 * big:.0f}% of the CPU at {SIZES[-1]}^3 {name}")
        b_ = (bound.get("flops") or {}).get(name)
        if b_ and flops[name] < SANE_SHARE * b_:
            contended_why.append(f"{name} at {100 * flops[name] / b_:.1f}% of its theoretical bound")
    share = cpu / (wall * threads) if wall else 1.0
    if share < CLEAN_SHARE:
        contended_why.insert(0, f"torch's {threads} threads got {100 * share:.0f}% of the CPU while timed")
    n_el = 8 << 20                          # 32 MiB of float32 each: past the last-level cache
    src = torch.empty(n_el).fill_(1.0)
    dst = torch.empty(n_el)
    bw_s = _summary(_reps(functools.partial(dst.copy_, src), REP_BUDGET_S, threads), 2.0 * n_el * 4, threads, True)
    x, y, z = torch.empty(1).fill_(1.0), torch.empty(1).fill_(2.0), torch.empty(1)
    n_add = 2000
    torch.add(x, y, out=z)
    best_floor = float("inf")
    for _ in range(3):   # the best of three loops: a loop the scheduler interrupted is not the floor
        t1 = time.perf_counter_ns()
        for _ in range(n_add):
            torch.add(x, y, out=z)
        best_floor = min(best_floor, (time.perf_counter_ns() - t1) / n_add)
    try:
        bf16_native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        bf16_native = None
    return {"flops": flops, "detail": detail, "bytes_per_s": bw_s["best"], "bytes_detail": bw_s,
            "overhead_ns": best_floor, "bf16_native": bf16_native, "bound": bound, "cpu_count": os.cpu_count(),
            "contended": bool(contended_why), "contended_why": contended_why, "cpu_share": share,
            "seconds": time.perf_counter() - t0, "spec": None,
            "method": (f"torch.mm at {', '.join(f'{n}^3' for n in SIZES)} per dtype on {threads} threads, warmed up, "
                       f"best of {MIN_REPS}+ repetitions in {REP_BUDGET_S:g} s each (CPU share checked); "
                       "copy_ of 32 MiB; torch.add on 1 element")}


def _measure_cuda() -> Optional[dict[str, Any]]:
    import torch

    t0 = time.perf_counter()
    dev = torch.device("cuda", torch.cuda.current_device())
    sync = torch.cuda.synchronize
    name = torch.cuda.get_device_name(dev)
    spec = spec_sheet(name)
    flops: dict[str, float] = {}
    detail: dict[str, Any] = {}
    why: list[str] = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        dname = str(dtype).replace("torch.", "")
        sizes: dict[str, Any] = {}
        try:
            for n in CUDA_SIZES:
                a = torch.empty(n, n, dtype=dtype, device=dev).fill_(0.5)
                b = torch.empty(n, n, dtype=dtype, device=dev).fill_(0.25)
                c = torch.empty(n, n, dtype=dtype, device=dev)
                times = _event_times(functools.partial(torch.mm, a, b, out=c), reps=10)
                sizes[str(n)] = _summary([(t, 0) for t in times], 2.0 * n ** 3, 1, False)
                del a, b, c
        except RuntimeError:
            pass
        if not sizes:
            continue
        best_n = max(sizes, key=lambda k: sizes[k]["best"])
        flops[dname] = sizes[best_n]["best"]
        detail[dname] = {"sizes": sizes, "best_size": int(best_n), "spread": sizes[best_n]["spread"]}
        if spec and spec.get(dname) and flops[dname] < SANE_SHARE * spec[dname]:
            why.append(f"{dname} at {100 * flops[dname] / spec[dname]:.1f}% of the spec sheet")
    try:
        free = int(torch.cuda.mem_get_info(dev)[0])
    except Exception:
        free = 4 << 30
    n_el = max(min(256 << 20, free // 16), 16 << 20)   # up to 1 GiB of float32 each, a quarter of what is free
    src = torch.empty(n_el, device=dev).fill_(1.0)
    dst = torch.empty(n_el, device=dev)
    bw_s = _summary([(t, 0) for t in _event_times(functools.partial(dst.copy_, src), reps=10)],
                    2.0 * n_el * 4, 1, False)
    del src, dst
    x, y, z = (torch.empty(1, device=dev).fill_(v) for v in (1.0, 2.0, 0.0))
    reps = 1000
    torch.add(x, y, out=z)
    sync()
    t1 = time.perf_counter_ns()
    for _ in range(reps):
        torch.add(x, y, out=z)
    overhead = (time.perf_counter_ns() - t1) / reps
    sync()
    torch.cuda.empty_cache()
    bound = {"flops": {k: v for k, v in (spec or {}).items() if k != "bytes_per_s"},
             "how": f"spec sheet of {name}" if spec else f"no spec sheet known for {name}"}
    return {"flops": flops, "detail": detail, "bytes_per_s": bw_s["best"], "bytes_detail": bw_s,
            "overhead_ns": overhead, "seconds": time.perf_counter() - t0, "spec": spec, "bound": bound,
            "contended": bool(why), "contended_why": why, "cpu_share": None,
            "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "method": (f"torch.mm at {', '.join(f'{n}^3' for n in CUDA_SIZES)} per dtype, best of 10 (CUDA events); "
                       f"copy_ of {n_el * 4 >> 20} MiB; torch.add launches on 1 element")}


def _event_times(fn: Callable[[], Any], reps: int) -> list[int]:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(max(int(a.elapsed_time(b) * 1e6), 1))
    return out
