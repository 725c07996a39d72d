"""Helpers shared by the test folders (importable from each as ``tests.helpers``), and the paths they use.

* ``kernel_utils``: a real ipykernel driven through jupyter_client;
* ``native_helpers``: minimal modes that drive a native Capture, and the test-op library's source;
* ``synthetic``: hand-made traces for the renderers;
* ``datasets``: the on-disk layout every dataset must have;
* ``cycles``: the collector off, and what of tensorscope's only a collection frees.
"""
from __future__ import annotations

import os

#: the tests/ folder and the repository root (a kernel or subprocess gets ROOT on its PYTHONPATH)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
