"""The leak step trace after trace: what it keeps from one trace to the next never changes a finding.

The user's modules are classified once and kept while ``sys.modules`` is unchanged; tensorscope's
own objects (the ``t`` of a running ``with tensorscope.trace() as t``) are never walked.
"""
from __future__ import annotations

import importlib
import sys

import torch

import tensorscope
from tensorscope.tracking.leaks.classify import _user_modules


def _names():
    return {n: m for n, m in _user_modules()}


def test_user_modules_follow_imports_replacements_and_removals(tmp_path, monkeypatch):
    (tmp_path / "ts_nb_helper_a.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert "ts_nb_helper_a" not in _names()
        assert "ts_nb_helper_a" not in _names()          # the kept classification, sys.modules unchanged
        mod = importlib.import_module("ts_nb_helper_a")
        assert _names()["ts_nb_helper_a"] is mod            # imported since: classified again
        del sys.modules["ts_nb_helper_a"]
        again = importlib.import_module("ts_nb_helper_a")   # another module object under the same name
        assert again is not mod and _names()["ts_nb_helper_a"] is again
        again.__dict__["__file__"] = torch.__file__         # now claims to be library code
        assert "ts_nb_helper_a" not in _names()
    finally:
        sys.modules.pop("ts_nb_helper_a", None)
    assert "ts_nb_helper_a" not in _names()


def test_a_module_global_set_between_traces_is_named_in_the_next_trace(tmp_path, monkeypatch):
    (tmp_path / "ts_nb_helper_b.py").write_text("kept = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    x = torch.ones(64)
    try:
        with tensorscope.trace():
            x * 2                                          # the user modules are classified here
        mod = importlib.import_module("ts_nb_helper_b")
        with tensorscope.trace() as t:
            mod.kept = x * 3
        rows = [r for r in t.result.leaks.to_pylist() if r["nbytes"] == 256]
        assert [(r["holder"], r["holder_kind"]) for r in rows] == [("global ts_nb_helper_b.kept", "global")]
    finally:
        sys.modules.pop("ts_nb_helper_b", None)


def _leaks_of(with_name: bool):
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16)

    def f():
        if with_name:
            with tensorscope.trace() as t:
                y = lin(x)
                loss = y.sum()
            res = t.result
        else:
            with tensorscope.trace():
                y = lin(x)
                loss = y.sum()
            res = tensorscope.last()
        del y, loss
        return res

    rows = f().leaks.to_pylist()
    return sorted((r["holder"], r["holder_kind"], r["fix"], r["nbytes"], r["expected"]) for r in rows)


def test_the_running_trace_object_is_never_walked_and_changes_no_row():
    named, unnamed = _leaks_of(True), _leaks_of(False)
    assert named == unnamed and named, named
    assert not [r for r in named if "t." in r[0] or "_session" in r[0]], named


def test_tensorscope_s_own_compiled_libraries_are_not_user_modules():
    """The engine, function-mode and hooks libraries load from the build cache as modules of their own:
    they are tensorscope's, so the leak search never takes their globals for the user's."""
    with tensorscope.trace() as t:
        torch.ones(2) + 1
    from tensorscope.native import cache_root

    root = cache_root()
    loaded = [n for n, m in list(sys.modules.items())
              if isinstance(getattr(m, "__file__", None), str) and m.__file__.startswith(root)]
    if not loaded:
        import pytest

        pytest.skip(f"no compiled library is loaded (engine: {t.metadata['engine']}): nothing to misclassify")
    for name in loaded:
        assert name not in _names(), f"{name} (from {root}) was classified as user code"
