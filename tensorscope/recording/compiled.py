"""Compiled regions opened up: what torch.compile built while a trace recorded, and what ran it.

``CompileCapture`` puts one handler on PyTorch's structured-trace logger while a trace records
and keeps the records tensorscope reads as plain strings; ``graphs_from_records`` parses them
into one record per graph (Dynamo/AOT graphs and their nodes, guards, recompile reasons,
Inductor code). ``compiled_link.py`` builds the ``graphs``/``graph_nodes`` tables from them and
links ops and calls to the graph that ran them.

Rules and details: docs/development/recording.md#torchcompile-capture-recordingcompiledpy and
docs/development/architecture.md#compiled-regions-recordingcompiledpy
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from typing import Any, Optional

#: one structured-trace record kept: (name, metadata, compile key, payload, perf_counter_ns)
Record = tuple[str, Any, tuple[Any, ...], Any, int]

_KEEP = frozenset({
    "dynamo_start", "dynamo_output_graph", "dynamo_cpp_guards_str", "dynamo_guards", "compilation_metrics",
    "bwd_compilation_metrics", "aot_forward_graph", "aot_inference_graph", "aot_backward_graph",
    "inductor_output_code",
})
_KEEP_ARTIFACTS = frozenset({
    "recompile_reasons", "fx_graph_cache_hit", "fx_graph_cache_miss", "fx_graph_cache_bypass",
    "aotautograd_cache_hit", "aotautograd_cache_miss", "aotautograd_cache_bypass",
})

#: graphs compiled in earlier traces of this process, by generated code file (bounded)
_REGISTRY: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
_REGISTRY_BY_HASH: dict[str, str] = {}
_REGISTRY_MAX = 256
_REGISTRY_LOCK = threading.Lock()
#: Inductor's generated module names: c<hash>.py
_GENERATED = re.compile(r"^c[a-z0-9]{20,}\.py$")


class _Handler(logging.Handler):
    """Keeps the structured-trace records tensorscope reads. Never raises into PyTorch."""

    def __init__(self, sink: list[Record]) -> None:
        super().__init__(level=logging.DEBUG)
        self.sink = sink
        self.errors = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            md = getattr(record, "metadata", None)
            if not isinstance(md, dict) or not md:
                return
            name = next(iter(md))
            info = md.get(name)
            if name == "artifact":
                aname = info.get("name") if isinstance(info, dict) else None
                if aname not in _KEEP_ARTIFACTS:
                    return
                name = aname
            elif name not in _KEEP:
                return
            key = (md.get("frame_id"), md.get("frame_compile_id"), md.get("attempt"), md.get("compiled_autograd_id"))
            self.sink.append((name, info, key, getattr(record, "payload", None), time.perf_counter_ns()))
        except Exception:
            self.errors += 1

    def handleError(self, record: logging.LogRecord) -> None:   # never print a logging traceback into the user's cell
        self.errors += 1


class CompileCapture:
    """Installed by the session for the duration of a trace; ``close()`` removes it (idempotent)."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self._handler: Optional[_Handler] = None
        self._logger: Optional[logging.Logger] = None

    def install(self) -> CompileCapture:
        try:
            from torch._logging._internal import trace_log
        except Exception:   # an older torch without structured tracing: nothing to capture
            return self
        self._handler = _Handler(self.records)
        self._logger = trace_log
        trace_log.addHandler(self._handler)
        return self

    def close(self) -> None:
        if self._handler is not None and self._logger is not None:
            try:
                self._logger.removeHandler(self._handler)
            finally:
                self._handler = None

    @property
    def handler_errors(self) -> int:
        return self._handler.errors if self._handler is not None else 0


# -- parsing the readable graphs ----------------------------------------------------------------------------

_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_DTYPES = {
    "f32": "float32", "f64": "float64", "f16": "float16", "bf16": "bfloat16", "i64": "int64", "i32": "int32",
    "i16": "int16", "i8": "int8", "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64", "b8": "bool",
    "c32": "complex32", "c64": "complex64", "c128": "complex128", "f8e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2", "f8e4m3fnuz": "float8_e4m3fnuz", "f8e5m2fnuz": "float8_e5m2fnuz",
}
_ANN_TENSOR = re.compile(r"([a-z]+[0-9a-z]*)\[([^\]]*)\]\[([^\]]*)\]([a-z]+(?::\d+)?)?")
_NODE = re.compile(r'^\s*(\w+)(?:\s*:\s*"([^"]*)")?\s*=\s*([\w.]+)\((.*)$')
_PARAM = re.compile(r'(\w+)\s*:\s*"([^"]*)"')
_FILE = re.compile(r"^\s*# File: (.+?):(\d+) in ")


def _dims(text: str) -> list[int]:
    out = []
    for d in text.split(","):
        d = d.strip()
        if not d:
            continue
        try:
            out.append(int(d))
        except ValueError:
            out.append(-1)   # a symbolic size (s0, 2*s1): dynamic
    return out


def parse_annotation(ann: Optional[str]) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """``"f32[3, 8][8, 1]cpu"`` -> ([[3, 8]], [[8, 1]], ["float32"]) (several for tuple outputs)."""
    shapes: list[list[int]] = []
    strides: list[list[int]] = []
    dtypes: list[str] = []
    for m in _ANN_TENSOR.finditer(ann or ""):
        code = m.group(1)
        if code not in _DTYPES and not code.startswith(("f", "i", "u", "b", "c")):
            continue
        dtypes.append(_DTYPES.get(code, code))
        shapes.append(_dims(m.group(2)))
        strides.append(_dims(m.group(3)))
    return shapes, strides, dtypes


def _short_target(target: str, locals_: set[str]) -> str:
    if target.startswith("torch.ops."):
        return target[len("torch.ops."):]
    head = target.split(".", 1)[0]
    if head in locals_ and "." in target:
        return "Tensor." + target.rsplit(".", 1)[1]   # a method call on a graph value: linear_1.sum()
    return target


def parse_graph(text: Optional[str]) -> list[dict[str, Any]]:
    """Nodes of a readable FX graph (``GraphModule.print_readable(include_stride=True)``), in order.

    Placeholders are ``op="input"``, the return is ``op="output"``; call nodes carry
    their target (``aten.addmm.default``, ``torch._C._nn.linear``, ``Tensor.sum``).
    """
    nodes: list[dict[str, Any]] = []
    if not text:
        return nodes
    locals_: set[str] = set()
    src_file: Optional[str] = None
    src_line: Optional[int] = None
    in_sig = False
    in_return = False
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("def forward("):
            in_sig = not stripped.endswith("):")
            for name, ann in _PARAM.findall(stripped):
                _add_node(nodes, name, "input", ann, None, None)
                locals_.add(name)
            continue
        if in_sig:
            if stripped.startswith(")"):
                in_sig = False
                continue
            for name, ann in _PARAM.findall(stripped.split("#", 1)[0]):
                _add_node(nodes, name, "input", ann, None, None)
                locals_.add(name)
            continue
        m = _FILE.match(line)
        if m:
            src_file, src_line = m.group(1), int(m.group(2))
            if src_file.startswith(_OWN_DIR):   # Dynamo traced through tensorscope's own mode: not a user line
                src_file = src_line = None
            continue
        if stripped.startswith("return"):
            _add_node(nodes, "output", "output", None, None, None)
            in_return = stripped.endswith("(")
            continue
        if in_return:
            if stripped.startswith(")"):
                in_return = False
            continue
        if stripped.startswith(("#", "class ", "def ")):
            continue
        m = _NODE.match(line)
        if m:
            name, ann, target = m.group(1), m.group(2), m.group(3)
            _add_node(nodes, name, _short_target(target, locals_), ann, src_file, src_line)
            locals_.add(name)
            continue
    return nodes


def _add_node(nodes: list[dict[str, Any]], name: str, op: str, ann: Optional[str], src_file: Optional[str],
              src_line: Optional[int]) -> None:
    shapes, strides, dtypes = parse_annotation(ann)
    nodes.append(dict(idx=len(nodes), name=name, op=op, shapes=shapes, strides=strides, dtypes=dtypes,
                      source_file=src_file, source_line=src_line))


_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.(\w+)\(", re.M)
_EXTERN = re.compile(r"\bextern_kernels\.(\w+)\(")
_FALLBACK = re.compile(r"\btorch\.ops\.(\w+\.\w+\.\w+)\(|\baten\.(\w+\.\w+)\(")


def parse_output_code(code: Optional[str]) -> dict[str, Any]:
    """Kernels the generated ``call()`` launches, in order: fused kernels, extern kernels, ATen fallbacks."""
    if not code:
        return dict(kernels=[], aot_id=None)
    aot = re.search(r"^# AOT ID: \['([^']*)'\]", code, re.M)
    defined = {m.group(1) for m in _KERNEL_DEF.finditer(code)}
    body = code
    i = code.find("\ndef call(")
    if i >= 0:
        j = code.find("\ndef benchmark_compiled_module", i)
        k = code.find("\nif __name__", i)
        ends = [e for e in (j, k) if e > 0]
        body = code[i:min(ends)] if ends else code[i:]
    kernels: list[str] = []
    if defined:
        call_re = re.compile(r"\b(" + "|".join(sorted(map(re.escape, defined), key=len, reverse=True))
                             + r")(?:\.run)?\(")
    else:
        call_re = None
    for line in body.splitlines():
        s = line.strip()
        if s.startswith("#") or s.startswith("def "):
            continue
        for m in _EXTERN.finditer(s):
            kernels.append("extern_kernels." + m.group(1))
        for m in _FALLBACK.finditer(s):
            kernels.append("aten." + (m.group(2) or m.group(1).split(".", 1)[1]) if m.group(2)
                           else m.group(1))
        if call_re is not None:
            for m in call_re.finditer(s):
                kernels.append(m.group(1))
    return dict(kernels=kernels, aot_id=aot.group(1) if aot else None)


def _guard_lines(text: Optional[str]) -> list[str]:
    out = []
    for line in (text or "").splitlines():
        m = re.match(r"^[|\s]*\+- ([A-Z_]+): (.*)$", line)
        if not m or m.group(1) in ("GuardManager", "RootGuardManager", "DictGuardManager"):
            continue
        expr = m.group(2).split("  # ", 1)[0].strip()
        out.append(f"{m.group(1)}: {expr}")
    return out


def _reason(payload: Any) -> Optional[str]:
    if payload is None:
        return None
    if isinstance(payload, str):
        try:
            v = json.loads(payload)
        except ValueError:
            return payload.strip() or None
    else:
        v = payload
    if isinstance(v, list):
        return "; ".join(str(x) for x in v) or None
    return str(v)


def _cid(key: tuple[Any, ...]) -> str:
    frame, fcid, _attempt, ca = key
    s = f"{frame}/{fcid}" if frame is not None else "?"
    return f"!{ca}/{s}" if ca is not None else s


# -- records -> graph rows -------------------------------------------------------------------------------------

def graphs_from_records(records: list[Record]) -> list[dict[str, Any]]:
    """One dict per graph (with its ``nodes``), in compile order. Pure: strings in, dicts out."""
    comps: OrderedDict[tuple[Any, ...], dict[str, Any]] = OrderedDict()

    def comp(key: tuple[Any, ...]) -> dict[str, Any]:
        ck = key[:2] + (key[3],)
        c = comps.get(ck)
        if c is None:
            c = comps[ck] = dict(key=key, graphs=[], metrics=None, bwd_metrics=None, guards=[], reason=None,
                                 cache=[], start_ns=None)
        return c

    for name, info, key, payload, ts in records:
        c = comp(key)
        if c["start_ns"] is None:
            c["start_ns"] = ts
        if name == "dynamo_output_graph":
            c["graphs"].append(dict(kind="dynamo", phase=None, nodes=parse_graph(payload), ts=ts))
        elif name in ("aot_forward_graph", "aot_inference_graph", "aot_backward_graph"):
            phase = {"aot_forward_graph": "forward", "aot_inference_graph": "inference",
                     "aot_backward_graph": "backward"}[name]
            kind = "aot_backward" if phase == "backward" else "aot_forward"
            c["graphs"].append(dict(kind=kind, phase=phase, nodes=parse_graph(payload), ts=ts))
        elif name == "inductor_output_code":
            parsed = parse_output_code(payload)
            aot_id = parsed["aot_id"] or ""
            phase = ("backward" if aot_id.endswith("backward") else "inference" if aot_id.endswith("inference")
                     else "forward")
            file = (info or {}).get("filename") or (info or {}).get("file_path") if isinstance(info, dict) else None
            digest = hashlib.md5(payload.encode("utf-8"), usedforsecurity=False).hexdigest() if payload else None
            c["graphs"].append(dict(kind="inductor", phase=phase, nodes=[], ts=ts, kernels=parsed["kernels"],
                                    code_file=file, code_md5=digest))
        elif name in ("dynamo_cpp_guards_str",):
            c["guards"] = _guard_lines(payload)
        elif name == "dynamo_guards" and not c["guards"]:
            try:
                c["guards"] = [str(g.get("code") or g) for g in json.loads(payload or "[]")]
            except (ValueError, AttributeError):
                pass
        elif name == "recompile_reasons":
            c["reason"] = _reason(payload)
        elif name == "compilation_metrics":
            c["metrics"] = info if isinstance(info, dict) else None
        elif name == "bwd_compilation_metrics":
            c["bwd_metrics"] = info if isinstance(info, dict) else None
        elif name.startswith(("fx_graph_cache_", "aotautograd_cache_")):
            c["cache"].append(name)
    out: list[dict[str, Any]] = []
    for c in comps.values():
        if not c["graphs"]:
            continue
        m = c["metrics"] or {}
        bm = c["bwd_metrics"] or {}

        def secs(d: dict[str, Any], k: str) -> Optional[int]:
            v = d.get(k)
            return int(round(float(v) * 1e9)) if isinstance(v, (int, float)) else None

        cid = _cid(c["key"])
        seen_inductor: set[Optional[str]] = set()
        for g in c["graphs"]:
            g["compile_id"] = cid
            g["frame"] = m.get("co_name")
            g["source_file"] = m.get("co_filename")
            g["source_line"] = m.get("co_firstlineno")
            g["guards"] = c["guards"] if g["kind"] == "dynamo" else []
            g["recompile_reason"] = c["reason"] if g["kind"] == "dynamo" else None
            g["cache"] = ",".join(sorted(set(c["cache"]))) or None
            if g["kind"] == "dynamo":
                g["compile_ns"] = secs(m, "entire_frame_compile_time_s")
            elif g["kind"] == "aot_forward":
                g["compile_ns"] = secs(m, "backend_compile_time_s")
            elif g["kind"] == "inductor":
                if g["phase"] == "backward":
                    g["compile_ns"] = secs(bm, "inductor_compile_time_s")
                elif g["phase"] not in seen_inductor:
                    g["compile_ns"] = secs(m, "inductor_compile_time_s")
                seen_inductor.add(g["phase"])
            g.setdefault("compile_ns", None)
            out.append(g)
    return out


def _remember(graphs: list[dict[str, Any]]) -> None:
    """Keep this trace's compiles for later traces that only run them (bounded, oldest dropped)."""
    by_cid: dict[str, list[dict[str, Any]]] = {}
    for g in graphs:
        by_cid.setdefault(g["compile_id"], []).append(g)
    with _REGISTRY_LOCK:
        for group in by_cid.values():
            for g in group:
                if g["kind"] == "inductor" and g.get("code_file"):
                    _REGISTRY[g["code_file"]] = group
                    _REGISTRY.move_to_end(g["code_file"])
                    if g.get("code_md5"):
                        _REGISTRY_BY_HASH[g["code_md5"]] = g["code_file"]
        while len(_REGISTRY) > _REGISTRY_MAX:
            f, group = _REGISTRY.popitem(last=False)
            for g in group:
                if g.get("code_md5") in _REGISTRY_BY_HASH and _REGISTRY_BY_HASH[g["code_md5"]] == f:
                    del _REGISTRY_BY_HASH[g["code_md5"]]


def _file_md5(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return hashlib.md5(f.read(), usedforsecurity=False).hexdigest()
    except OSError:
        return None


# -- tables ----------------------------------------------------------------------------------------------------
