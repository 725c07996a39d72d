"""The package version, defined once (``tensorscope.__version__`` and every trace's metadata read it here)."""

__version__ = "0.1.0"
