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
from .findings import Runs, _finding, _rows_of, _where
from .opview import BATCH_ROWS, short_name, window_views

_CONV = frozenset({"convolution", "_convolution", "convolution_backward", "mkldnn_convolution", "cudnn_convolution",
                   "_mkldnn_convolution", "miopen_convolution", "conv2d", "conv3d", "conv_transpose2d"})
_COPY = frozenset({"copy_", "_to_copy", "clone", "contiguous", "_copy_from"})
_CL = ("channels_last", "channels_last_3d")


class _Mix:
    """The convolutions mixing formats and the copies converting back, counted a record batch at a time:
    what the finding says of them, and their runs of rows (not a dict per row)."""

    def __init__(self) -> None:
        self.mixed = self.copies = self.data_cl = self.weight_cl = self.cost = 0
        self.mixed_runs, self.copy_runs = Runs(), Runs()
        self.first_mixed: Optional[dict[str, Any]] = None
        self.first_copy: Optional[dict[str, Any]] = None
        self.copy_ops: set[str] = set()

    def read(self, w: int, r: dict[str, Any]) -> None:
        fm = [(f, a) for f, a, sh in zip(r["in_formats"] or [], r["in_ambiguous"] or [], r["in_shapes"] or [])
              if len(sh) in (4, 5) and not a]
        if short_name(r["op"]) in _CONV:
            kinds = {f for f, _ in fm}
            if kinds & set(_CL) and "contiguous" in kinds:
                self.mixed += 1
                self.first_mixed = self.first_mixed or r
                self.mixed_runs.add_one(w, r["seq"])
                if short_name(r["op"]) != "convolution_backward":
                    self.data_cl += (r["in_formats"] or [None])[0] in _CL
                    self.weight_cl += len(r["in_formats"] or []) > 1 and r["in_formats"][1] in _CL
        elif fm:
            src = fm[1][0] if short_name(r["op"]) in ("copy_", "_copy_from") and len(fm) > 1 else fm[0][0]
            dst = (r["out_formats"] or [None])[0]
            if src in _CL and dst == "contiguous":
                self.copies += 1
                self.first_copy = self.first_copy or r
                self.copy_runs.add_one(w, r["seq"])
                self.cost += r["cpu_ns"] or 0
                self.copy_ops.add(short_name(r["op"]))


def _layout_findings(wins: Sequence[Mapping[str, Any]], multi: bool, steps: Optional[int]) -> list[dict[str, Any]]:
    cols = ["seq", "op", "in_formats", "in_ambiguous", "in_shapes", "out_formats", "cpu_ns", "module",
            "source_file", "source_line"]
    mix = _Mix()
    for w, win in enumerate(wins):
        for view in window_views(win):   # a record batch at a time
            for r in _rows_of(w, view, _CONV | _COPY, cols):
                mix.read(w, r)
    out = []
    taken = Runs()
    if mix.mixed:
        # which side to convert, from the formats the convolutions actually got: channels_last data with
        # contiguous weights -> the model; contiguous data with channels_last weights -> the input
        if mix.data_cl and not mix.weight_cl:
            fix = ("convert the model too: model.to(memory_format=torch.channels_last), so weights, gradients and "
                   "inputs agree")
        elif mix.weight_cl and not mix.data_cl:
            fix = "convert the input too: x.to(memory_format=torch.channels_last) (the weights already are)"
        else:
            fix = ("convert model and input to one format: model.to(memory_format=torch.channels_last) and "
                   "x.to(memory_format=torch.channels_last)")
        taken.extend(mix.mixed_runs)
        taken.extend(mix.copy_runs)
        seen = (f"{mix.mixed} convolution(s) mixing channels_last and contiguous 4-d/5-d inputs (the kernel "
                f"converts one of them)" + (f", and {mix.copies} copies converting channels_last back to "
                                            f"contiguous ({', '.join(sorted(mix.copy_ops))})" if mix.copies else ""))
        first = mix.first_copy or mix.first_mixed
        assert first is not None
        f_ = _finding("layout", "mixed memory formats around convolutions", seen, taken, multi,
                      mix.cost if mix.copies else None, fix, steps, first["module"], first["source_file"],
                      first["source_line"])
        # the cost is the copies only: the conversion each mixed convolution makes runs inside its kernel,
        # unmeasured, so the significance floor does not apply to a mix
        f_["cost_floor_exempt"] = True
        out.append(f_)
    # else no convolution mixes formats: each copy is its own layout_changes finding below
    # per (kind, op, file, line): [rows, bytes, the first row, runs of rows]
    groups: OrderedDict[tuple[Any, ...], list[Any]] = OrderedDict()
    for w, win in enumerate(wins):
        lc = win.get("layout_changes")
        if lc is None or lc.num_rows == 0:
            continue
        lc = lc.filter(pc.is_in(lc.column("kind"), value_set=pa.array(["format_change", "hidden_copy"])))
        for b in lc.to_batches(max_chunksize=BATCH_ROWS):
            free = ~taken.member(w, pc.fill_null(b.column("seq"), -1).to_numpy(zero_copy_only=False))
            for r, ok in zip(b.to_pylist(), free.tolist()):
                if not ok:
                    continue
                key = (r["kind"], r["op"], r["source_file"], r["source_line"])
                g = groups.get(key)
                if g is None:
                    g = groups[key] = [0, 0, r, Runs()]
                g[0] += 1
                g[1] += r["bytes"] or 0
                g[3].add_one(w, r["seq"])
    for (kind, op, f, line), (n, nbytes, r0, runs) in groups.items():
        seen = f"{n}x {r0.get('reason') or op} at {_where(f, line)}, {fmt_bytes(nbytes)}"
        fix = _layout_fix(kind, r0)
        out.append(_finding("layout", f"{op} ({kind.replace('_', ' ')})", seen, runs, multi, None, fix, steps,
                            r0["module"], f, line))
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
