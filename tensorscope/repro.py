"""``t.repro(seq, path)``: a standalone script that reruns one recorded op and checks its outcome.

The script rebuilds every tensor argument with the recorded shape, strides, storage offset, dtype
and device (a storage of ``offset + span`` elements viewed with ``as_strided``), from the values
``capture=`` saved (a safetensors file beside the script) or random ones, calls the op through
``torch.ops`` and compares what happens with what the trace recorded: the same exception type and
message, the same NaN/Inf positions (when they were captured) and the same output shapes and
strides. It prints what matched and exits 1 when something did not. It imports torch, and
safetensors when it loads captured inputs, nothing else (the call is written as Python literals).

Without a capture, the op's other arguments are not in the trace: a script is written when the
schema has nothing but tensors and defaults (``mm``, ``add.Tensor``, ``relu``...), else the error
says to record again with ``capture=[seq]``.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import pyarrow.compute as pc

_FLOAT = {"float16", "bfloat16", "float32", "float64"}


def _row(table: Any, column: str, value: Any) -> Optional[dict[str, Any]]:
    rows = table.filter(pc.equal(table.column(column), value)).to_pylist()
    return rows[0] if rows else None


def _random_call(op: str, row: dict[str, Any]) -> dict[str, Any]:
    """The call of an op without a capture: its tensor arguments from the row, the rest defaults."""
    import torch

    from .errors import DivergeInputError

    ns, _, rest = op.partition(".")
    base, _, overload = rest.partition(".")
    try:
        schema = getattr(getattr(getattr(torch.ops, ns), base), overload or "default")._schema
    except Exception as e:
        raise DivergeInputError(f"{op}: not an op this torch knows ({e})") from None
    n_in = len(row["in_shapes"] or ())
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    k = 0
    for a in schema.arguments:
        t = str(a.type)
        if t in ("Tensor", "Tensor?") and k < n_in and (t == "Tensor" or not a.has_default_value()):
            v: Any = {"tensor": k}
            k += 1
        elif t == "Tensor[]" and k < n_in:
            v = [{"tensor": j} for j in range(k, n_in)]
            k = n_in
        elif a.has_default_value():
            continue   # left to its default
        else:
            raise DivergeInputError(
                f"seq {row['seq']} ({op}): its argument {a.name!r} ({t}) is not recorded without a capture; "
                f"record the run again with trace(capture=[{row['seq']}]) to repro it")
        if a.kwarg_only:
            kwargs[a.name] = v
        else:
            args.append(v)
    if k != n_in:
        raise DivergeInputError(f"seq {row['seq']} ({op}): {n_in} tensor inputs recorded, {k} placed by its schema; "
                                f"record the run again with trace(capture=[{row['seq']}]) to repro it")
    return {"op": op, "args": args, "kwargs": kwargs, "why": None, "problems": []}


def write_repro(trace: Any, seq: int, path: str) -> str:
    """Write the script for ``trace``'s op ``seq`` to ``path`` (and its inputs beside it, when captured);
    returns the path."""
    from .errors import DivergeInputError

    ops = trace.ops
    if not isinstance(seq, int) or isinstance(seq, bool):
        raise DivergeInputError(f"seq must be an op's seq (an int), not {seq!r}")
    row = _row(ops, "seq", seq)
    if row is None:
        raise DivergeInputError(f"no op with seq {seq} in this trace ({ops.num_rows} ops)")
    op = str(row["op"])
    caps = trace.table("captures")
    mine = caps.filter(pc.equal(caps.column("seq"), seq)).to_pylist() if caps.num_rows else []
    call_row = next((r for r in mine if r["kind"] == "call"), None)
    notes: list[str] = []
    if call_row is not None:
        call = json.loads(call_row["data"].decode())
        if call.get("problems"):
            raise DivergeInputError(f"seq {seq} ({op}): " + "; ".join(call["problems"]))
    else:
        call = _random_call(op, row)
        notes.append("inputs: random (record with capture= to save the real ones)")
        notes.append("arguments other than tensors: the schema's defaults (not recorded without a capture)")
    inputs = {r["index"]: r for r in mine if r["kind"] == "input"}
    masks = {r["index"]: r for r in mine if r["kind"] == "mask"}
    tensors = []
    n_in = len(row["in_shapes"] or ())
    for k in range(n_in):
        cap = inputs.get(k)
        tensors.append({
            "shape": list(cap["shape"]) if cap else list(row["in_shapes"][k]),
            "stride": list(cap["stride"]) if cap else list(row["in_strides"][k]),
            "offset": int(cap["storage_offset"]) if cap and cap["storage_offset"] is not None else 0,
            "dtype": cap["dtype"] if cap else row["in_dtypes"][k],
            "device": cap["device"] if cap else row["in_devices"][k],
            "saved": bool(cap and cap["data"] is not None),
        })
        if cap and cap["note"]:
            notes.append(f"input {k}: {cap['note']}")
    if not call_row:
        # storage offsets are only known from a capture
        notes.append("storage offsets: 0 (captured ones are exact)")
    error = None
    if row["error_id"] is not None:
        er = _row(trace.errors, "error_id", row["error_id"])
        if er is not None:
            error = [er["py_type"] or "", (er["message"] or "").splitlines()[0] if er["message"] else ""]
    expect = {
        "error": error,
        "out_shapes": [list(s) for s in row["out_shapes"] or ()] if error is None else None,
        "out_strides": [list(s) for s in row["out_strides"] or ()] if error is None else None,
        "out_dtypes": list(row["out_dtypes"] or ()) if error is None else None,
        "nonfinite": row["nonfinite"],
    }
    path = os.fspath(path)
    data_file = None
    saved = {}
    for k, t in enumerate(tensors):
        if t["saved"]:
            saved[f"input.{k}"] = inputs[k]["data"]
    for k, m in masks.items():
        saved[f"mask.{k}"] = m["data"]
    if saved:
        data_file = os.path.splitext(path)[0] + ".safetensors"
        _write_safetensors(data_file, saved)
    where = f"{row['source_file']}:{row['source_line']}" if row["source_file"] else "unknown line"
    text = _SCRIPT.format(
        op=op, seq=seq, module=row["module"] or "-", where=where,
        notes="".join(f"# note: {n}\n" for n in notes),
        st_import="from safetensors.torch import load_file\n" if data_file else "",
        call=repr(call), tensors=repr(tensors), expect=repr(expect), masks=repr(sorted(masks)),
        data=repr(os.path.basename(data_file)) if data_file else "None",
    )
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _write_safetensors(path: str, blobs: dict[str, bytes]) -> None:
    """Raw bytes as uint8 tensors in a safetensors file (the script views them as their dtype)."""
    try:
        import numpy as np
        from safetensors.numpy import save_file
    except ImportError:
        from .errors import DivergeInputError

        raise DivergeInputError("captured inputs are written as safetensors: pip install safetensors "
                                "(or tensorscope[repro])") from None
    save_file({k: np.frombuffer(v, dtype=np.uint8).copy() for k, v in blobs.items()}, path)


_SCRIPT = '''"""tensorscope repro: {op} (seq {seq}), module {module}, recorded at {where}.

Rebuilds the op's inputs (shapes, strides, storage offsets, dtypes, devices), runs it and checks the
recorded outcome. Exit status 0: reproduced; 1: something differs (printed).
"""
{notes}import torch
{st_import}
CALL = {call}
TENSORS = {tensors}
EXPECT = {expect}
MASKS = {masks}
DATA = {data}


def make(k, t, saved):
    dtype = getattr(torch, t["dtype"])
    span = 0 if 0 in t["shape"] else 1 + sum((s - 1) * st for s, st in zip(t["shape"], t["stride"]))
    n = t["offset"] + span
    if t["saved"]:
        base = torch.zeros(n, dtype=dtype)
        raw = saved["input.%d" % k]
        if span:
            base[t["offset"]:] = raw.view(dtype)
        base = base.to(t["device"])
    elif dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(n, dtype=dtype, device=t["device"])
    elif dtype == torch.bool:
        base = torch.rand(n, device=t["device"]) > 0.5
    else:
        base = torch.randint(0, 8, (n,), dtype=dtype, device=t["device"])
    return torch.as_strided(base, t["shape"], t["stride"], t["offset"])


def decode(v, tensors):
    if isinstance(v, list):
        return [decode(x, tensors) for x in v]
    if isinstance(v, dict):
        if "tensor" in v:
            return tensors[v["tensor"]]
        if "float" in v:
            return float(v["float"])
        if "complex" in v:
            return complex(*v["complex"])
        if "dtype" in v:
            return getattr(torch, v["dtype"])
        if "device" in v:
            return torch.device(v["device"])
        if "memory_format" in v:
            return getattr(torch, v["memory_format"])
        if "layout" in v:
            return getattr(torch, v["layout"])
    return v


def main():
    here = __file__[:max(__file__.rfind("/"), __file__.rfind(chr(92))) + 1]
    saved = load_file(here + DATA) if DATA else {{}}
    torch.manual_seed(0)
    tensors = [make(k, t, saved) for k, t in enumerate(TENSORS)]
    ns, name, overload = (CALL["op"].split(".") + ["default"])[:3]
    op = getattr(getattr(getattr(torch.ops, ns), name), overload)
    args = decode(CALL["args"], tensors)
    kwargs = {{k: decode(v, tensors) for k, v in CALL["kwargs"].items()}}
    problems = []
    try:
        out = op(*args, **kwargs)
        got_error = None
    except Exception as e:
        out = None
        got_error = [type(e).__name__, str(e).splitlines()[0] if str(e) else ""]
    if EXPECT["error"] is not None:
        if got_error != EXPECT["error"]:
            problems.append("error: expected %r, got %r" % (EXPECT["error"], got_error))
        else:
            print("reproduced the error: %s: %s" % tuple(got_error))
    elif got_error is not None:
        problems.append("the op raised %s: %s (the recorded run did not)" % tuple(got_error))
    else:
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
        for k, o in enumerate(outs[:len(EXPECT["out_strides"])]):
            want = (EXPECT["out_shapes"][k], EXPECT["out_strides"][k], EXPECT["out_dtypes"][k])
            got = (list(o.shape), list(o.stride()), str(o.dtype).replace("torch.", ""))
            if got != want:
                problems.append("output %d: expected shape/strides/dtype %r, got %r" % (k, want, got))
            else:
                print("output %d: shape %s, strides %s, %s as recorded" % (k, got[0], got[1], got[2]))
        for k in MASKS:
            o = outs[k]
            bits = saved["mask.%d" % k]
            n = o.numel()
            want = torch.zeros(8 * bits.numel(), dtype=torch.bool)
            for b in range(8):
                want[b::8] = (bits >> (7 - b)) & 1 == 1
            want = want[:n]
            got = ~torch.isfinite(o.detach().cpu().contiguous().reshape(-1))
            if not torch.equal(got, want):
                problems.append("output %d: NaN/Inf at %d positions, %d recorded, %d in common" % (
                    k, int(got.sum()), int(want.sum()), int((got & want).sum())))
            else:
                print("output %d: NaN/Inf at the %d recorded positions" % (k, int(want.sum())))
        if not MASKS and EXPECT["nonfinite"]:
            got_nf = sum(int((~torch.isfinite(o)).sum()) for o in outs if o.is_floating_point())
            print("NaN/Inf values: %d (%d recorded; random inputs need not reproduce them)" % (
                got_nf, EXPECT["nonfinite"]))
    if problems:
        print("NOT REPRODUCED:")
        for p in problems:
            print("  " + p)
        raise SystemExit(1)
    print("REPRODUCED")


if __name__ == "__main__":
    main()
'''
