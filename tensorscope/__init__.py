"""tensorscope: every ATen op, layout change, cast, leak and C++ error of a PyTorch cell, as Arrow tables.

``import tensorscope`` is cheap and has no side effects: torch, pyarrow and IPython
are imported on first use of the API, and no hook is installed until a trace starts.

    with tensorscope.trace() as t:
        loss = model(x).sum(); loss.backward()
    t.ops            # pyarrow.Table, one row per ATen op
    t.sql("select op, sum(cpu_ns) from ops group by op")
    t.save("runs/step1"); tensorscope.load("runs/step1")

In IPython/Jupyter: ``%load_ext tensorscope`` then ``%%tensorscope`` on a cell.
"""
from __future__ import annotations

from ._version import __version__ as __version__
from .errors import (  # noqa: F401  (cheap: no torch)
    ExportError,
    GuardError,
    NativeBuildError,
    OptionsError,
    SchemaVersionError,
    TensorscopeError,
    TraceActiveError,
    TraceFormatError,
)

_LAZY = {
    "trace": ("tensorscope.recording.session", "trace"),
    "last": ("tensorscope.recording.history", "last"),
    "history": ("tensorscope.recording.history", "history"),
    "Trace": ("tensorscope._trace", "Trace"),
    "TraceOptions": ("tensorscope.options", "TraceOptions"),
    "DisplayOptions": ("tensorscope.options", "DisplayOptions"),
    "RunContext": ("tensorscope.options", "RunContext"),
    "TraceMetadata": ("tensorscope.metadata", "TraceMetadata"),
    "load": ("tensorscope._trace", "load"),
    "open_dataset": ("tensorscope._dataset", "open_dataset"),
    "Dataset": ("tensorscope._dataset", "Dataset"),
    "find_leaks": ("tensorscope.tracking.leaks", "find_leaks"),
    "leak_table": ("tensorscope.tracking.leaks", "leak_table"),
    "enable_discovery": ("tensorscope.tracking.leaks", "enable_discovery"),
    "disable_discovery": ("tensorscope.tracking.leaks", "disable_discovery"),
    "env": ("tensorscope._env", "env"),
    "SCHEMA_VERSION": ("tensorscope.schema", "SCHEMA_VERSION"),
    "check_substitution": ("tensorscope.substitution", "check_substitution"),
    "predict": ("tensorscope.prediction", "predict"),
    "PredictionError": ("tensorscope.prediction", "PredictionError"),
    "diff": ("tensorscope._diff", "diff"),
    "TraceDiff": ("tensorscope._diff", "TraceDiff"),
    "diverge": ("tensorscope.divergence", "diverge"),
    "Divergence": ("tensorscope.divergence", "Divergence"),
    "SubstitutionReport": ("tensorscope.substitution", "SubstitutionReport"),
    "advise": ("tensorscope._advice", "advise"),
    "Advice": ("tensorscope._advice", "Advice"),
    "machine_peaks": ("tensorscope._peaks", "machine_peaks"),
    "schedule": ("tensorscope.windows", "schedule"),
    "Schedule": ("tensorscope.windows", "Schedule"),
}

__all__ = sorted(list(_LAZY) + ["__version__", "load_ipython_extension", "unload_ipython_extension",
                                "TensorscopeError", "TraceActiveError", "SchemaVersionError", "TraceFormatError",
                                "ExportError", "OptionsError", "GuardError", "NativeBuildError"])


def __getattr__(name):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'tensorscope' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value
    return value


def __dir__():
    return __all__


def load_ipython_extension(ipython):
    """``%load_ext tensorscope``."""
    from .magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython):
    from .magics import unload_ipython_extension as _unload

    _unload(ipython)
