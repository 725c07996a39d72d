"""The Python side of the native ABI is generated from tensorscope/native/abi.h (tools/gen_abi.py,
``make abi``), and the c10 enum tables the native engine decodes with are torch's.

No compiler is needed: the header is parsed again here and the result compared with the file on
disk; tests/native/test_abi.py compares the same definitions with a compiled library's ``abi()``.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest
import torch

import tensorscope.native as tn
from tensorscope.native import abi_layout

ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "tools" / "gen_abi.py").is_file())


def _load_tool():
    spec = importlib.util.spec_from_file_location("tensorscope_gen_abi", ROOT / "tools" / "gen_abi.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


G = _load_tool()
HEADER = (ROOT / "tensorscope" / "native" / "abi.h").read_text(encoding="utf-8")


def test_the_generated_module_is_what_abi_h_gives():
    on_disk = (ROOT / "tensorscope" / "native" / "abi_layout.py").read_text(encoding="utf-8")
    assert G.generate(HEADER) == on_disk, "tensorscope/native/abi_layout.py is stale: run `make abi`"


def test_the_header_is_read_as_its_static_asserts_pin_it():
    assert abi_layout.OPS_ROW_SIZE == 56 and abi_layout.CALL_ROW_SIZE == 56
    offs = {n: o for n, o, _, _ in abi_layout.OPS_ROW_FIELDS}
    assert (offs["op"], offs["flags"], offs["call"], offs["seq_nr"], offs["start"], offs["dur"]) == (0, 24, 28, 32, 40, 48)
    coffs = {n: o for n, o, _, _ in abi_layout.CALL_ROW_FIELDS}
    assert (coffs["func"], coffs["pad"], coffs["first_seq"], coffs["start"], coffs["dur"]) == (0, 28, 32, 40, 48)
    assert abi_layout.META_KEY[:abi_layout.MK_HEADER] == ("ndim", "dtype", "dev_type", "dev_index", "strided")
    assert abi_layout.ARG_TAGS["BOOL_LIST"] == 8 and abi_layout.TAG_OUTPUTS == 9   # the gap at 7 is kept
    assert max(abi_layout.CALL_KINDS.values()) < 1 << abi_layout.KIND_BITS


def test_the_python_side_reads_the_generated_definitions():
    from tensorscope.recording import function, recorder
    from tensorscope.recording.engines import native as engines

    assert engines.ROW_DTYPE == tn.fields_dtype(abi_layout.OPS_ROW_FIELDS, abi_layout.OPS_ROW_SIZE)
    assert engines.ROW_DTYPE.itemsize == 56 and engines.ROW_DTYPE.names == tuple(f[0] for f in abi_layout.OPS_ROW_FIELDS)
    assert function.CALL_DTYPE == tn.fields_dtype(abi_layout.CALL_ROW_FIELDS, abi_layout.CALL_ROW_SIZE)
    assert engines.PACKED_COLUMNS == abi_layout.PACKED_COLUMNS and engines.TAGS == abi_layout.ARG_TAGS
    assert engines.F_THREW == abi_layout.F_THREW and recorder.F_BACKWARD == abi_layout.F_BACKWARD
    assert recorder.CALL_FIELDS == abi_layout.CALL_FIELDS
    assert {w: np.dtype(t) for w, t in engines._PACKED_DTYPES.items()} == {
        1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.int64)}
    assert (function.DIRECT, function.RECORD, function.PASS, function.LAZY, function._C_PRINTING) == tuple(
        abi_layout.CALL_KINDS[k] for k in ("DIRECT", "RECORD", "PASS", "LAZY", "PRINTING"))


def test_a_header_change_reaches_the_generated_module():
    changed = HEADER.replace("F_OTHER_THREAD = 32,", "F_OTHER_THREAD = 32,\n  F_NEW = 64,").replace(
        '{"F_OTHER_THREAD", F_OTHER_THREAD}}', '{"F_OTHER_THREAD", F_OTHER_THREAD}, {"F_NEW", F_NEW}}')
    assert changed != HEADER
    text = G.generate(changed)
    assert "F_NEW = 64" in text and "'F_NEW': 64" in text
    wider = HEADER.replace("int32_t flags;   // RowFlag bits\n  int32_t call;", "int64_t flags;   // RowFlag bits\n  int32_t call;")
    assert wider != HEADER
    ns: dict = {}
    exec(compile(G.generate(wider), "abi_layout", "exec"), ns)
    offs = {n: (o, s) for n, o, s, _ in ns["OPS_ROW_FIELDS"]}
    assert offs["flags"] == (24, 8) and offs["call"] == (32, 4) and offs["seq_nr"][0] == 40   # natural alignment
    assert ns["OPS_ROW_SIZE"] == 64


def test_a_header_the_tool_cannot_read_is_an_error_naming_the_definition():
    with pytest.raises(G.AbiParseError, match="struct OpsRow"):
        G.generate(HEADER.replace("int32_t call;", "std::vector<int> call;"))
    with pytest.raises(G.AbiParseError, match="MetaKey"):
        G.generate(HEADER.replace('"dev_index", "strided"', '"dev_index", "strides"'))


# -- the c10 enum tables (c10/core/ScalarType.h, DeviceType.h), which abi.h does not hold ----------

def _scalar_type(dtype: torch.dtype) -> int:
    """c10's ScalarType number of ``dtype``, from torch itself (a JIT constant stores it as one)."""
    graph = torch._C.Graph()   # kept alive while its node is read
    node = graph.insertConstant(dtype).node()
    assert node.kindOf("value") == "i", node
    return int(node.i("value"))


def test_the_scalar_type_table_is_torchs():
    from tensorscope.recording.engines.native import _SCALAR_TYPES

    checked = 0
    for index, name in enumerate(_SCALAR_TYPES):
        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype):
            continue   # a type this torch does not expose as a dtype (the table may run ahead)
        assert _scalar_type(dt) == index, f"{name}: c10 ScalarType {_scalar_type(dt)}, the table says {index}"
        checked += 1
    assert checked >= 30
    for dt in (torch.float32, torch.bfloat16, torch.bool, torch.int64, torch.complex64, torch.float8_e4m3fn):
        assert _SCALAR_TYPES[_scalar_type(dt)] == str(dt).removeprefix("torch.")


def _device_type_enum() -> dict[int, str]:
    inc = pathlib.Path(torch.__file__).parent / "include"
    for rel in ("torch/headeronly/core/DeviceType.h", "c10/core/DeviceType.h"):
        p = inc / rel
        if p.is_file() and "enum class DeviceType" in p.read_text(encoding="utf-8"):
            import re

            body = p.read_text(encoding="utf-8").split("enum class DeviceType", 1)[1].split("};", 1)[0]
            return {int(v): n for n, v in re.findall(r"^\s*(\w+)\s*=\s*(\d+)", body, flags=re.M)
                    if n != "COMPILE_TIME_MAX_DEVICE_TYPES"}
    pytest.skip("this torch ships no c10 DeviceType header")


def test_the_device_type_table_is_torchs():
    from tensorscope.recording.engines.native import _DEVICE_TYPES

    enum = _device_type_enum()
    lower = {i: ("privateuseone" if n == "PrivateUse1" else n.lower()) for i, n in enum.items()}
    assert {i: n for i, n in enumerate(_DEVICE_TYPES)} == lower
    for name in ("cpu", "cuda", "meta", "mps", "xpu", "privateuseone"):
        assert torch.device(name).type == name
