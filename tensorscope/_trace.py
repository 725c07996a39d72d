"""Trace: the immutable, tensor-free result of a recording (or of ``load()``).

A Trace is built whole: the recorded tables and the complete ``TraceMetadata`` are given at
construction (``kernels`` may be given as its resolver, run once on first read). Derived tables
(``casts``, ``layout_changes``, ``memory``, ``api``) are computed on first access by the pure
functions in ``analyses/`` and cached; ``memory`` and the ``memory_timeline`` view are built a block
of ops at a time and, past ``io.derived.MAP_ROWS`` rows, memory-mapped from an unlinked file (in a
spilled trace's table directory, else a temporary one). Its attributes cannot be assigned, its tables are Arrow
(immutable) and its metadata is frozen and never replaced; ``t.metadata`` reads it with the one
fact learnt later, the notes of the kernels resolver. Where ``save`` wrote the trace is kept beside
it (``t.saved_to``), not in its metadata. Nothing here refers to a tensor, so a Trace sitting in
``Out`` keeps no memory alive.
"""
from __future__ import annotations

import os
import shutil
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import pyarrow as pa

from . import schema as S
from .metadata import TraceMetadata

if TYPE_CHECKING:
    from .render.views import TableView


def _view(table: pa.Table, title: str, notes: Sequence[str] = ()) -> TableView:
    from .render.views import TableView

    return TableView(table, title, tuple(notes))


def _derive(name: str, tables: dict[str, pa.Table], where: Optional[str] = None) -> pa.Table:
    """The derived table ``name`` from the recorded ``tables``.

    ``where``: the directory a big one's memory-mapped file goes to (a spilled trace's; None: a temporary one).
    """
    try:
        if name == "casts":
            from .analyses.casts import casts

            return S.conform("casts", casts(tables["ops"], tables["calls"]))
        if name == "layout_changes":
            from .analyses.layout import layout_changes

            return S.conform("layout_changes", layout_changes(tables["ops"], tables["calls"]))
        if name == "memory":
            return _memory_table(tables["tensors"], tables["ops"].num_rows, where)
        if name == "api":
            from .analyses.api import api_table

            return S.conform("api", api_table(tables["ops"], tables["calls"]))
    except ImportError:
        return S.empty(name)
    raise KeyError(name)


def _memory_table(tensors: pa.Table, n_ops: int, where: Optional[str]) -> pa.Table:
    """``memory`` a block of ops at a time; memory-mapped past ``io.derived.MAP_ROWS`` rows."""
    from .analyses.memory import memory_devices
    from .analyses.memory_batches import memory_batches
    from .io.derived import table_from_batches

    rows = n_ops * memory_devices(tensors) if n_ops > 0 and tensors.num_rows else 0
    return table_from_batches(S.MEMORY, lambda: memory_batches(tensors, n_ops), rows, where, "memory")




class _Resolver:
    """A table given as the function that makes it (``Trace(kernels=...)``)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], tuple[pa.Table, Sequence[str]]]) -> None:
        self.fn = fn


class Trace:
    """One recording: the Arrow tables and the metadata of a traced block, read-only and tensor-free.

    ``with tensorscope.trace() as t:`` gives one when the block ends, :func:`tensorscope.load` reads a
    saved one back. Each table is a :class:`pyarrow.Table` with a fixed schema (empty, with every
    column, when nothing was recorded): the recorded ``ops``, ``calls``, ``tensors``, ``errors``,
    ``kernels``, ``leaks``, ``graphs``, ``graph_nodes``, ``collectives``, ``allocator``,
    ``allocator_segments``, ``allocator_blocks``, ``allocator_events``, and the derived ``casts``,
    ``layout_changes``, ``memory`` and ``api`` (computed on first access). Each is an attribute
    (``t.ops``) and ``t.table(name)``; the user guide's tables page documents every column.

    A Trace holds no reference to a tensor, so keeping one keeps no memory alive. Its attributes
    cannot be assigned and it is never pickled: ``t.save(path)`` writes parquet.

    Examples
    --------
    >>> import torch, tensorscope
    >>> with tensorscope.trace(leaks=False) as t:
    ...     y = torch.ones(4, 4).relu().sum()
    >>> trace = tensorscope.last()
    >>> trace.ops.column("op").to_pylist()[:2]
    ['aten.ones.default', 'aten.relu.default']
    >>> sorted(trace.tables)[:3]
    ['allocator', 'allocator_blocks', 'allocator_events']
    """

    _tables: dict[str, Any]     # name -> pa.Table (or a deferred table, resolved on first access)
    _metadata: TraceMetadata    # as built; never replaced
    _later: dict[str, Any]      # saved_to (Trace.save), notes (the kernels resolver) when they come
    _plot: Any
    _derived: dict[str, pa.Table]   # views that are no table of the trace (memory_timeline ...), cached
    _spill_dir: Optional[str]       # a spilled trace's table directory (big derived tables are mapped there)

    def __init__(self, tables: dict[str, pa.Table], metadata: Union[TraceMetadata, Mapping[str, Any]], *,
                 kernels: Optional[Callable[[], tuple[pa.Table, Sequence[str]]]] = None,
                 _spill_file: Optional[str] = None):
        """Build a trace from its tables and metadata (the recording session and ``load`` do).

        ``tables``: the recorded tables by name (missing ones are empty); ``kernels``: instead of a
        ``kernels`` table, its resolver, run once on first read (always-on cells link CUDA kernels
        at the next harvest), returning the table and the notes it adds to the metadata.
        """
        tabs: dict[str, Any] = {name: tables.get(name) if tables.get(name) is not None else S.empty(name)
                                for name in S.RECORDED}
        for name in S.DERIVED:
            if tables.get(name) is not None:
                tabs[name] = tables[name]
        pending = tabs["kernels"]
        if kernels is None and not isinstance(pending, pa.Table) and callable(getattr(pending, "resolve", None)):
            kernels = pending.resolve   # a pending table given in ``tables`` (an object with ``resolve()``)
        if kernels is not None:
            tabs["kernels"] = _Resolver(kernels)
        md = metadata if isinstance(metadata, TraceMetadata) else TraceMetadata.from_dict(metadata)
        object.__setattr__(self, "_tables", tabs)
        object.__setattr__(self, "_metadata", md)
        object.__setattr__(self, "_later", {})
        object.__setattr__(self, "_plot", None)
        object.__setattr__(self, "_derived", {})
        object.__setattr__(self, "_spill_dir", os.path.dirname(_spill_file) if _spill_file else None)
        if _spill_file:
            # a spilled trace: its ops, calls and tensors (and what probes added to them) are
            # memory-mapped files in _spill_file's directory, removed when the Trace goes
            weakref.finalize(self, shutil.rmtree, os.path.dirname(_spill_file), True)

    def _release_pages(self) -> int:
        """Give the kernel back the file pages a pass read from the memory-mapped tables; the bytes advised.

        A spilled or big loaded trace's tables are mapped files (``io/pages.py``). A trace held in
        memory has none: nothing is done for it (not even reading the process's mappings).
        """
        from .io.pages import MMAP_ROWS, release

        tables = [t for t in (*self._tables.values(), *self._derived.values()) if isinstance(t, pa.Table)]
        if self._spill_dir is None and not any(t.num_rows > MMAP_ROWS for t in tables):
            return 0

        return release(*tables)

    # -- tables ------------------------------------------------------------
    def table(self, name: str) -> pa.Table:
        """The table ``name`` (``"ops"``, ``"casts"``, ...), derived on first access when it is a derived one.

        Raises
        ------
        KeyError
            ``name`` is not a table of a trace.
        """
        if name not in S.TABLES:
            raise KeyError(f"no table {name!r}; tables: {', '.join(S.TABLES)}")
        t = self._tables.get(name)
        if t is None:
            t = self._tables[name] = _derive(name, self._tables, self._spill_dir)
        elif isinstance(t, _Resolver):
            # the kernels resolver given at construction (always-on CUDA kernels): run once
            t, notes = t.fn()
            self._tables[name] = t
            if notes:
                self._later["notes"] = self._metadata.notes + tuple(notes)
                self._later.pop("metadata", None)
        return t

    # -- metadata ------------------------------------------------------------------
    @property
    def metadata(self) -> TraceMetadata:
        """The trace's ``TraceMetadata``.

        Typed attributes (``t.metadata.options.modules``) and a read-only mapping of its JSON form
        (``t.metadata["options"]["modules"]``): the metadata the trace was built with, plus the
        kernels' notes once read. ``save`` does not change it (:attr:`saved_to` says where it wrote).
        """
        later = self._later
        if "notes" not in later:
            return self._metadata
        md = later.get("metadata")
        if md is None:
            md = later["metadata"] = self._metadata.replace(notes=later["notes"])
        return md

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a Trace is read-only: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a Trace is read-only: cannot delete {name!r}")

    @property
    def tables(self) -> dict[str, pa.Table]:
        """Every table by name, the derived ones included."""
        return {name: self.table(name) for name in S.TABLES}

    # one property per table, typed (a type checker sees a pyarrow.Table)
    @property
    def ops(self) -> pa.Table:
        return self.table("ops")

    @property
    def calls(self) -> pa.Table:
        return self.table("calls")

    @property
    def tensors(self) -> pa.Table:
        return self.table("tensors")

    @property
    def errors(self) -> pa.Table:
        return self.table("errors")

    @property
    def kernels(self) -> pa.Table:
        return self.table("kernels")

    @property
    def leaks(self) -> pa.Table:
        return self.table("leaks")

    @property
    def casts(self) -> pa.Table:
        return self.table("casts")

    @property
    def layout_changes(self) -> pa.Table:
        return self.table("layout_changes")

    @property
    def memory(self) -> pa.Table:
        return self.table("memory")

    @property
    def graphs(self) -> pa.Table:
        return self.table("graphs")

    @property
    def graph_nodes(self) -> pa.Table:
        return self.table("graph_nodes")

    @property
    def api(self) -> pa.Table:
        return self.table("api")

    @property
    def collectives(self) -> pa.Table:
        return self.table("collectives")

    @property
    def allocator(self) -> pa.Table:
        return self.table("allocator")

    @property
    def allocator_segments(self) -> pa.Table:
        return self.table("allocator_segments")

    @property
    def allocator_blocks(self) -> pa.Table:
        return self.table("allocator_blocks")

    @property
    def allocator_events(self) -> pa.Table:
        return self.table("allocator_events")

    # -- what memory is made of (analyses/memory_categories.py) -------------------------------------
    # One style: a table computed from the trace alone is a property (``t.memory_timeline``), a view
    # that takes arguments is a method (``t.memory_at(seq)``, ``t.op_totals(by=...)``). Each of these
    # is a ``TableView`` (render/views.py): the Arrow table, displayed as a compact table;
    # ``.to_arrow()`` / ``.to_pandas()``, and everything a ``pyarrow.Table`` answers. The spelling
    # they had as methods (``t.memory_timeline``) still works and warns (``TableView.__call__``).
    @property
    def memory_timeline(self) -> TableView:
        """Live bytes by category (``tensors.category``) after each op.

        One row per (op, device), with the op, phase, module and source line; ``is_peak`` marks each
        device's peak (schema ``MEMORY_TIMELINE``).
        """
        got = self._derived.get("memory_timeline")
        if got is None:
            from .analyses.memory import memory_devices
            from .analyses.memory_batches import memory_timeline_batches
            from .io.derived import table_from_batches

            tensors, ops = self.tensors, self.ops
            rows = ops.num_rows * memory_devices(tensors) if tensors.num_rows else 0
            got = self._derived["memory_timeline"] = table_from_batches(
                S.MEMORY_TIMELINE, lambda: memory_timeline_batches(tensors, ops), rows, self._spill_dir,
                "memory_timeline")
        return _view(got, "t.memory_timeline: live bytes by category after each op",
                     ("is_peak marks each device's peak; t.memory_at() breaks it down by module",))

    @property
    def allocator_timeline(self) -> TableView:
        """The CUDA caching allocator's reserved and allocated bytes after each of its events.

        Per device, with ``memory_history=True``; empty otherwise (schema ``ALLOCATOR_TIMELINE``).
        """
        got = self._derived.get("allocator_timeline")
        if got is None:
            from .analyses.allocator import allocator_timeline

            got = self._derived["allocator_timeline"] = allocator_timeline(self.allocator_events, self.allocator)
        notes = () if got.num_rows else ("recorded only with memory_history=True on a CUDA device",)
        return _view(got, "t.allocator_timeline: the CUDA caching allocator after each event", notes)

    def memory_at(self, seq: Optional[int] = None) -> TableView:
        """What was alive after op ``seq`` (default: each device's peak).

        Bytes and storages by (device, category, module), largest first (schema ``MEMORY_AT``).

        Raises
        ------
        IndexError
            ``seq`` is not an op of this trace.
        """
        from .analyses.memory_categories import memory_at

        if seq is not None and not (0 <= int(seq) < self.ops.num_rows):
            raise IndexError(f"seq {seq} is not an op of this trace (0..{self.ops.num_rows - 1})")
        where = "each device's peak" if seq is None else f"op {int(seq)}"
        return _view(memory_at(self.tensors, self.ops, seq), f"t.memory_at(): alive after {where}")

    @property
    def module_memory(self) -> TableView:
        """Memory per module (children rolled into parents) and device.

        Bytes of activations its forward saved for backward and the peaks while its forward and
        backward ops ran (schema ``MODULE_MEMORY``).
        """
        got = self._derived.get("module_memory")
        if got is None:
            from .analyses.memory_batches import module_memory

            got = self._derived["module_memory"] = module_memory(self.tensors, self.ops, self.calls)
        return _view(got, "t.module_memory: activations saved and peaks per module")

    def op_totals(self, by: Union[str, Sequence[str]] = "op", *, include_noise: bool = False) -> pa.Table:
        """Totals per group of ATen ops, the largest CPU time first (torch.profiler's ``key_averages()``).

        Calls, CPU time (total, mean, max, share), CUDA time, FLOPs, bytes. ``by``: any ``ops`` column
        or several (``("op", "in_shapes")``: ``group_by_input_shape``); bookkeeping rows are left out
        unless ``include_noise``. The summary's op table reads the same numbers.

        Examples
        --------
        >>> t.op_totals(by=("op", "in_shapes"))  # doctest: +SKIP
        """
        from .analyses.totals import op_totals

        return op_totals(self.ops, by, include_noise=include_noise)

    def df(self, name: str = "ops"):
        """A table as a pandas DataFrame (nullable ints stay ints, strings are plain strings)."""
        import pandas as pd

        from .schema import plain_strings

        return plain_strings(self.table(name)).to_pandas(types_mapper={pa.int64(): pd.Int64Dtype(), pa.int32(): pd.Int32Dtype(),
                                                        pa.bool_(): pd.BooleanDtype()}.get)

    def sql(self, query: str, *, arrow: bool = False):
        """Run DuckDB SQL over the tables (``ops``, ``calls``… by name); a DataFrame, or Arrow with ``arrow=True``."""
        from .analyses.sql import run_sql

        return run_sql(self.table, query, arrow=arrow)

    # -- io ------------------------------------------------------------------
    def save(self, path: Any) -> str:
        """Write a directory: one parquet file per table (zstd) and ``metadata.json``; return its path.

        The trace and its metadata are unchanged: where it was last written is :attr:`saved_to`.
        """
        from .io.parquet import save

        where = save(self, path)
        self._later["saved_to"] = where
        return where

    @property
    def saved_to(self) -> Optional[str]:
        """Where this trace is kept on disk, or None.

        The path ``save`` last wrote, else the directory ``load`` read it from (``metadata.saved_to``).
        The summary's "saved to" line shows it.
        """
        where: Optional[str] = self._later.get("saved_to")
        return where if where is not None else self._metadata.saved_to

    def report(self, path: Any) -> str:
        """Write the full summary as one standalone HTML file and return its path.

        Every section open, more rows, charts with their hover titles; no script, no network,
        everything escaped.
        """
        from .render.summary import write_report

        return write_report(self, path)

    def repro(self, seq: int, path: Any) -> str:
        """Write a standalone script that reruns op ``seq`` and checks its recorded outcome; return its path.

        The script checks an error's type and message, NaN/Inf positions and output strides; its inputs
        are the ones captured with ``capture=``, else random with the recorded shapes and strides.
        """
        from .repro import write_repro

        return write_repro(self, seq, path)

    def to_perfetto(self, path) -> str:
        """Chrome/Perfetto trace-event JSON (opens in ui.perfetto.dev and chrome://tracing)."""
        from .render.perfetto import write_perfetto

        return write_perfetto(self, path)

    @property
    def plot(self):
        """Matplotlib plots: ``t.plot.timeline()``, ``top_ops()``, ``memory()``, ``modules()``.

        Each a Figure that a notebook displays as a PNG (no ``%matplotlib inline`` needed).
        """
        if self._plot is None:
            from .render.plots import PlotAccessor

            object.__setattr__(self, "_plot", PlotAccessor(self))
        return self._plot

    def advice(self, peaks: Any = None, steps: Any = None, min_share: Any = None) -> Any:
        """Why this trace is slow: an ``Advice``, the same as ``tensorscope.advise(self, ...)``.

        ``min_share`` overrides ``DisplayOptions.min_finding_share`` (the share of the cell's op time
        a performance finding must cost to be shown).
        """
        from ._advice import advise

        return advise(self, peaks=peaks, steps=steps, min_share=min_share)

    # -- display -------------------------------------------------------------
    def summary(self, display: Any = None) -> Any:
        """A Summary (sections of rows) — what the notebook shows after a traced cell.

        ``display``: a ``DisplayOptions`` (how to show it, e.g. ``numerics_threshold``); the defaults when None.
        """
        from .render.summary import summarize

        return summarize(self, display)

    def __repr__(self):
        md = self.metadata
        return (f"<tensorscope.Trace: {md.get('n_ops', self.ops.num_rows)} ops, {md.get('n_calls', self.calls.num_rows)} calls, "
                f"{self.errors.num_rows} errors/warnings, cell={md.get('cell')}>")

    def _repr_mimebundle_(self, include=None, exclude=None):
        s = self.summary()
        return {"text/plain": s.to_text(), "text/html": s.to_html()}

    def __getstate__(self):
        raise TypeError("a Trace is not pickled: save it with t.save(path) (parquet, no pickle) and tensorscope.load(path)")


def load(path: Any) -> Trace:
    """Load a trace directory written by :meth:`Trace.save`.

    The metadata and every table are validated; nothing is unpickled and no code runs. Traces of
    every earlier schema version load.

    Parameters
    ----------
    path : str or os.PathLike
        The directory ``t.save(path)`` (or ``%%tensorscope --save``) wrote.

    Returns
    -------
    Trace
        The trace, with ``metadata.saved_to`` set to ``path``.

    Raises
    ------
    TraceFormatError
        The directory is not a trace, or a file in it is damaged or has another table's schema.
    SchemaVersionError
        A newer major schema version wrote it.

    Examples
    --------
    >>> import tempfile, os, torch, tensorscope
    >>> with tensorscope.trace(leaks=False) as t:
    ...     y = torch.ones(3) * 2
    >>> path = t.save(os.path.join(tempfile.mkdtemp(), "run"))
    >>> tensorscope.load(path).ops.equals(t.ops)
    True
    """
    from .io.parquet import read

    tables, md = read(path)
    return Trace(tables, md)
