"""The device/build report (``tensorscope.env()``, ``%tensorscope env``) as text and as HTML.

``_env.EnvReport`` is data (versions, devices, switches); this module draws it.
"""
from __future__ import annotations

from .html import BOX_STYLE, TITLE_STYLE, html_table


def gpu_text(g) -> str:
    """``cuda:0 NVIDIA H200, sm_90, 132 SMs, 139.8 GiB; native code (sm_90)``."""
    mem = f"{g.total_memory / 2**30:.1f} GiB" if g.total_memory else "? GiB"
    how = {"sass": f"native code ({g.code_arch})",
           "ptx": f"PTX JIT from {g.code_arch} (no machine code for {g.capability}: first calls compile)",
           "none": f"NO kernels for {g.capability} in this build"}.get(g.code, g.code)
    return f"cuda:{g.index} {g.name}, {g.capability}, {g.sm_count} SMs, {mem}; {how}"


def _rate(v, unit: str) -> str:
    if not v:
        return "?"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if v >= scale:
            return f"{v / scale:.1f} {prefix}{unit}"
    return f"{v:.0f} {unit}"


def peak_text(p) -> str:
    """``float32 95.1 GFLOP/s (±4%, 36% of 266.2 GFLOP/s theoretical), ...; copy 12.0 GB/s; per-op floor 1.8 µs
    (measured ...)``: each figure with its spread over repetitions and its share of the theoretical bound."""
    from .._common import fmt_ns

    bound = ((p.get("bound") or {}).get("flops") or {})
    detail = p.get("detail") or {}
    parts = []
    for k, v in sorted((p.get("flops") or {}).items()):
        extra = []
        d = detail.get(k) or {}
        if d.get("best_size"):
            extra.append(f"at {d['best_size']}^3")
        if d.get("spread") is not None:
            extra.append(f"spread {100 * d['spread']:.0f}%")
        if bound.get(k) and v:
            frac = v / bound[k]
            extra.append(f"{100 * frac:.0f}% of {_rate(bound[k], 'FLOP/s')} theoretical"
                         + (" (above it: the clock or unit count read is too low)" if frac > 1 else ""))
        parts.append(f"{k} {_rate(v, 'FLOP/s')}" + (f" ({', '.join(extra)})" if extra else ""))
    out = f"{', '.join(parts)}; copy {_rate(p.get('bytes_per_s'), 'B/s')}; per-op floor {fmt_ns(p.get('overhead_ns'))}"
    out += f" ({p.get('name')}, {p.get('threads')} threads, measured {p.get('measured_at')})"
    if p.get("contended"):
        out += "; MEASURED UNDER LOAD (" + "; ".join(p.get("contended_why") or []) + "): measured again on next use"
    elif p.get("cpu_share") is not None:
        out += f"; torch's threads got {100 * p['cpu_share']:.0f}% of the CPU while timed"
    if p.get("method"):
        out += f"; how: {p['method']}"
    how = (p.get("bound") or {}).get("how")
    if how:
        out += f"; theoretical bound: {how}"
    spec = p.get("spec")
    if spec:
        sp = [f"{k} {100 * (p.get('flops') or {}).get(k, 0) / v:.0f}%" for k, v in sorted(spec.items())
              if k != "bytes_per_s" and v and (p.get("flops") or {}).get(k)]
        if spec.get("bytes_per_s") and p.get("bytes_per_s"):
            sp.append(f"bandwidth {100 * p['bytes_per_s'] / spec['bytes_per_s']:.0f}%")
        out += "; of the spec sheet: " + ", ".join(sp)
    return out


def env_rows(rep) -> list[tuple[str, str]]:
    """The report as (what, value) rows, in reading order."""
    def yn(v):
        return "?" if v is None else ("yes" if v else "no")

    rows = [
        ("python", f"{rep.python} on {rep.platform}"),
        ("torch", f"{rep.torch}" + (f" (git {rep.torch_git[:10]})" if rep.torch_git else "")
         + (" debug build" if rep.debug_build else "")),
    ]
    if rep.cuda_runtime or rep.hip:
        rows.append(("CUDA build", f"CUDA {rep.cuda_runtime}" if rep.cuda_runtime else f"HIP {rep.hip}"))
        rows.append(("cuDNN", str(rep.cudnn) if rep.cudnn is not None else "-"))
        rows.append(("arch list", " ".join(rep.arch_list) or "-"))
    else:
        rows.append(("CUDA build", "none (CPU-only torch build)"))
    rows.append(("CUDA devices", f"{rep.device_count} visible" + ("" if rep.cuda_available else " (CUDA unavailable)")))
    for g in rep.gpus:
        rows.append((f"cuda:{g.index}", gpu_text(g) + (f"; bf16 {yn(g.bf16)}" if g.bf16 is not None else "")))
    if rep.device_count and not rep.gpus:
        rows.append(("GPU details", rep.gpu_details))
    if rep.cuda_runtime or rep.device_count:
        rows.append(("TF32", f"matmul {yn(rep.tf32_matmul)}, cuDNN {yn(rep.tf32_cudnn)}"))
        rows.append(("cuDNN flags", f"enabled {yn(rep.cudnn_enabled)}, benchmark {yn(rep.cudnn_benchmark)}, "
                                    f"deterministic {yn(rep.cudnn_deterministic)}"))
    prec = ", ".join(f"{k}={v}" for k, v in rep.fp32_precision.items() if v is not None)
    rows.append(("float32 matmul precision", f"{rep.float32_matmul_precision}" + (f" ({prec})" if prec else "")))
    rows.append(("default dtype", rep.default_dtype))
    rows.append(("deterministic algorithms", yn(rep.deterministic_algorithms)))
    rows.append(("CPU", f"{rep.cpu_count} cores, capability {rep.cpu_capability or '?'}, "
                        f"bf16 native {yn(rep.cpu_bf16)}, oneDNN {yn(rep.mkldnn)}, OpenMP {yn(rep.openmp)}"))
    rows.append(("threads", f"intra-op {rep.num_threads}, inter-op {rep.num_interop_threads}"))
    for dev, p in sorted((getattr(rep, "peaks", None) or {}).items()):
        rows.append((f"peaks {dev}", peak_text(p)))
    for n in rep.notes:
        rows.append(("note", n))
    return rows


def env_text(rep) -> str:
    rows = env_rows(rep)
    w = max(len(k) for k, _ in rows)
    return "tensorscope env\n" + "\n".join(f"  {k.ljust(w)}  {v}" for k, v in rows)


def env_html(rep) -> str:
    return (f'<div class="tensorscope-env" style="{BOX_STYLE}"><div style="{TITLE_STYLE}">tensorscope env</div>'
            + html_table(None, env_rows(rep)) + "</div>")
