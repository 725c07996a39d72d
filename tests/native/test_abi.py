"""The C layouts (tensorscope/native/abi.h, exported by every library as ``abi()``) against the Python
side's own definitions, which the pure-Python fallback keeps: they must agree field for field.

The Python definitions are imported in one place, :func:`_python`, so the tests follow them when
they move. Like tests/native/test_native.py, the libraries are compiled for real (or loaded from the
cache); the tests skip only where nothing can be compiled and nothing is cached.
"""
from __future__ import annotations

import ctypes
import struct
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import tensorscope.native as tn
from tensorscope.native import _build


def _python() -> SimpleNamespace:
    """Every Python-side definition the C layouts must match (the one place that imports them)."""
    from tensorscope.recording import function, recorder
    from tensorscope.recording.engines import native as engines

    return SimpleNamespace(
        ROW_DTYPE=engines.ROW_DTYPE, PACKED_COLUMNS=engines.PACKED_COLUMNS, PACKED_DTYPES=engines._PACKED_DTYPES,
        F_THREW=engines.F_THREW, decode_args=engines._decode_args,
        OPS_FIELDS=recorder.OPS_FIELDS, CALL_FIELDS=recorder.CALL_FIELDS, TENSOR_COLUMNS=recorder.TENSOR_COLUMNS,
        F_BACKWARD=recorder.F_BACKWARD, SCHEMA_FLAGS=(recorder.F_INPLACE, recorder.F_VIEW, recorder.F_OUT_KW),
        CALL_DTYPE=function.CALL_DTYPE, abi_mismatch=engines.abi_mismatch,
        KINDS={"DIRECT": function.DIRECT, "RECORD": function.RECORD, "PASS": function.PASS, "LAZY": function.LAZY,
               "PRINTING": function._C_PRINTING},
    )


def _lib(spec: _build.LibSpec):
    problem = _build.toolchain_problem()
    if problem and _build.cached(spec) is None:
        pytest.skip(f"cannot compile the native part here: {problem}")
    mod, reason = _build.ensure(spec)
    assert mod is not None, f"{spec.what} failed to build: {reason}"
    return mod


@pytest.fixture(scope="module")
def engine():
    return _lib(_build.ENGINE)


@pytest.fixture(scope="module")
def fmode():
    return _lib(_build.FMODE)


@pytest.fixture(scope="module")
def hooks():
    return _lib(_build.HOOKS)


@pytest.fixture(scope="module")
def abi(engine, fmode, hooks):
    return engine.abi()


def test_every_library_exports_the_same_abi(engine, fmode, hooks):
    d = engine.abi()
    assert d == fmode.abi() == hooks.abi()
    assert tn.abi() == d and tn.abi("fmode") == d and tn.abi("hooks") == d


def test_the_ops_row_is_row_dtype(abi, engine):
    py = _python()
    dt = tn.abi_dtype("row")
    assert dt == py.ROW_DTYPE, (dt.descr, py.ROW_DTYPE.descr)
    assert [(n, dt.fields[n][1]) for n in dt.names] == [(n, py.ROW_DTYPE.fields[n][1]) for n in py.ROW_DTYPE.names]
    assert abi["row_size"] == py.ROW_DTYPE.itemsize == engine.ROW_SIZE


def test_the_packed_columns_are_the_recorders_ops_columns(abi, engine):
    py = _python()
    packed = abi["packed"]
    assert tuple(packed["columns"]) == py.PACKED_COLUMNS
    assert engine.PACKED_COLUMNS == len(py.PACKED_COLUMNS) and engine.BLOCK_ROWS == packed["block_rows"]
    assert {w: np.dtype(k) for w, k in packed["widths"].items()} == {w: np.dtype(t) for w, t in py.PACKED_DTYPES.items()}
    # a chunk's columns, as NativeEngine hands them to the recorder: the row flags ("rflags") become
    # the ops table's flags, flops are added, and the storage ids ride along
    assert set(packed["columns"]) - {"rflags"} | {"flags", "flops"} == set(py.OPS_FIELDS) | {"storages"}
    # every row member is a packed column ("flags": the row flags, packed as "rflags")
    assert {("rflags" if n == "flags" else n) for n, *_ in abi["row"]} == set(packed["columns"]) - {"storages"}


def test_the_row_flags(abi, engine):
    py = _python()
    flags = abi["flags"]
    assert flags == tn.abi_flags()
    assert flags["F_BACKWARD"] == py.F_BACKWARD == engine.F_BACKWARD
    assert flags["F_THREW"] == py.F_THREW == engine.F_THREW
    assert flags["F_OTHER_THREAD"] == engine.F_OTHER_THREAD
    values = list(flags.values()) + list(py.SCHEMA_FLAGS)
    assert all(v > 0 and v & (v - 1) == 0 for v in values), values   # one bit each
    assert len(set(values)) == len(values), values   # the engine's flags never collide with the schema flags


def test_the_calls_row_is_call_dtype(abi, fmode):
    py = _python()
    dt = tn.abi_dtype("call")
    assert dt == py.CALL_DTYPE, (dt.descr, py.CALL_DTYPE.descr)
    assert abi["call_size"] == py.CALL_DTYPE.itemsize == fmode.ROW_SIZE
    # field(cid, k) / column(k) index recorder.CALL_FIELDS
    assert tuple(abi["call_fields"]) == py.CALL_FIELDS


def test_the_call_kinds(abi):
    py = _python()
    assert abi["kinds"] == py.KINDS
    assert max(abi["kinds"].values()) < 1 << abi["kind_bits"]


def test_the_storage_columns(abi):
    # NativeEngine.finish reads take()'s storages column by column in the recorder's order, then the pointer
    py = _python()
    assert abi["tensors"] == [n for n, _ in py.TENSOR_COLUMNS] + ["ptr", "sid"]


def test_every_argument_tag_decodes():
    py = _python()
    t = tn.abi("engine")["tags"]
    bits = struct.unpack("<q", struct.pack("<d", 2.5))[0]
    shapes = [(2, 3), (4,)]
    enc = [t["TENSOR"], 0, t["NONE"], t["BOOL"], 1, t["INT"], -7, t["DOUBLE"], bits, t["INT_LIST"], 2, 3, 4,
           t["OTHER"], t["BOOL_LIST"], 2, 1, 0, t["OUTPUTS"], t["TENSOR"], 1, t["NONE"]]
    args, outs = py.decode_args(enc, shapes)
    assert args == [(2, 3), None, True, -7, 2.5, [3, 4], None, [True, False]]
    assert outs == ((4,), None)
    # one output: the value itself; no OUTPUTS tag: no outputs
    assert py.decode_args([t["INT"], 5, t["OUTPUTS"], t["TENSOR"], 0], shapes) == ([5], (2, 3))
    assert py.decode_args([t["INT"], 5], shapes) == ([5], None)
    covered = {"TENSOR", "NONE", "BOOL", "INT", "DOUBLE", "INT_LIST", "OTHER", "BOOL_LIST", "OUTPUTS"}
    assert set(t) == covered, "a new tag in abi.h needs a case in engines._decode_args (and here)"
    assert len(set(t.values())) == len(t)


def test_the_engine_refuses_a_library_whose_abi_differs(engine):
    """The check the native engine runs before it records (a mismatch falls back to the python
    engine, saying why): the real library agrees; a changed row, flag, column or tag is named."""
    check = _python().abi_mismatch
    assert check(engine) is None
    real = engine.abi()

    class Changed:
        def __init__(self, **changes):
            self.d = {**real, **changes}

        def abi(self):
            return self.d

    assert "ops row" in check(Changed(row_size=real["row_size"] + 8))
    assert "row flags" in check(Changed(flags={**real["flags"], "F_THREW": 64}))
    assert "packed columns" in check(Changed(packed={**real["packed"], "columns": real["packed"]["columns"][::-1]}))
    assert "argument tags" in check(Changed(tags={**real["tags"], "OUTPUTS": 7}))
    assert check(object()) == "the library exports no abi()"


def _capsule_is(capsule, name: str) -> bool:
    is_valid = ctypes.pythonapi.PyCapsule_IsValid
    is_valid.restype = ctypes.c_int
    is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return bool(is_valid(capsule, name.encode()))


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="reads capsules through the CPython C API")
def test_the_capsules_carry_the_abi_names(abi, engine, hooks):
    st = abi["fmode_state"]
    assert st["abi"] == 1 and st["size"] == 40
    assert [f[0] for f in st["fields"]] == ["abi", "cur_call", "cur_module", "n_rows", "warnings_pending"]
    assert _capsule_is(engine.fmode_state, st["capsule"])
    assert _capsule_is(hooks.site_reader, abi["site_reader"])


def test_the_reader_without_a_loaded_library(monkeypatch):
    for kind in ("engine", "fmode", "hooks"):
        monkeypatch.setitem(_build._STATES, kind, _build._LibState())
    assert tn.abi() is None and tn.abi_dtype("row") is None and tn.abi_flags() is None
    with pytest.raises(ValueError):
        tn.abi_dtype("nope")
