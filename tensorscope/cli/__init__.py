"""Headless commands of ``python -m tensorscope``: one module per command (``run``, ``report``, ``install-kernel``)."""
