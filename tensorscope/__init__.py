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

from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__
from .errors import TensorscopeError as TensorscopeError  # cheap: no torch

#: The public names, by what they are for (the API reference has one heading per group).
GROUPS: dict[str, tuple[str, ...]] = {
    "record": ("trace", "schedule", "predict", "check_substitution"),
    "results": ("Trace", "load", "open_dataset", "Dataset", "last", "history", "advise"),
    "options": ("TraceOptions", "DisplayOptions"),
    "leaks": ("find_leaks", "enable_discovery", "disable_discovery"),
    "compare": ("diff", "diverge"),
    "errors": ("TensorscopeError",),
    "environment": ("env", "load_ipython_extension", "unload_ipython_extension", "__version__"),
}

_LAZY = {
    "trace": ("tensorscope.recording.session", "trace"),
    "schedule": ("tensorscope.windows", "schedule"),
    "predict": ("tensorscope.prediction", "predict"),
    "check_substitution": ("tensorscope.substitution", "check_substitution"),
    "Trace": ("tensorscope._trace", "Trace"),
    "load": ("tensorscope._trace", "load"),
    "open_dataset": ("tensorscope._dataset", "open_dataset"),
    "Dataset": ("tensorscope._dataset", "Dataset"),
    "last": ("tensorscope.recording.history", "last"),
    "history": ("tensorscope.recording.history", "history"),
    "advise": ("tensorscope._advice", "advise"),
    "TraceOptions": ("tensorscope.options", "TraceOptions"),
    "DisplayOptions": ("tensorscope.options", "DisplayOptions"),
    "find_leaks": ("tensorscope.tracking.leaks", "find_leaks"),
    "enable_discovery": ("tensorscope.tracking.leaks", "enable_discovery"),
    "disable_discovery": ("tensorscope.tracking.leaks", "disable_discovery"),
    "diff": ("tensorscope._diff", "diff"),
    "diverge": ("tensorscope.divergence", "diverge"),
    "env": ("tensorscope._env", "env"),
}

#: Names that were top-level before the surface was grouped: still importable from here, with a
#: DeprecationWarning naming the module they live in.
_MOVED = {
    "RunContext": "tensorscope.options",
    "TraceMetadata": "tensorscope.metadata",
    "SCHEMA_VERSION": "tensorscope.schema",
    "leak_table": "tensorscope.tracking.leaks",
    "PredictionError": "tensorscope.prediction",
    "SubstitutionReport": "tensorscope.substitution",
    "Divergence": "tensorscope.divergence",
    "Schedule": "tensorscope.windows",
    "TraceDiff": "tensorscope._diff",
    "Advice": "tensorscope._advice",
    "machine_peaks": "tensorscope._peaks",
    "TraceActiveError": "tensorscope.errors",
    "SchemaVersionError": "tensorscope.errors",
    "TraceFormatError": "tensorscope.errors",
    "ExportError": "tensorscope.errors",
    "OptionsError": "tensorscope.errors",
    "GuardError": "tensorscope.errors",
    "NativeBuildError": "tensorscope.errors",
}

__all__ = [name for names in GROUPS.values() for name in names]

if TYPE_CHECKING:   # what the lazy names are, for a type checker (nothing is imported at run time)
    from ._advice import advise  # noqa: F401  (in __all__)
    from ._dataset import Dataset, open_dataset  # noqa: F401  (in __all__)
    from ._diff import diff  # noqa: F401  (in __all__)
    from ._env import env  # noqa: F401  (in __all__)
    from ._trace import Trace, load  # noqa: F401  (in __all__)
    from .divergence import diverge  # noqa: F401  (in __all__)
    from .options import DisplayOptions, TraceOptions  # noqa: F401  (in __all__)
    from .prediction import predict  # noqa: F401  (in __all__)
    from .recording.history import history, last  # noqa: F401  (in __all__)
    from .recording.session import trace as _trace_block
    from .substitution import check_substitution  # noqa: F401  (in __all__)
    from .tracking.leaks import disable_discovery, enable_discovery, find_leaks  # noqa: F401  (in __all__)
    from .windows import schedule  # noqa: F401  (in __all__)

    class trace(_trace_block):
        """``with tensorscope.trace() as t:``: to a type checker ``t`` is the :class:`Trace`.

        At run time the block's object forwards every public attribute to the finished Trace (and
        adds ``result`` and ``summary(display)``); this declaration says so to a type checker.
        """

        def __enter__(self) -> Trace: ...  # type: ignore[override]


def __getattr__(name: str) -> Any:
    import importlib
    import importlib.util

    target = _LAZY.get(name)
    if target is not None:
        value = getattr(importlib.import_module(target[0]), target[1])
        globals()[name] = value
        return value
    home = _MOVED.get(name)
    if home is not None:
        import warnings

        # not cached in globals(): every use says where the name lives now
        warnings.warn(f"tensorscope.{name} is deprecated: use {home}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")   # tensorscope.options.RunContext after `import tensorscope`
    raise AttributeError(f"module 'tensorscope' has no attribute {name!r}")


def __dir__():
    return __all__


def load_ipython_extension(ipython):
    """``%load_ext tensorscope``."""
    from .magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython):
    from .magics import unload_ipython_extension as _unload

    _unload(ipython)
