"""``TraceMetadata``: what a trace says about itself, typed, frozen and validated.

One record per trace: schema version, tensorscope/torch/python versions, the
device report, the engine that recorded the ops and why, the ``TraceOptions`` it
recorded with, the cell it ran in, timing, counts, notes, and (for multi-rank runs)
its rank identity. It travels as JSON: ``metadata.json`` in a saved trace, and
the same document under the ``b"tensorscope"`` key of every parquet file's
key-value metadata (as pandas does with ``b"pandas"``), so a reader that sees
only one file (DuckDB's ``parquet_kv_metadata``, Spark, pyarrow) still knows
the options it was recorded with: "modules off" is not "no module".

It is also a read-only mapping of its JSON form (``t.metadata["options"]["modules"]``),
so code written against the plain dict of earlier versions keeps working; each
lookup returns a fresh copy, so nothing a caller does to it changes the trace.
``from_dict`` validates a document (a saved one, or one being built): a newer
major schema version is a ``SchemaVersionError``, anything else wrong a
``TraceFormatError`` naming where it came from. Keys this version does not know
(an older or a newer minor version's) are kept in ``extra`` and written back.
"""
from __future__ import annotations

import collections.abc
import copy
import dataclasses
import json
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from . import schema as S
from .errors import OptionsError, SchemaVersionError, TraceFormatError
from .options import TraceOptions

#: ``metadata.json``'s ``format`` field.
FORMAT = "tensorscope-trace"
#: The key of the trace metadata in every parquet file's key-value metadata.
PARQUET_KEY = b"tensorscope"
#: The schema-version-only key earlier versions wrote (still written: cheap for readers that want only it).
PARQUET_VERSION_KEY = b"tensorscope_schema_version"


_MAP = collections.abc.Mapping   # for isinstance: typing.Mapping's check is ~10x slower


def jsonable(o: Any) -> Any:
    """``o`` as plain JSON values (mappings as dicts, sequences as lists, anything else as its str)."""
    if isinstance(o, _MAP):
        return {str(k): jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [jsonable(v) for v in o]
    if isinstance(o, (str, int, float, bool)) or o is None:
        return o
    return str(o)


def _freeze(o: Any) -> Any:
    """A read-only copy of a JSON value: dicts become mapping proxies, lists tuples."""
    if isinstance(o, _MAP):
        return types.MappingProxyType({str(k): _freeze(v) for k, v in o.items()})
    if isinstance(o, (list, tuple)):
        return tuple(_freeze(v) for v in o)
    return o


def check_version(version: Any, where: str) -> tuple[int, int]:
    """The (major, minor) of a schema version string; refuses one newer than this tensorscope reads."""
    try:
        major, minor = S.parse_version(version)
    except (TypeError, ValueError, AttributeError):
        raise TraceFormatError(f"{where}: unreadable schema version {version!r}") from None
    if major > S.SCHEMA_MAJOR:
        raise SchemaVersionError(
            f"{where} was written with tensorscope schema version {version}, newer than this tensorscope "
            f"understands (schema {S.SCHEMA_VERSION}); upgrade tensorscope to read it")
    return major, minor


_Check = Callable[[Any], bool]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_int(v: Any) -> bool:
    return v is None or _int(v)


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _opt_str(v: Any) -> bool:
    return v is None or isinstance(v, str)


def _opt_map(v: Any) -> bool:
    return v is None or isinstance(v, _MAP)


def _map(v: Any) -> bool:
    return isinstance(v, _MAP)


def _strs(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)


def _opt_strs(v: Any) -> bool:
    return v is None or _strs(v)


def _row_counts(v: Any) -> bool:
    return v is None or (isinstance(v, _MAP) and all(isinstance(k, str) and _int(n) for k, n in v.items()))


def _f(default: Any, check: _Check, doc: str) -> Any:
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: _freeze(default), metadata={"check": check, "doc": doc})
    return field(default=default, metadata={"check": check, "doc": doc})


@dataclass(frozen=True, eq=True)
class TraceMetadata(Mapping[str, Any]):
    """A trace's metadata (see the module docstring). Read fields as attributes, or as a mapping."""

    format: str = _f(FORMAT, _str, "always 'tensorscope-trace'")
    schema_version: str = _f(S.SCHEMA_VERSION, _str, "the table schema version the trace was written with")
    tensorscope_version: str = _f("", _str, "tensorscope that recorded it")
    torch_version: str = _f("", _str, "torch.__version__ while recording")
    python_version: str = _f("", _str, "platform.python_version()")
    platform: str = _f("", _str, "platform.platform()")
    created_unix_ns: int = _f(0, _int, "when the trace was built (time.time_ns())")
    device: Mapping[str, Any] = _f({}, _map, "the device/build report (tensorscope.env(), without a CUDA init)")
    options: TraceOptions = _f(TraceOptions(), lambda v: isinstance(v, TraceOptions), "the options it recorded with")
    cell: Optional[int] = _f(None, _opt_int, "the IPython execution count, None outside a notebook")
    cell_source: Optional[str] = _f(None, _opt_str, "the traced cell's source")
    origin: str = _f("api", _str, "api, magic, always_on or cli (RunContext.origin)")
    cell_files: Optional[Mapping[str, Any]] = _f(None, _opt_map, "notebook cell files and their numbers")
    wall_ns: int = _f(0, _int, "wall time of the traced block")
    n_ops: int = _f(0, _int, "rows of ops")
    n_calls: int = _f(0, _int, "rows of calls")
    spilled_rows: int = _f(0, _int, "rows spilled to disk while recording")
    tracer_errors: int = _f(0, _int, "internal tracer errors contained")
    tracer_error_messages: tuple[str, ...] = _f((), _strs, "their first messages")
    native: Optional[Mapping[str, Any]] = _f(None, _opt_map, "native hook status")
    engine: str = _f("python", _str, "the engine that recorded the ops: native or python")
    engine_reason: str = _f("", _str, "why that engine")
    opaque_ops: int = _f(0, _int, "forward ops outside any torch-level call")
    compiled_ops: Optional[int] = _f(None, _opt_int, "of those, dispatched by torch.compile'd code")
    nonfinite_screen: Optional[Mapping[str, Any]] = _f(None, _opt_map, "NaN/Inf screen counters")
    numerics: Optional[Mapping[str, Any]] = _f(None, _opt_map, "numerics shadow counters")
    notes: tuple[str, ...] = _f((), _strs, "what the trace could not see, and why")
    module_roots: Optional[tuple[str, ...]] = _f(None, _opt_strs, "class of each outermost module called (module "
                                                 "paths are relative to it); None: not recorded (older traces)")
    distributed: Optional[Mapping[str, Any]] = _f(None, _opt_map, "rank identity, run id and clock offsets")
    dataset: Optional[Mapping[str, Any]] = _f(None, _opt_map, "where dataset= wrote the trace (or it was read from)")
    saved_to: Optional[str] = _f(None, _opt_str,
                                 "the directory the trace was last saved to or loaded from (not written to files)")
    tables: Optional[Mapping[str, int]] = _f(None, _row_counts, "rows per table, when saved")
    #: keys this version does not know, kept as they were
    extra: Mapping[str, Any] = field(default_factory=lambda: types.MappingProxyType({}), compare=True)

    def __post_init__(self) -> None:
        # every way in (from_dict, replace, the constructor itself) is checked and frozen here
        for name in _FIELDS:
            _set_checked(self, name, getattr(self, name))
        _set_checked(self, "extra", self.extra)

    # -- construction ----------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "trace metadata",
                  require_format: bool = False) -> TraceMetadata:
        """Validate a metadata document (``options`` may be a dict or a ``TraceOptions``); errors
        name ``where``. Keys this version does not know go to ``extra``."""
        if not isinstance(d, _MAP):
            raise TraceFormatError(f"{where}: trace metadata must be a JSON object, not {type(d).__name__}")
        if require_format and d.get("format") != FORMAT:
            raise TraceFormatError(f"{where} is not tensorscope trace metadata (format {d.get('format')!r})")
        check_version(d.get("schema_version", "0.0"), where)
        kw, extra = _split(d, where)
        try:
            return cls(**kw, extra=extra)
        except TraceFormatError as e:
            raise TraceFormatError(f"{where}: {e}") from None

    @classmethod
    def from_json(cls, text: str, *, where: str) -> TraceMetadata:
        try:
            d = json.loads(text)
        except ValueError as e:
            raise TraceFormatError(f"{where}: trace metadata is not valid JSON: {e}") from None
        return cls.from_dict(d, where=where, require_format=True)

    def replace(self, **changes: Any) -> TraceMetadata:
        """A validated copy with ``changes`` (for tensorscope's own use while it builds or saves a
        trace); names this version does not know go to ``extra``. Only the changes are checked:
        the rest was checked and frozen when this one was made."""
        if "schema_version" in changes:
            check_version(changes["schema_version"], "trace metadata")
        kw, extra = _split(changes, "trace metadata")
        if extra:
            kw["extra"] = {**self.extra, **extra}
        out = copy.copy(self)
        for name, v in kw.items():
            _set_checked(out, name, v)
        return out

    # -- output ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON document (plain dicts and lists; unknown keys of ``extra`` at the top level again)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            out[f.name] = v.to_dict() if isinstance(v, TraceOptions) else jsonable(v)
        for k, v in self.extra.items():
            out.setdefault(k, jsonable(v))
        return out

    def to_json(self, indent: Optional[int] = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    # -- the read-only mapping view ------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        if key != "extra" and key in _FIELD_SET:
            v = getattr(self, key)
            return v.to_dict() if isinstance(v, TraceOptions) else jsonable(v)
        if key in self.extra:
            return jsonable(self.extra[key])   # a fresh copy
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        yield from (n for n in _FIELD_NAMES if n != "extra")
        yield from (k for k in self.extra if k not in _FIELD_SET)

    def __len__(self) -> int:
        return len(_FIELD_NAMES) - 1 + sum(1 for k in self.extra if k not in _FIELD_SET)

    def __contains__(self, key: object) -> bool:
        return (isinstance(key, str) and key != "extra" and key in _FIELD_SET) or key in self.extra

    __hash__ = None  # type: ignore[assignment]   # holds mappings: not hashable

    def __repr__(self) -> str:
        return (f"TraceMetadata(schema_version={self.schema_version!r}, engine={self.engine!r}, n_ops={self.n_ops}, "
                f"cell={self.cell!r}, options={self.options.changed()!r})")


_FIELDS = {f.name: f for f in dataclasses.fields(TraceMetadata) if f.name != "extra"}
_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(TraceMetadata))
_FIELD_SET = frozenset(_FIELD_NAMES)


def _set_checked(md: TraceMetadata, name: str, v: Any) -> None:
    """Check ``v`` against field ``name``'s declaration and set it, frozen (``TraceFormatError`` if wrong)."""
    if name == "extra":
        if not isinstance(v, _MAP):
            raise TraceFormatError(f"metadata field 'extra' must be a mapping, not {_short(v)}")
        v = _freeze(jsonable(v))
    elif name == "options":
        if not isinstance(v, TraceOptions):
            raise TraceFormatError(f"metadata field 'options' must be a TraceOptions, not {_short(v)}")
        v = v.for_record()
    elif not (v is None and _FIELDS[name].default is None):
        f = _FIELDS[name]
        if not f.metadata["check"](v):
            raise TraceFormatError(f"metadata field {name!r} has a value of the wrong kind: {_short(v)} "
                                   f"({f.metadata['doc']})")
        v = _freeze(v)
    object.__setattr__(md, name, v)


def _split(d: Mapping[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The known fields of ``d`` (options parsed into a ``TraceOptions``), and the unknown ones."""
    kw: dict[str, Any] = {}
    extra: dict[str, Any] = dict(d["extra"]) if isinstance(d.get("extra"), _MAP) else {}
    for k, v in d.items():
        if k == "extra":
            continue
        if k not in _FIELDS:
            extra[str(k)] = v
        else:
            kw[k] = _options(v, where) if k == "options" else v
    return kw, extra


def _options(v: Any, where: str) -> TraceOptions:
    if isinstance(v, TraceOptions):
        return v
    if not isinstance(v, _MAP):
        raise TraceFormatError(f"{where}: metadata field 'options' must be an object, not {_short(v)}")
    try:
        return TraceOptions.from_dict(v)
    except OptionsError as e:
        raise TraceFormatError(f"{where}: invalid trace options: {e}") from None
    except TypeError as e:
        raise TraceFormatError(f"{where}: invalid trace options: {e}") from None


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."
