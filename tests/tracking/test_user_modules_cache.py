"""The leak finder's cache of the user's modules (classify._user_modules) sees every change to
sys.modules: a module added, removed, or another object bound to an existing name. Runs with the
native hooks (native.dict_identity: one C pass) and without them (the fallback's list compare)."""

from __future__ import annotations

import sys
import types

import pytest

from tensorscope import native
from tensorscope.tracking.leaks import classify


def _user_module(name: str, tmp_path) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__file__ = str(tmp_path / f"{name}.py")   # outside site-packages and the stdlib: the user's
    return m


@pytest.fixture(params=["native", "fallback"])
def identity(request, monkeypatch):
    if request.param == "native":
        native.open_capture().close()   # loads the hooks when they can be built
        if native.dict_identity({}) is None:
            pytest.skip("native hooks unavailable")
    else:
        monkeypatch.setattr(classify, "dict_identity", lambda d: None)
    monkeypatch.setattr(classify, "_UM_CACHE", None)
    return request.param


def _names():
    return {n for n, _m in classify._user_modules()}


def test_changes_to_sys_modules_are_seen(identity, tmp_path, monkeypatch):
    a = _user_module("ts_cache_probe_a", tmp_path)
    monkeypatch.setitem(sys.modules, "ts_cache_probe_a", a)
    assert "ts_cache_probe_a" in _names()
    assert "ts_cache_probe_a" in _names()          # the cached answer
    lib = types.ModuleType("ts_cache_probe_lib")   # no __file__: not the user's
    monkeypatch.setitem(sys.modules, "ts_cache_probe_lib", lib)
    assert "ts_cache_probe_lib" not in _names()
    # another object bound to an existing name (same names, same order): the user's now
    sys.modules["ts_cache_probe_lib"] = _user_module("ts_cache_probe_lib", tmp_path)
    assert "ts_cache_probe_lib" in _names()
    del sys.modules["ts_cache_probe_a"]
    assert "ts_cache_probe_a" not in _names()


def test_dict_identity_follows_identities_not_values():
    if native.dict_identity({}) is None:
        native.open_capture().close()
    if native.dict_identity({}) is None:
        pytest.skip("native hooks unavailable")
    x, y = object(), object()
    d = {"a": x, "b": y}
    h = native.dict_identity(d)
    assert native.dict_identity(d) == h
    assert native.dict_identity({"a": x, "b": y}) == h     # same keys (interned) and objects
    assert native.dict_identity({"b": y, "a": x}) != h     # order matters, as for the list compare
    d["a"] = object()
    assert native.dict_identity(d) != h
    d["a"] = x
    assert native.dict_identity(d) == h
    d["c"] = x
    assert native.dict_identity(d) != h
    with pytest.raises(TypeError):
        native.dict_identity([1, 2])
