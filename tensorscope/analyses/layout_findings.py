"""The advisor's layout findings: a memory-format mix (channels_last next to contiguous) that makes
ATen copy or convert tensors on every step, each with the conversion that removes it (used by
advisor.py; the layout changes themselves are analyses/layout.py's table)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import pyarrow as pa
import pyarrow.compute as pc

from .._common import fmt_bytes
from .findings import _finding, _rows_of, _where
from .opview import short_name, views

_CONV = frozenset({"convolution", "_convolution", "convolution_backward", "mkldnn_convolution", "cudnn_convolution",
                   "_mkldnn_convolution", "miopen_convolution", "conv2d", "conv3d", "conv_transpose2d"})
_COPY = frozenset({"copy_", "_to_copy", "clone", "contiguous", "_copy_from"})
_CL = ("channels_last", "channels_last_3d")


def _layout_findings(wins: Sequence[Mapping[str, Any]], multi: bool, steps: Optional[int]) -> list[dict[str, Any]]:
    cols = ["seq", "op", "in_formats", "in_ambiguous", "in_shapes", "out_formats", "cpu_ns", "module",
            "source_file", "source_line"]
    mixed, copies = [], []
    for w, win in enumerate(wins):
        for view in views(win["ops"], win.get("batch_rows")):   # a record batch at a time
            for r in _rows_of(w, view, _CONV | _COPY, cols):
                fm = [(f, a) for f, a, sh in zip(r["in_formats"] or [], r["in_ambiguous"] or [], r["in_shapes"] or [])
                      if len(sh) in (4, 5) and not a]
                if short_name(r["op"]) in _CONV:
                    kinds = {f for f, _ in fm}
                    if kinds & set(_CL) and "contiguous" in kinds:
                        mixed.append(r)
                elif fm:
                    src = fm[1][0] if short_name(r["op"]) in ("copy_", "_copy_from") and len(fm) > 1 else fm[0][0]
                    dst = (r["out_formats"] or [None])[0]
                    if src in _CL and dst == "contiguous":
                        copies.append(r)
    out = []
    if not mixed:
        copies = []   # no convolution mixes formats: each copy is its own layout_changes finding below
    if mixed:
        # which side to convert, from the formats the convolutions actually got: channels_last data with
        # contiguous weights -> the model; contiguous data with channels_last weights -> the input
        fwd = [r for r in mixed if short_name(r["op"]) != "convolution_backward"]
        data_cl = sum(1 for r in fwd if (r["in_formats"] or [None])[0] in _CL)
        weight_cl = sum(1 for r in fwd if len(r["in_formats"] or []) > 1 and r["in_formats"][1] in _CL)
        if data_cl and not weight_cl:
            fix = ("convert the model too: model.to(memory_format=torch.channels_last), so weights, gradients and "
                   "inputs agree")
        elif weight_cl and not data_cl:
            fix = "convert the input too: x.to(memory_format=torch.channels_last) (the weights already are)"
        else:
            fix = ("convert model and input to one format: model.to(memory_format=torch.channels_last) and "
                   "x.to(memory_format=torch.channels_last)")
        rs = mixed + copies
        cost = sum(r["cpu_ns"] or 0 for r in copies)
        seen = (f"{len(mixed)} convolution(s) mixing channels_last and contiguous 4-d/5-d inputs (the kernel "
                f"converts one of them)" + (f", and {len(copies)} copies converting channels_last back to "
                                            f"contiguous ({', '.join(sorted({short_name(r['op']) for r in copies}))})"
                                            if copies else ""))
        first = (copies or mixed)[0]
        f_ = _finding("layout", "mixed memory formats around convolutions", seen,
                      [(r["window"], r["seq"]) for r in rs], multi, cost if copies else None, fix, steps,
                      first["module"], first["source_file"], first["source_line"])
        # the cost is the copies only: the conversion each mixed convolution makes runs inside its kernel,
        # unmeasured, so the significance floor does not apply to a mix
        f_["cost_floor_exempt"] = bool(mixed)
        out.append(f_)
    taken = {(r["window"], r["seq"]) for r in mixed + copies}
    groups: OrderedDict[tuple[Any, ...], list[dict[str, Any]]] = OrderedDict()
    for w, win in enumerate(wins):
        lc = win.get("layout_changes")
        if lc is None or lc.num_rows == 0:
            continue
        lc = lc.filter(pc.is_in(lc.column("kind"), value_set=pa.array(["format_change", "hidden_copy"])))
        for r in lc.to_pylist():
            if (w, r["seq"]) not in taken:
                groups.setdefault((r["kind"], r["op"], r["source_file"], r["source_line"]), []).append(dict(r, window=w))
    for (kind, op, f, line), rs in groups.items():
        seen = f"{len(rs)}x {rs[0].get('reason') or op} at {_where(f, line)}, {fmt_bytes(sum(r['bytes'] or 0 for r in rs))}"
        fix = _layout_fix(kind, rs[0])
        out.append(_finding("layout", f"{op} ({kind.replace('_', ' ')})", seen, [(r["window"], r["seq"]) for r in rs],
                            multi, None, fix, steps, rs[0]["module"], f, line))
    return out


def _layout_fix(kind: str, r: Mapping[str, Any]) -> str:
    """The change that removes a layout_changes finding (each one executed in tests/analyses/test_fixes_executed.py)."""
    call = r.get("call") or ""
    if kind == "hidden_copy" and call in ("flatten", "reshape", "view") and r.get("from_format") in _CL:
        # a channels_last activation flattened for a linear head: its (c, h, w) order must be gathered
        return ("x.permute(0, 2, 3, 1).flatten(1) is a view of a channels_last tensor (no copy); the features then "
                "come in (h, w, c) order, so the next layer must be trained on that order")
    if kind == "hidden_copy":
        return "make the tensor contiguous once before the loop (x = x.contiguous()), or use an op that keeps the layout"
    return "keep one memory format end to end: convert the other operand (or model and input) once"
