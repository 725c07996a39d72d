"""Persistence: a trace's tables and metadata to parquet files and back, and multi-rank datasets.

io knows tables and ``TraceMetadata``, never the ``Trace`` class: writers take any object with
``table(name)`` and ``metadata`` (``TraceTables``); readers return ``(tables, metadata)``, from
which the results layer builds the Trace (``tensorscope.load``, ``Dataset.trace``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import pyarrow as pa

    from ..metadata import TraceMetadata


class TraceTables(Protocol):
    """What a writer reads from a trace: its tables by name and its metadata."""

    @property
    def metadata(self) -> TraceMetadata: ...

    def table(self, name: str) -> pa.Table: ...
