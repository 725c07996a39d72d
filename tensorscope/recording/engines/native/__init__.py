"""The native engine: ``native/engine.cpp``'s RecordFunction observer records every ATen op.

A thread-local RecordFunction callback records rows (interned op ids, metas, tuples, storage
ids) into a live block of ``chunk_rows`` rows, packs each full block column by column in the
recorder's chunk format, and hands the packed chunks over as bytes viewed by numpy: at the
end, or -- past ``spill_rows`` rows, or past ``HANDOVER_RECORDS`` finished storage records --
between two ops through ``NativeEngine._on_full``, so the recorder packs the records and, past
``spill_rows`` rows, spills as it does its own. No Python dispatch mode is on the stack: the program
sees plain eager. What the function mode and the module tracker set is forwarded to the
observer by the context this engine makes (``NativeRecordingContext``).
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional, cast

import numpy as np

from ...._common import CompileCallbacks
from ....native import abi_layout as _abi
from ....native import fields_dtype
from ...context import NativeRecordingContext, RecordingContext
from ...opfacts import FLOP_REGISTRY, FLOPS_CACHE, SHAPE_FLOP_OPS, formula_flops, op_schema_facts, screens
from ...recorder import F_BACKWARD, OPS_FIELDS, Recorder, pack, unpack
from ..base import EngineChoice

if TYPE_CHECKING:
    from ....options import TraceOptions
    from ...ophooks import OpHooks
    from ...protocols import FunctionMode, NativeSiteCapture

#: The C side's layout (native/abi.h) as this module decodes it. A loaded engine exports its own
#: (``abi()``): ``abi_mismatch`` compares the two before a trace uses it (the python engine records
#: instead, saying why), and tests/native/test_abi.py compares them field by field.
#: numpy view of abi.h's ``OpsRow``
ROW_DTYPE = fields_dtype(_abi.OPS_ROW_FIELDS, _abi.OPS_ROW_SIZE)

#: abi.h's row flag: the op's kernel threw (F_BACKWARD is recorder.py's, the same bit)
F_THREW = _abi.F_THREW
#: abi.h's packed chunk columns, in its PackedColumn order ("rflags": the engine's row flags)
PACKED_COLUMNS = _abi.PACKED_COLUMNS
#: abi.h's argument-encoding tags (ArgTag): each tag, then its payload
TAG_TENSOR, TAG_NONE, TAG_BOOL, TAG_INT, TAG_DOUBLE, TAG_INT_LIST, TAG_OTHER, TAG_BOOL_LIST, TAG_OUTPUTS = (
    _abi.TAG_TENSOR, _abi.TAG_NONE, _abi.TAG_BOOL, _abi.TAG_INT, _abi.TAG_DOUBLE, _abi.TAG_INT_LIST, _abi.TAG_OTHER,
    _abi.TAG_BOOL_LIST, _abi.TAG_OUTPUTS)
TAGS = dict(_abi.ARG_TAGS)
#: a packed column's width -> its numpy type (abi.h kPackedWidths: 'u' minus the base, 'i' raw int64)
_PACKED_DTYPES = {w: np.dtype(f"<{k}{w}").type for w, k in _abi.PACKED_WIDTHS.items()}

#: an interned meta's header (abi.h MetaKey), read by field name: the values' positions, then the sizes
_MK_NDIM, _MK_DTYPE, _MK_DEV_TYPE, _MK_DEV_INDEX, _MK_STRIDED = (_abi.META_KEY.index(k) for k in (
    "ndim", "dtype", "dev_type", "dev_index", "strided"))
_MK_HEADER = _abi.MK_HEADER

#: finished storage records the engine holds (64 B each there, ~15 B packed in ``rec.tensors``)
#: before it hands them over with its packed chunks at the next full block, spilling or not: a trace
#: of small ops makes a storage per op, and without this every record of it stayed in C until
#: ``spill_rows`` rows (64 B/op; 500,000 rows by default). 2^16: a block's worth at one storage per op,
#: ~4 MB in C at most. Only where ``spill_rows`` is more than ``4 * HANDOVER_RECORDS``: below,
#: the records go with the spill's hand-over within a few blocks anyway (at most ~spill_rows of
#: them in C, a fixed cost), and each extra hand-over's buffers, freed at the next spill, left
#: holes in the heap between the function mode's long-lived call blocks (recording at
#: ``spill_rows=200_000`` grew 16 B/op instead of 9). A hand-over costs ~6.5 ms of CPU (copying the
#: chunks and records out of C, packing the records): ~0.1 us/op at a storage per op, work the end
#: of the trace then no longer does.
HANDOVER_RECORDS = 1 << 16

#: c10::ScalarType values -> torch dtype attribute names (c10/core/ScalarType.h order)
_SCALAR_TYPES = (
    "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "complex32", "complex64",
    "complex128", "bool", "qint8", "quint8", "qint32", "bfloat16", "quint4x2", "quint2x4", "bits1x8", "bits2x4",
    "bits4x2", "bits8", "bits16", "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz",
    "uint16", "uint32", "uint64", "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7", "float8_e8m0fnu", "float4_e2m1fn_x2",
)
#: c10::DeviceType values -> device type names (c10/core/DeviceType.h order)
_DEVICE_TYPES = ("cpu", "cuda", "mkldnn", "opengl", "opencl", "ideep", "hip", "fpga", "maia", "xla", "vulkan",
                 "metal", "xpu", "mps", "meta", "hpu", "ve", "lazy", "ipu", "mtia", "privateuseone")




class EngineBusy(RuntimeError):
    """The native observer records one trace per process, and another trace holds it."""


_CLAIM = threading.Lock()   # held by the one NativeEngine that may start the observer


def _release(lock: Any) -> None:
    try:
        lock.release()
    except RuntimeError:
        pass


class NativeEngine:
    """The native engine behind the ``Engine`` seam: a C++ RecordFunction observer records the ops
    (one per process at a time: it is claimed when made), the native function mode the calls."""

    name = "native"

    def __init__(self, choice: EngineChoice) -> None:
        # claimed when made, not when started: two threads entering a trace at once must not both
        # choose the observer (the later one records with the python engine and says why)
        if not _CLAIM.acquire(blocking=False):
            raise EngineBusy("the native engine is recording another trace in this process (another thread)")
        self._unclaim = weakref.finalize(self, _release, _CLAIM)
        self.choice = choice
        self.ext = choice.ext
        self.running = False
        self.data: Optional[dict[str, Any]] = None
        self._options: Optional[TraceOptions] = None
        self._reset(None)

    def _reset(self, ctx: Optional[RecordingContext], flops: bool = False) -> None:
        self._ctx = ctx      # what _on_full hands the chunks to (the recorder is ctx.rec)
        self._flops = flops  # options.flops: FLOP formulas of the ops recorded with their arguments
        self._op_flags = np.zeros(0, dtype=np.int64)   # per engine op id: schema flags | 1<<40 (FLOPs at build)
        self._encs: list[tuple[int, ...]] = []                 # interned argument encodings (FLOP formulas)
        self._row_args = np.zeros((0, 2), dtype=np.int64)   # (seq, encoding id)
        self.opaque_rows = 0

    def make_context(self, rec: Recorder, op_hooks: OpHooks, options: TraceOptions) -> NativeRecordingContext:
        return NativeRecordingContext(rec, op_hooks, self, want_source=options.source, want_modules=options.modules,
                                      track_storages=options.storages)

    def function_mode(self, ctx: RecordingContext) -> FunctionMode:
        """The C function mode (``native/fmode.cpp``) when it builds and is free, else the Python one."""
        from .... import native
        from ...function import CALL_DTYPE, NativeFunctionMode, TracingFunctionMode

        assert isinstance(ctx, NativeRecordingContext)   # make_context made it
        fm, reason = native.function_mode(CALL_DTYPE.itemsize)
        if fm is not None and not hasattr(self.ext, "fmode_state"):
            fm, reason = None, "the native engine exports no state for it (fmode_state)"
        if fm is None or fm.active():
            ctx.rec.notes.append("the function mode runs in Python: "
                                 f"{reason if fm is None else 'another trace uses the native one'}")
            return TracingFunctionMode(ctx)
        ctx.fmode = fm   # ctx.recording is forwarded to it from here on
        return NativeFunctionMode(ctx, fm)

    def setup_probes(self, ctx: RecordingContext, options: TraceOptions) -> None:
        if options.nonfinite:
            ctx.screen = NativeScreen({})   # the observer screens; its counters replace these at finish
        cap = cast("Optional[NativeSiteCapture]", ctx.capture)
        if cap is not None and getattr(cap, "native", False):
            cap.engine = self   # call_end drains the observer's per-op warnings
            try:   # the observer reads the source location of c10 errors its ops raise
                armed = cap.arm_error_sites(self)
                why = cap.sites_reason
                if not armed and why not in ("ok", "") and not why.startswith("TORCH_SHOW_CPP_STACKTRACES"):
                    ctx.rec.notes.append(f"C++ error locations unavailable: {why}")
            except Exception as e:
                ctx.rec.notes.append(f"C++ error locations unavailable: {type(e).__name__}: {e}")

    def start(self, ctx: RecordingContext, options: TraceOptions) -> None:
        opts = self._options = options
        hooks = ctx.op_hooks
        self._reset(ctx, bool(opts.flops))
        # past spill_rows rows, the engine calls _on_full on this thread to hand its chunks over
        self.ext.set_fingerprints(bool(opts.fingerprints))
        written = hooks.written if hooks else None   # capture=: arguments an op writes, copied before it
        self.ext.set_capture(written, int(hooks.written_limit) if written else 0,
                             tuple(sorted(hooks.written_seqs or ())) if written else (),
                             tuple(hooks.written_namespaces) if written else ())
        early = int(opts.spill_rows) > 4 * HANDOVER_RECORDS   # see HANDOVER_RECORDS
        self.ext.start(ctx.t0, bool(opts.nonfinite), bool(opts.storages), True,
                       _flop_op_names() if opts.flops else (),
                       hooks if hooks else None, tuple(hooks.namespaces) if hooks else None,
                       int(opts.spill_rows), self._on_full, int(opts.chunk_rows),
                       int(HANDOVER_RECORDS) if early else 1 << 62)
        self.running = True
        self._compile_callbacks()

    def _compile_callbacks(self) -> None:
        """Hide what torch.compile runs while it compiles (Dynamo probes ops; a dispatch mode is
        disabled then, the observer is not)."""
        ext = self.ext
        self._cb: Optional[CompileCallbacks] = CompileCallbacks(lambda *a, **k: ext.pause(True), lambda *a, **k: ext.pause(False))

    def stop(self) -> None:
        if self.running:
            self.running = False
            self.ext.stop()
            cb, self._cb = getattr(self, "_cb", None), None
            if cb is not None:
                cb.remove()
        self._unclaim()   # the observer is free for the next trace (idempotent)

    def release(self) -> None:
        """Drop the recording context start() took (it holds this engine: a cycle otherwise, which
        kept the recorder and its mapped storage parts until the collector's next full pass)."""
        self._reset(None)

    def take_warnings(self) -> list[dict[str, Any]]:
        raw = self.ext.take_warnings()
        if not raw:
            return []
        out: list[dict[str, Any]] = []
        for seq, msg, file, line, func, dep in raw:
            out.append({"seq": seq if seq >= 0 else None, "message": msg,
                        "category": "DeprecationWarning" if dep else "UserWarning",
                        "cpp_file": file or None, "cpp_line": line if line > 0 else None,
                        "cpp_function": func or None, "native": True})
        return out

    def _on_full(self) -> int:
        """Called by the engine, on the tracing thread between two ops, when its packed chunks and
        the rows handed over before passed ``spill_rows`` rows, or its finished storage records
        ``HANDOVER_RECORDS``: move them into the recorder, and past ``spill_rows`` rows in memory
        spill them there (to disk, or as ``dataset=`` parts) as the python engine's recorder does.
        Returns the rows the recorder still holds unspilled (the engine counts them toward
        ``spill_rows``; 0 once a spill failed: then rows stay in memory and the engine hands them
        over every ``spill_rows`` rows, as before). Never raises."""
        ctx = self._ctx
        assert ctx is not None   # set by start(): the engine calls this only while it runs
        rec = ctx.rec
        try:
            import torch

            with torch._C.DisableTorchFunction():
                self._take_chunks(rec, final=False)
                if rec.mem_rows > rec.spill_rows:
                    rec._spill()
        except Exception as e:
            rec.tracer_error("native spill", e)
        return int(rec.mem_rows) if rec.spill_failed is None else 0

    def _sync_dicts(self, rec: Recorder, d: dict[str, Any]) -> None:
        """Append what the engine interned since the last hand-over to the recorder's interners."""
        import torch


        flags_of: list[int] = []
        for name in d["ops"]:
            func = _resolve_op(name)
            try:
                # schema flags only (cached per process): the native engine calls the op hooks itself
                flags, at_build, _ = op_schema_facts(func)
                rec.funcs(func)
                flags_of.append(flags | ((1 << 40) if at_build else 0))   # 1<<40: FLOPs at build
            except Exception:   # an op without a schema (its library is gone): no flags
                if len(rec.funcs) == len(self._op_flags) + len(flags_of):
                    rec.funcs(func)
                flags_of.append(0)
        if flags_of:
            self._op_flags = np.concatenate([self._op_flags, np.array(flags_of, dtype=np.int64)])
        metas = rec.metas
        base = len(metas.shapes)
        dt_objs: dict[int, Any] = {}   # scalar type -> torch.dtype
        for i, v in enumerate(_seqs(d["metas"])):
            ndim, st, dev_t, dev_i, strided = v[_MK_NDIM], v[_MK_DTYPE], v[_MK_DEV_TYPE], v[_MK_DEV_INDEX], v[_MK_STRIDED]
            shape = tuple(v[_MK_HEADER:_MK_HEADER + ndim])
            stride = tuple(v[_MK_HEADER + ndim:_MK_HEADER + 2 * ndim]) if strided else None
            dt = dt_objs.get(st)
            if dt is None:
                dt = dt_objs[st] = _dtype(torch, st)
            dname = _DEVICE_TYPES[dev_t] if 0 <= dev_t < len(_DEVICE_TYPES) else f"device{dev_t}"
            dev = dname if dev_i < 0 else f"{dname}:{dev_i}"
            metas.add((base + i,), shape, stride, dt, dev)
        rec.tuples.values.extend(_seqs(d["tuples"]))
        rec.aliases.values.extend(_seqs(d["aliases"]))
        if not rec.nodes.values:
            rec.nodes.values.append(None)
        rec.nodes.values.extend(d["nodes"])
        self._encs.extend(_seqs(d["args"]))
        ra = np.frombuffer(d["row_args"], dtype=np.int64).reshape(-1, 2)
        if len(ra):
            self._row_args = np.concatenate([self._row_args, ra])
        nf = np.frombuffer(d["nonfinite"], dtype=np.int64).reshape(-1, 3)
        if len(nf):
            rec.nonfinite.extend(nf[:, 0], np.stack([nf[:, 1], nf[:, 2] != 0], axis=1))   # (count, produced)
        fps = d.get("fingerprints")
        if fps:
            from ...fingerprint import FP_RECORD

            for r in np.frombuffer(fps, dtype=FP_RECORD).tolist():
                rec.fingerprints[r[0]] = r[1:]

    def _take_chunks(self, rec: Recorder, final: bool) -> None:
        """The engine's packed chunks into ``rec.mem_chunks`` (the recorder's format: flags and
        FLOPs derived per distinct op), its new dictionary entries into the recorder's interners."""
        chunks, dicts = self.ext.take_chunks(final)
        rec.tensors.add(dicts.pop("storages", b""))   # the storage records freed since the last hand-over
        self._sync_dicts(rec, dicts)
        for first, n, cols in chunks:
            packed = {name: (int(b), np.frombuffer(buf, dtype=_PACKED_DTYPES[w]))
                      for name, (b, w, buf) in zip(PACKED_COLUMNS, cols)}
            op = unpack(packed["op"])
            of = self._op_flags[op]
            rflags = unpack(packed.pop("rflags"))
            flops = np.where((of >> 40) & 1, -2, -1).astype(np.int64)
            if self._flops and len(self._row_args):
                _formula_flops(flops, op, unpack(packed["outs"]), first, self._row_args, self._encs, rec)
            flops[(rflags & F_THREW) != 0] = -1   # a kernel that threw did no counted work (python engine: none)
            packed["flags"] = pack((of & 0xFF) | (rflags & F_BACKWARD))
            packed["flops"] = pack(flops)
            self.opaque_rows += int(np.count_nonzero((unpack(packed["node"]) == 0) & (unpack(packed["call"]) < 0)))
            assert set(packed) == set(OPS_FIELDS) | {"storages"}
            rec.add_chunk(packed)
            rec.mem_rows += int(n)
            rec.chunk_start = int(first + n)

    def finish(self, ctx: RecordingContext) -> None:
        """Move the native columns into ``ctx.rec`` in the recorder's layout (decode.py reads both alike)."""
        ext = self.ext
        opts = self._options
        rec = ctx.rec
        self._take_chunks(rec, final=True)
        d = ext.take()
        if opts is not None and opts.storages:   # the records finished since, and the live ones
            rec.tensors.add(d["tensors"])
        # warnings no call drained (ops outside any torch-level call, or after the last one)
        rest = self.take_warnings()
        if rest:
            ctx.record_warnings(rest, call_id=None, seq=None)
        if rec.mem_rows > rec.spill_rows:
            rec._spill()
        ctx.opaque_ops = self.opaque_rows
        self.other_thread_rows = int(d["other_thread_rows"])
        # the tracer's own time per op in the gaps: the sampled rows' callbacks (outside the op) and the
        # function mode's sampled calls, spread over the rows (time outside ops leaves it out)
        own_ns, own_rows = d.get("own", (0, 0))
        rows = int(d["n_rows"])
        if own_rows and rows:
            rec.own_op_ns = own_ns // own_rows + (rec.own_calls_ns or 0) // rows
        for _ in range(int(d.get("hook_errors", 0))):
            rec.tracer_error("op hook", RuntimeError("converting an op's arguments for the op hook failed"))
        if int(d.get("on_full_errors", 0)):
            rec.tracer_error("native spill", RuntimeError(f"{d['on_full_errors']} hand-over(s) raised"))
        if opts is not None and opts.storages:
            ctx.tracker = NativeStorages(ext)
        # non-finite screen (its findings came with the chunks)
        if ctx.screen is not None:
            ctx.screen = NativeScreen(d["screen"])
            dev = int(d["screen"].get("device_unscreened", 0))
            if dev:
                rec.notes.append(f"{dev} op(s) with CUDA outputs were not screened for NaN/Inf: the native engine "
                                 "screens CPU memory only (engine='python' screens on device)")
        if opts is not None and opts.cuda_timing and any(str(v).startswith("cuda") for v in rec.metas.devices):
            rec.notes.append("per-op CUDA times (ops.cuda_ns) are recorded by the python engine only; "
                             "use engine='python', or kernels=True for kernel times")
        self.data = None


class NativeStorages:
    """The storage view the leak finder reads (``live_created()``), from the native engine (the
    records themselves are in ``rec.tensors``)."""

    def __init__(self, ext: Any) -> None:
        self._ext = ext

    def live_created(self) -> list[tuple[int, Any]]:
        out: list[tuple[int, Any]] = []
        for sid, storage in self._ext.live_created():
            try:
                out.append((sid, weakref.ref(storage)))
            except TypeError:
                continue
        return out

    def close(self) -> None:
        try:
            self._ext.release()
        except Exception:
            pass


class NativeScreen:
    """The native non-finite screen's counters, with the python screen's op classification for decode.py."""

    def __init__(self, counters: dict[str, int]) -> None:
        self.counters = dict(counters)

    def screens(self, func: object) -> bool:
        try:
            return screens(func)
        except Exception:
            return False

    def finish(self) -> dict[int, tuple[int, bool]]:
        return {}

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: int(v) for k, v in self.counters.items() if k != "device_unscreened" or v}
        out["engine"] = "native"
        return out


class _UnknownOp:
    """Stands for an op whose OpOverload cannot be looked up (its library is gone)."""

    tags = ()
    is_view = False

    def __init__(self, name: str) -> None:
        self._name = name

    def __str__(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return self._name


_OP_CACHE: dict[str, Any] = {}


def _resolve_op(name: str) -> Any:
    """'aten::add.Tensor' -> torch.ops.aten.add.Tensor (cached)."""
    f = _OP_CACHE.get(name)
    if f is not None:
        return f
    import torch

    try:
        ns, rest = name.split("::", 1)
        base, ovl = rest.rsplit(".", 1) if "." in rest else (rest, "default")
        f = getattr(getattr(getattr(torch.ops, ns), base), ovl)
    except Exception:
        f = _UnknownOp(name.replace("::", "."))
    _OP_CACHE[name] = f
    return f


def _dtype(torch: Any, st: int) -> Any:
    name = _SCALAR_TYPES[st] if 0 <= st < len(_SCALAR_TYPES) else None
    dt = getattr(torch, name, None) if name else None
    if dt is None:
        class _D:
            itemsize = 0

            def __str__(self) -> str:
                return f"scalar_type_{st}"
        dt = _D()
    return dt


def _seqs(pair: Sequence[Any]) -> list[tuple[int, ...]]:
    """An interner's (arena, offsets) as tuples; offsets may start past 0 (a delta: the arena
    slice from the first entry handed over)."""
    arena = np.frombuffer(pair[0], dtype=np.int64)
    offs = np.frombuffer(pair[1], dtype=np.int64)
    offs = (offs - offs[0]).tolist() if len(offs) else []
    vals = arena.tolist()
    return [tuple(vals[offs[i]:offs[i + 1]]) for i in range(len(offs) - 1)]


_FLOP_NAMES: Optional[tuple[str, ...]] = None


def _flop_op_names() -> tuple[str, ...]:
    """'aten::convolution'... : ops whose FLOP formula needs their arguments (recorded natively)."""
    global _FLOP_NAMES
    if _FLOP_NAMES is None:
        names: list[str] = []
        for packet in FLOP_REGISTRY:
            q = getattr(packet, "_qualified_op_name", None)
            if q and q.split("::")[-1] not in SHAPE_FLOP_OPS:
                names.append(q)
        _FLOP_NAMES = tuple(names)
    return _FLOP_NAMES


#: the last module checked by abi_mismatch and its answer: a loaded library's ABI cannot change,
#: and every trace asks (the check builds a dict in C and a dtype: ~0.1 ms)
_ABI_CHECKED: Optional[tuple[object, Optional[str]]] = None


def abi_mismatch(ext: Any) -> Optional[str]:
    """What in the loaded engine's ABI (``ext.abi()``, native/abi.h) differs from this module's
    definitions and recorder.py's, or None when they agree."""
    global _ABI_CHECKED
    checked = _ABI_CHECKED
    if checked is not None and checked[0] is ext:
        return checked[1]
    problem = _abi_mismatch(ext)
    _ABI_CHECKED = (ext, problem)
    return problem


def _abi_mismatch(ext: Any) -> Optional[str]:
    from ....native import fields_dtype

    abi = getattr(ext, "abi", None)
    if abi is None:
        return "the library exports no abi()"
    d = abi()
    found = []
    row = fields_dtype(d["row"], d["row_size"])
    if row != ROW_DTYPE:
        found.append(f"ops row {row} != {ROW_DTYPE}")
    flags = d["flags"]
    if flags.get("F_THREW") != F_THREW or flags.get("F_BACKWARD") != F_BACKWARD:
        found.append(f"row flags {flags}")
    if tuple(d["packed"]["columns"]) != PACKED_COLUMNS:
        found.append(f"packed columns {d['packed']['columns']}")
    if dict(d["tags"]) != TAGS:
        found.append(f"argument tags {d['tags']}")
    return "; ".join(found) or None


def _decode_args(enc: Sequence[int], shapes: Sequence[tuple[int, ...]]) -> tuple[list[Any], Any]:
    """(arguments, outputs) with shapes for tensors, from engine.cpp's encoding."""
    out: list[Any] = []
    i = 0
    outs: Optional[list[Any]] = None
    while i < len(enc):
        tag = enc[i]
        i += 1
        if tag == TAG_OUTPUTS:
            outs, out = out, []   # the rest are the outputs
        elif tag == TAG_TENSOR:
            out.append(shapes[enc[i]])
            i += 1
        elif tag in (TAG_NONE, TAG_OTHER):
            out.append(None)
        elif tag == TAG_BOOL:
            out.append(bool(enc[i]))
            i += 1
        elif tag == TAG_INT:
            out.append(int(enc[i]))
            i += 1
        elif tag == TAG_DOUBLE:
            out.append(float(np.array([enc[i]], dtype=np.int64).view(np.float64)[0]))
            i += 1
        elif tag in (TAG_INT_LIST, TAG_BOOL_LIST):
            k = enc[i]
            vals = enc[i + 1:i + 1 + k]
            out.append([bool(v) for v in vals] if tag == TAG_BOOL_LIST else list(vals))
            i += 1 + k
        else:
            break
    if outs is None:
        return out, None
    return outs, (out[0] if len(out) == 1 else tuple(out))


def _formula_flops(flops: np.ndarray, op: np.ndarray, outs: np.ndarray, first_seq: int, row_args: np.ndarray,
                   encs: Sequence[tuple[int, ...]], rec: Recorder) -> None:
    """FLOPs of the ops whose torch.utils.flop_counter formula needs arguments, per distinct
    (op, arguments, outputs), for the chunk of rows from ``first_seq``: the formulas take shapes,
    so the interned metas suffice. ``row_args``: (seq, argument encoding id) rows."""
    n = len(op)
    sel = (row_args[:, 0] >= first_seq) & (row_args[:, 0] < first_seq + n)
    if not sel.any():
        return
    args = np.full(n, -1, dtype=np.int64)
    args[row_args[sel, 0] - first_seq] = row_args[sel, 1]
    todo = np.nonzero((args >= 0) & (flops == -1))[0]
    if not len(todo):
        return
    shapes = rec.metas.shapes
    funcs = rec.funcs.values
    keys = np.stack([op[todo], args[todo], outs[todo]], axis=1)
    uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    vals = np.full(len(uniq), -1, dtype=np.int64)
    for k, (o, a, _outs) in enumerate(uniq.tolist()):
        func = funcs[o]
        if FLOP_REGISTRY.get(getattr(func, "overloadpacket", None)) is None:
            continue
        try:
            a_, out_val = _decode_args(encs[a], shapes)
        except Exception:
            continue
        vals[k] = formula_flops(func, a_, out_val)
    flops[todo] = vals[inv.reshape(-1)]


#: the per-process FLOP formula cache (recording/opfacts.py; tests read it here)
_FLOPS = FLOPS_CACHE

