"""Trace options, declared once.

``TraceOptions`` is the single declaration: ``trace(**options)`` validates
against it, the ``%%tensorscope`` magic builds its ``magic_arguments`` from it
(so ``%%tensorscope?`` is complete), and the CLI reuses the same parser.
Each field's metadata carries its help text and, for booleans, whether the
command-line flag turns it on (``--numerics``) or off (``--no-nonfinite``).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .errors import OptionsError

#: Values accepted by ``expect=`` (cell guards).
EXPECTATIONS = ("channels_last", "no_nonfinite", "no_hidden_copies", "no_leaks")


def _opt(default, help, flag=None, type=None, choices=None, metavar=None):
    return field(default=default, metadata={"help": help, "flag": flag, "type": type, "choices": choices, "metavar": metavar})


@dataclass(frozen=True)
class TraceOptions:
    """Everything ``tensorscope.trace()`` accepts. All keyword-only."""

    modules: bool = _opt(True, "record the nn.Module path of each op (read from the call stack, no hooks)")
    source: bool = _opt(True, "record the user source line of each torch-level call")
    flops: bool = _opt(True, "count FLOPs with torch.utils.flop_counter's formulas")
    storages: bool = _opt(True, "track storages by weak reference (tensors table, leaks, memory)")
    leaks: bool = _opt(True, "report, after the trace, the storages it created that are still alive and who holds them")
    nonfinite: bool = _opt(True, "screen floating outputs for NaN/Inf (CPU: per op; CUDA: on-device flags read once at the end)")
    numerics: Any = _opt(False, "shadow-compute ops in higher precision and record the error; values: fp32 (16-bit ops "
                         "in float32, what a bare --numerics means), fp64 (float32 ops in float64), off (the default)",
                         type=str, choices=("off", "fp32", "fp64"), metavar="{fp32,fp64,off}")
    numerics_threshold: float = _opt(1e-2, "relative error above which the summary lists an op", type=float, metavar="X")
    cuda_timing: bool = _opt(True, "time ops on CUDA tensors with event pairs, resolved once at the end")
    kernels: bool = _opt(False, "collect CUDA kernels from the profiler (Kineto/CUPTI)")
    native: bool = _opt(True, "use the native C++ warning/error hooks when they are built")
    engine: str = _opt("auto", "recording engine: 'native' (C++ RecordFunction observer), 'python' (TorchDispatchMode), "
                               "'auto' (native when it builds; TENSORSCOPE_FORCE_FALLBACK=1 forces python)",
                       type=str, choices=("auto", "native", "python"), metavar="{auto,native,python}")
    cpp_errors: bool = _opt(False, "count every c10::Error constructed, including ones C++ swallows (slow)")
    expect: Tuple[str, ...] = _opt((), "cell guard: fail after the cell unless it holds (%s)" % ", ".join(EXPECTATIONS),
                                   type=str, choices=EXPECTATIONS, metavar="WHAT")
    max_casts: Optional[int] = _opt(None, "cell guard: fail when more than N casts ran", type=int, metavar="N")
    baseline: Any = _opt(None, "cell guard: fail when CPU time in ops or peak memory regress against this run "
                               "(a Trace or saved directory; in the magic a variable, history index or path)",
                         type=str, metavar="VAR")
    baseline_time: float = _opt(0.2, "baseline guard: allowed growth of CPU time in ops (0.2 = +20%%)", type=float,
                                metavar="FRAC")
    baseline_memory: float = _opt(0.1, "baseline guard: allowed growth of peak live bytes per device (0.1 = +10%%)",
                                  type=float, metavar="FRAC")
    chunk_rows: int = _opt(65536, "rows buffered per column chunk before it is frozen", type=int, metavar="N")
    spill_rows: int = _opt(2_000_000, "rows kept in memory before chunks spill to disk", type=int, metavar="N")
    spill_dir: Optional[str] = _opt(None, "directory for spilled chunks (default: a temporary directory)", type=str, metavar="DIR")
    dataset: Optional[str] = _opt(None, "at the end of the trace, write every table of this rank into the multi-rank "
                                        "parquet dataset DIR (DIR/<table>/run=<id>/rank=<r>/part-*.parquet)",
                                  type=str, metavar="DIR")
    sync_clocks: bool = _opt(False, "measure this rank's clock offset to rank 0 by ping-pong at the start and end "
                                    "(collective: every rank must trace; needs torch.distributed)")

    def __post_init__(self):
        num = self.numerics
        if num in (True,):
            num = "fp32"
        elif num in (False, None, "off", ""):
            num = False
        if num not in (False, "fp32", "fp64"):
            raise OptionsError(f"numerics must be False, 'fp32' or 'fp64', not {self.numerics!r}")
        object.__setattr__(self, "numerics", num)
        exp = self.expect
        if isinstance(exp, str):
            exp = (exp,)
        exp = tuple(exp or ())
        for e in exp:
            if e not in EXPECTATIONS:
                raise OptionsError(f"unknown expectation {e!r}; choose from {', '.join(EXPECTATIONS)}")
        object.__setattr__(self, "expect", exp)
        if not (self.baseline_time >= 0 and self.baseline_memory >= 0):
            raise OptionsError("baseline_time and baseline_memory are fractions >= 0 (0.2 = +20%)")
        if self.dataset is not None:
            if not isinstance(self.dataset, (str, bytes)) and not hasattr(self.dataset, "__fspath__"):
                raise OptionsError(f"dataset must be a directory path, not {type(self.dataset).__name__}")
            import os

            object.__setattr__(self, "dataset", os.fspath(self.dataset))
            if not self.dataset:
                raise OptionsError("dataset must be a directory path, not an empty string")
        if self.engine not in ("auto", "native", "python"):
            raise OptionsError(f"engine must be 'auto', 'native' or 'python', not {self.engine!r}")
        if self.chunk_rows < 1 or self.spill_rows < self.chunk_rows:
            raise OptionsError("chunk_rows must be >= 1 and spill_rows >= chunk_rows")

    @classmethod
    def from_kwargs(cls, kwargs: Dict[str, Any]) -> "TraceOptions":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise OptionsError(f"unknown trace option(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**kwargs)

    def to_dict(self) -> Dict[str, Any]:
        out = {f.name: (list(v) if isinstance(v, tuple) else v) for f in dataclasses.fields(self)
               for v in [getattr(self, f.name)]}
        b = out.get("baseline")
        if b is not None and not isinstance(b, str):   # never keep the baseline Trace alive through metadata
            out["baseline"] = str((getattr(b, "metadata", None) or {}).get("saved_to") or repr(b))
        return out


def fields() -> List[dataclasses.Field]:
    return list(dataclasses.fields(TraceOptions))


def cli_flag(f: dataclasses.Field) -> Tuple[str, ...]:
    """The command-line spelling of an option: booleans on by default get ``--no-x``."""
    name = f.name.replace("_", "-")
    if f.type in ("bool", bool) and f.default is True:
        return (f"--no-{name}",)
    return (f"--{name}",)


def argparse_arguments() -> List[Tuple[Tuple[str, ...], Dict[str, Any]]]:
    """(flags, kwargs) pairs for ``argparse.add_argument`` / ``magic_arguments.argument``."""
    out = []
    for f in fields():
        md = f.metadata
        flags = cli_flag(f)
        help_ = md["help"]
        if md.get("type") is None and f.default is True:
            help_ = "don't " + help_
        kw: Dict[str, Any] = {"dest": f.name, "help": help_}
        if md.get("type") is None:  # boolean switch
            if f.default is True:
                kw.update(action="store_const", const=False, default=None)
            else:
                kw.update(action="store_const", const=True, default=None)
        elif f.name == "expect":
            kw.update(action="append", type=str, choices=md["choices"], default=None, metavar=md["metavar"])
        else:
            kw.update(type=md["type"], default=None)
            if md.get("choices"):
                kw["choices"] = md["choices"]
            if md.get("metavar"):
                kw["metavar"] = md["metavar"]
            if f.name == "numerics":
                kw.update(nargs="?", const="fp32")
        out.append((flags, kw))
    return out


def add_to_parser(parser: argparse.ArgumentParser) -> None:
    for flags, kw in argparse_arguments():
        parser.add_argument(*flags, **kw)


def from_namespace(ns: argparse.Namespace) -> Dict[str, Any]:
    """The options a parsed namespace sets explicitly (unset ones keep defaults)."""
    out = {}
    for f in fields():
        v = getattr(ns, f.name, None)
        if v is None:
            continue
        if f.name == "expect":
            v = tuple(v)
        out[f.name] = v
    return out
