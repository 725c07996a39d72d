"""Trace options, display options and the run context: declared once, parsed once.

Three frozen dataclasses, three concerns:

* ``TraceOptions``: what to record. ``trace(options)`` (or ``trace(**keywords)``)
  takes it; it is stored, typed, in every trace's ``TraceMetadata``.
* ``DisplayOptions``: how a result is shown (``numerics_threshold``). The
  renderers take it; a recorded trace never depends on it.
* ``RunContext``: where a trace ran (cell number, cell source, origin) and how
  the caller keeps it: not an option, never parsed from flags.

The ``%%tensorscope`` magic builds its ``magic_arguments`` from the first two
(so ``%%tensorscope?`` is complete) and the CLI reuses the same declarations;
``parse_namespace`` turns the parsed flags into the typed objects in one step,
validating once. Each field's metadata carries its help text and, for booleans,
whether the command-line flag turns it on (``--numerics``) or off (``--no-nonfinite``).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from .errors import OptionsError

#: Values accepted by ``expect=`` (cell guards).
EXPECTATIONS = ("channels_last", "no_nonfinite", "no_hidden_copies", "no_leaks", "no_syncs")
NUMERICS = ("off", "fp32", "fp64")
ENGINES = ("auto", "native", "python")
#: Where a trace can come from (``RunContext.origin``).
ORIGINS = ("api", "magic", "always_on", "cli")
#: Option names older traces stored among their trace options that are display settings now:
#: ignored when such a trace is loaded.
LEGACY_OPTIONS = frozenset({"numerics_threshold"})


def _opt(default: Any, help: str, *, type: Optional[type[Any]] = None, choices: Optional[Sequence[str]] = None,
         metavar: Optional[str] = None) -> Any:
    """A field with its command-line declaration. ``type=None`` means a boolean switch."""
    return field(default=default, metadata={"help": help, "type": type, "choices": choices, "metavar": metavar})


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_types(obj: Any) -> None:
    """Every declared field has a value of its declared kind (a clear error, not a late failure)."""
    for f in dataclasses.fields(obj):
        kind = f.metadata.get("type", "no-flag")
        v = getattr(obj, f.name)
        if kind is None and not isinstance(v, bool):
            raise OptionsError(f"{f.name} must be True or False, not {v!r}")
        if kind is int and not (_is_int(v) or (v is None and f.default is None)):
            raise OptionsError(f"{f.name} must be an integer, not {v!r}")
        if kind is float and not (_is_number(v) and math.isfinite(v)):
            raise OptionsError(f"{f.name} must be a finite number, not {v!r}")


@dataclass(frozen=True)
class TraceOptions:
    """What ``tensorscope.trace()`` records: every trace option, typed, frozen and validated.

    Build it with keywords; a value of the wrong kind is an ``OptionsError`` at once. ``trace()``
    takes one, keywords, or both (keywords replace its fields). Every trace keeps the options it
    recorded with in ``t.metadata.options``. Each field is also a flag of the ``%%tensorscope``
    magic and of ``python -m tensorscope run`` (``modules=False`` is ``--no-modules``).

    Examples
    --------
    >>> import tensorscope
    >>> opts = tensorscope.TraceOptions(modules=False, expect=("no_leaks",))
    >>> opts.changed()
    {'modules': False, 'expect': ('no_leaks',)}
    >>> opts.replace(flops=False).changed()
    {'modules': False, 'flops': False, 'expect': ('no_leaks',)}
    """

    modules: bool = _opt(True, "record the nn.Module path of each op (read from the call stack, no hooks)")
    source: bool = _opt(True, "record the user source line of each torch-level call")
    flops: bool = _opt(True, "count FLOPs with torch.utils.flop_counter's formulas")
    storages: bool = _opt(True, "track storages by weak reference (tensors table, leaks, memory)")
    leaks: bool = _opt(True, "report, after the trace, the storages it created that are still alive and who holds them")
    nonfinite: bool = _opt(True, "screen floating outputs for NaN/Inf (CPU: per op; CUDA: on-device flags read once at the end)")
    fingerprints: bool = _opt(False, "record a fingerprint of each op's first floating output (a bitwise hash, the "
                                     "non-finite count, sum, sum of absolute values, largest absolute value), read where the non-finite screen "
                                     "reads it (CPU tensors): what tensorscope.diverge() compares two runs by")
    #: None, "nonfinite", "errors" or a tuple of ops.seq values once validated
    capture: Any = _opt(None, "save the real inputs (and call arguments) of some ops for t.repro(): 'nonfinite' (ops "
                              "whose output holds NaN/Inf), 'errors' (ops that raised), or comma-separated seqs "
                              "(CPU tensors; within capture_bytes)", type=str, metavar="{nonfinite,errors,SEQ,...}")
    capture_bytes: int = _opt(64 << 20, "the most bytes of inputs capture= saves in one trace (past it: a note)",
                              type=int, metavar="N")
    #: False, "fp32" or "fp64" once validated (True means "fp32"; "off" and None mean False).
    numerics: Union[bool, str] = _opt(False, "shadow-compute ops in higher precision and record the error; values: fp32 "
                                      "(16-bit ops in float32, what a bare --numerics means), fp64 (float32 ops in "
                                      "float64), off (the default)",
                                      type=str, choices=NUMERICS, metavar="{fp32,fp64,off}")
    cuda_timing: bool = _opt(True, "time ops on CUDA tensors with event pairs, resolved once at the end")
    kernels: bool = _opt(False, "collect CUDA kernels from the profiler (Kineto/CUPTI)")
    memory_history: bool = _opt(False, "record the CUDA caching allocator's history while the block runs "
                                       "(torch.cuda.memory._record_memory_history) and save its snapshot, taken "
                                       "at the end, also after an out-of-memory error, as the allocator_segments, "
                                       "allocator_blocks and allocator_events tables joined to ours by address "
                                       "and time (CUDA must be initialised before the block; a note otherwise)")
    native: bool = _opt(True, "use the native C++ warning/error hooks when they are built")
    engine: str = _opt("auto", "recording engine: 'native' (C++ RecordFunction observer), 'python' (TorchDispatchMode), "
                               "'auto' (native when it builds; TENSORSCOPE_FORCE_FALLBACK=1 forces python)",
                       type=str, choices=ENGINES, metavar="{auto,native,python}")
    cpp_errors: bool = _opt(False, "count every c10::Error constructed, including ones C++ swallows (slow)")
    expect: tuple[str, ...] = _opt((), "cell guard: fail after the cell unless it holds ({})".format(", ".join(EXPECTATIONS)),
                                   type=str, choices=EXPECTATIONS, metavar="WHAT")
    max_casts: Optional[int] = _opt(None, "cell guard: fail when more than N casts ran", type=int, metavar="N")
    #: A Trace, a saved trace directory, or (in the magic, before it is resolved) a variable name or
    #: history index. In a trace's metadata: the baseline's label (where it was saved, or its repr).
    baseline: Any = _opt(None, "cell guard: fail when CPU time in ops or peak memory regress against this run "
                               "(a Trace or saved directory; in the magic a variable, history index or path)",
                         type=str, metavar="VAR")
    baseline_time: float = _opt(0.2, "baseline guard: allowed growth of CPU time in ops (0.2 = +20%%)", type=float,
                                metavar="FRAC")
    baseline_memory: float = _opt(0.1, "baseline guard: allowed growth of peak live bytes per device (0.1 = +10%%)",
                                  type=float, metavar="FRAC")
    chunk_rows: int = _opt(65536, "rows buffered per column chunk before it is frozen", type=int, metavar="N")
    spill_rows: int = _opt(500_000, "rows kept in memory before chunks spill to disk", type=int, metavar="N")
    spill_dir: Optional[str] = _opt(None, "directory for spilled chunks (default: a temporary directory)", type=str,
                                    metavar="DIR")
    dataset: Optional[str] = _opt(None, "at the end of the trace, write every table of this rank into the multi-rank "
                                        "parquet dataset DIR (DIR/<table>/run=<id>/rank=<r>/part-*.parquet)",
                                  type=str, metavar="DIR")
    sync_clocks: bool = _opt(False, "measure this rank's clock offset to rank 0 by ping-pong at the start and end "
                                    "(collective: every rank must trace; needs torch.distributed)")

    def __post_init__(self) -> None:
        num: Any = self.numerics
        if num is True:
            num = "fp32"
        elif num in (False, None, "off", ""):
            num = False
        if num not in (False, "fp32", "fp64"):
            raise OptionsError(f"numerics must be False, 'fp32' or 'fp64', not {self.numerics!r}")
        object.__setattr__(self, "numerics", num)
        exp: Any = self.expect
        if isinstance(exp, str):
            exp = (exp,)
        if not isinstance(exp, (tuple, list)):
            raise OptionsError(f"expect must be one of {', '.join(EXPECTATIONS)} or a sequence of them, not {exp!r}")
        exp = tuple(exp)
        for e in exp:
            if e not in EXPECTATIONS:
                raise OptionsError(f"unknown expectation {e!r}; choose from {', '.join(EXPECTATIONS)}")
        object.__setattr__(self, "expect", exp)
        for name in ("spill_dir", "dataset"):
            v = getattr(self, name)
            if v is None:
                continue
            if not isinstance(v, (str, os.PathLike)):
                raise OptionsError(f"{name} must be a directory path, not {type(v).__name__}")
            v = os.fspath(v)
            if not isinstance(v, str) or not v:
                raise OptionsError(f"{name} must be a directory path, not {v!r}")
            object.__setattr__(self, name, v)
        object.__setattr__(self, "capture", _capture_value(self.capture))
        _check_types(self)
        if self.capture_bytes < 0:
            raise OptionsError(f"capture_bytes must be >= 0, not {self.capture_bytes}")
        if self.engine not in ENGINES:
            raise OptionsError(f"engine must be 'auto', 'native' or 'python', not {self.engine!r}")
        if not (self.baseline_time >= 0 and self.baseline_memory >= 0):
            raise OptionsError("baseline_time and baseline_memory are fractions >= 0 (0.2 = +20%)")
        if self.max_casts is not None and self.max_casts < 0:
            raise OptionsError(f"max_casts must be >= 0, not {self.max_casts}")
        if self.chunk_rows < 1 or self.spill_rows < self.chunk_rows:
            raise OptionsError("chunk_rows must be >= 1 and spill_rows >= chunk_rows")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TraceOptions:
        """Build the options stored in a trace's metadata.

        Names this version does not know (a setting of an older version that is a display option
        now, or an option of a newer minor version) are ignored; a known name with a bad value is
        an ``OptionsError``.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {k: (tuple(v) if k == "expect" and isinstance(v, list) else v)
                              for k, v in d.items() if k in names}
        return cls(**kw)

    def replace(self, **changes: Any) -> TraceOptions:
        """Return a copy with ``changes`` (validated, unknown names refused)."""
        _refuse_unknown(changes, (type(self),))
        return dataclasses.replace(self, **changes)

    def changed(self) -> dict[str, Any]:
        """Return the options that differ from their defaults, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}

    def for_record(self) -> TraceOptions:
        """Return these options as a trace records them.

        A baseline Trace becomes its label, so the trace's metadata never keeps another trace alive.
        """
        b = self.baseline
        if b is None or isinstance(b, str):
            return self
        return dataclasses.replace(self, baseline=baseline_label(b))

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict: tuples as lists, a baseline Trace as its label."""
        rec = self.for_record()
        return {f.name: (list(v) if isinstance(v, tuple) else v) for f in dataclasses.fields(rec)
                for v in [getattr(rec, f.name)]}


def _capture_value(v: Any) -> Any:
    """Normalise capture=: None, "nonfinite", "errors", or the seqs to capture as a sorted tuple.

    ``"3,17"`` and ``[3, 17]`` alike give ``(3, 17)``.
    """
    if v is None or v == "" or v is False:
        return None
    if v in ("nonfinite", "errors"):
        return v
    items: Any = v.split(",") if isinstance(v, str) else v
    try:
        seqs = tuple(sorted({int(x) for x in items}))
        if any(isinstance(x, bool) or (isinstance(x, float) and not x.is_integer()) for x in items):
            raise ValueError
    except (TypeError, ValueError):
        raise OptionsError(f"capture must be 'nonfinite', 'errors' or a list of op seqs, not {v!r}") from None
    if not seqs or seqs[0] < 0:
        raise OptionsError(f"capture seqs must be >= 0, not {v!r}")
    return seqs


def baseline_label(b: Any) -> str:
    """What a trace records of the baseline it was compared with: where it was saved, or its repr."""
    if isinstance(b, (str, os.PathLike)):
        return os.fsdecode(b)
    md = getattr(b, "metadata", None)
    saved = getattr(b, "saved_to", None) or (md.get("saved_to") if isinstance(md, Mapping) else None)
    return str(saved) if saved else repr(b)


@dataclass(frozen=True)
class DisplayOptions:
    """How a trace is shown (summary, HTML): never recorded, so a saved trace renders with any of them.

    Examples
    --------
    >>> import torch, tensorscope
    >>> with tensorscope.trace(leaks=False) as t:
    ...     y = torch.ones(2).half().float()
    >>> summary = t.summary(tensorscope.DisplayOptions(numerics_threshold=1e-3))
    """

    numerics_threshold: float = _opt(1e-2, "relative error above which the summary lists an op", type=float,
                                     metavar="X")
    min_finding_share: float = _opt(1e-2, "least cost of a performance finding, as a share of the cell's op time "
                                    "(correctness findings always show)", type=float, metavar="X")

    def __post_init__(self) -> None:
        _check_types(self)
        if self.numerics_threshold < 0:
            raise OptionsError(f"numerics_threshold must be >= 0, not {self.numerics_threshold!r}")
        if not 0 <= self.min_finding_share <= 1:
            raise OptionsError(f"min_finding_share must be from 0 to 1, not {self.min_finding_share!r}")


@dataclass(frozen=True)
class RunContext:
    """Where and how a trace runs; given to ``trace(context=...)`` beside the options.

    Not an option: the magics and the CLI fill it in, and user code rarely needs it.

    Parameters
    ----------
    cell, cell_source : int or None, str or None
        The IPython cell (execution count and text).
    origin : str
        ``"api"`` (``trace()`` in user code), ``"magic"`` (``%%tensorscope``), ``"always_on"``
        (``%tensorscope on``) or ``"cli"`` (``python -m tensorscope run``).
    keep_history : bool
        The trace joins ``tensorscope.history()``.
    deferred_kernels : bool
        CUDA kernels are linked at the next harvest (always-on cells share one profiler).
    """

    cell: Optional[int] = None
    cell_source: Optional[str] = None
    origin: str = "api"
    keep_history: bool = False
    deferred_kernels: bool = False

    def __post_init__(self) -> None:
        if self.cell is not None and not _is_int(self.cell):
            raise OptionsError(f"cell must be an integer or None, not {self.cell!r}")
        if self.cell_source is not None and not isinstance(self.cell_source, str):
            raise OptionsError(f"cell_source must be a string or None, not {type(self.cell_source).__name__}")
        if self.origin not in ORIGINS:
            raise OptionsError(f"origin must be one of {', '.join(ORIGINS)}, not {self.origin!r}")
        for name in ("keep_history", "deferred_kernels"):
            if not isinstance(getattr(self, name), bool):
                raise OptionsError(f"{name} must be True or False, not {getattr(self, name)!r}")


OPTION_CLASSES: tuple[type[Any], ...] = (TraceOptions, DisplayOptions)


def _refuse_unknown(kwargs: Mapping[str, Any], classes: Sequence[type[Any]]) -> None:
    names = {f.name for cls in classes for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise OptionsError(f"unknown trace option(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")


def resolve(options: Optional[TraceOptions] = None, display: Optional[DisplayOptions] = None,
            keywords: Optional[Mapping[str, Any]] = None) -> tuple[TraceOptions, DisplayOptions]:
    """Resolve what ``trace(options, display=..., **keywords)`` records and shows by.

    The objects given, with the keywords replacing their fields. Objects already built are used as
    they are (they validated themselves once); an unknown keyword is an ``OptionsError``.
    """
    if options is not None and not isinstance(options, TraceOptions):
        raise OptionsError(f"trace() takes a TraceOptions (or keywords), not {type(options).__name__}")
    if display is not None and not isinstance(display, DisplayOptions):
        raise OptionsError(f"display must be a DisplayOptions, not {type(display).__name__}")
    keywords = keywords or {}
    _refuse_unknown(keywords, OPTION_CLASSES)
    trace_names = {f.name for f in dataclasses.fields(TraceOptions)}
    trace_kw = {k: v for k, v in keywords.items() if k in trace_names}
    display_kw = {k: v for k, v in keywords.items() if k not in trace_names}
    if options is None:
        opts = TraceOptions(**trace_kw)
    else:
        opts = dataclasses.replace(options, **trace_kw) if trace_kw else options
    if display is None:
        disp = DisplayOptions(**display_kw)
    else:
        disp = dataclasses.replace(display, **display_kw) if display_kw else display
    return opts, disp


def fields(classes: Sequence[type[Any]] = OPTION_CLASSES) -> list[dataclasses.Field[Any]]:
    """Every flag-bearing field of ``classes``: the trace options, then the display options."""
    return [f for cls in classes for f in dataclasses.fields(cls)]


def cli_flag(f: dataclasses.Field[Any]) -> tuple[str, ...]:
    """The command-line spelling of an option: booleans on by default get ``--no-x``."""
    name = f.name.replace("_", "-")
    if f.metadata.get("type") is None and f.default is True:
        return (f"--no-{name}",)
    return (f"--{name}",)


def argparse_arguments(classes: Sequence[type[Any]] = OPTION_CLASSES
                       ) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """(flags, kwargs) pairs for ``argparse.add_argument`` / ``magic_arguments.argument``."""
    out: list[tuple[tuple[str, ...], dict[str, Any]]] = []
    for f in fields(classes):
        md = f.metadata
        flags = cli_flag(f)
        help_ = md["help"]
        if md.get("type") is None and f.default is True:
            help_ = "don't " + help_
        kw: dict[str, Any] = {"dest": f.name, "help": help_}
        if md.get("type") is None:  # boolean switch
            kw.update(action="store_const", const=f.default is not True, default=None)
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


def add_to_parser(parser: argparse.ArgumentParser, classes: Sequence[type[Any]] = OPTION_CLASSES) -> None:
    """The flags of ``classes`` (all options; ``(DisplayOptions,)`` for commands that only show a trace)."""
    for flags, kw in argparse_arguments(classes):
        parser.add_argument(*flags, **kw)


def parse_namespace(ns: argparse.Namespace, **overrides: Any) -> tuple[TraceOptions, DisplayOptions]:
    """The typed options of parsed flags (unset ones keep their defaults), validated once.

    ``overrides`` replace trace options (the CLI's ``--out`` is the dataset).
    Raises ``OptionsError`` on a bad value.
    """
    given: dict[str, Any] = {}
    for f in fields():
        v = getattr(ns, f.name, None)
        if v is None:
            continue
        given[f.name] = tuple(v) if f.name == "expect" else v
    given.update(overrides)
    return resolve(None, None, given)


def to_flags(options: TraceOptions, display: Optional[DisplayOptions] = None, *,
             skip: Sequence[str] = ()) -> list[str]:
    """The command-line flags that reproduce ``options`` (and ``display``).

    The inverse of ``parse_namespace`` for every option that differs from its default.
    """
    out: list[str] = []
    for obj in (options, display or DisplayOptions()):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if f.name in skip or v == f.default:
                continue
            flag = cli_flag(f)[0]
            if f.metadata.get("type") is None:
                out.append(flag)
            elif f.name == "expect":
                for x in v:
                    out += [flag, str(x)]
            elif f.name == "baseline":
                out += [flag, baseline_label(v)]
            else:
                out += [flag, str(v)]
    return out
