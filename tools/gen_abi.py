"""The Python side of the native ABI, generated from ``tensorscope/native/abi.h``.

    python tools/gen_abi.py            # (re)write tensorscope/native/abi_layout.py (``make abi``)
    python tools/gen_abi.py --check    # exit 1 when the file on disk is not what abi.h gives

abi.h is the one definition of every layout and number the C++ libraries share with Python
(row structs, flags, packed columns, argument tags, storage columns, the MetaKey header, the call
kinds). This tool reads it with regular expressions (it is plain C++: structs of fixed-width
integers, enums with explicit or implicit values, ``constexpr`` tables of string literals) and writes
one module of plain Python constants that the recording engines read instead of keeping copies by
hand. No compiler is needed: tests/native/test_abi_layout.py regenerates in memory and compares.

Standard library only; nothing of tensorscope is imported.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys
from collections.abc import Sequence
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADER = ROOT / "tensorscope" / "native" / "abi.h"
OUTPUT = ROOT / "tensorscope" / "native" / "abi_layout.py"

#: C member types -> (bytes, numpy kind), as abi.h's kind_of() names them
_C_TYPES = {"int8_t": (1, "i"), "int16_t": (2, "i"), "int32_t": (4, "i"), "int64_t": (8, "i"), "int": (4, "i"),
            "uint8_t": (1, "u"), "uint16_t": (2, "u"), "uint32_t": (4, "u"), "uint64_t": (8, "u"),
            "float": (4, "f"), "double": (8, "f")}


class AbiParseError(ValueError):
    """abi.h no longer has a shape this tool reads (say which definition)."""


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _body(text: str, pattern: str, what: str) -> str:
    """What is between the braces that follow ``pattern`` (nested braces kept)."""
    m = re.search(pattern + r"\s*\{", text, flags=re.S)
    if m is None:
        raise AbiParseError(f"abi.h: no {what}")
    depth, i = 1, m.end()
    while depth and i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    if depth:
        raise AbiParseError(f"abi.h: {what} is not closed")
    return text[m.end():i - 1]


def struct_fields(text: str, name: str) -> tuple[list[tuple[str, int, int, str]], int]:
    """``struct name { ... };``'s members as abi()'s (name, offset, size, kind), and its size
    (natural alignment, as the static_asserts beside it pin)."""
    body = _body(text, rf"struct\s+{name}", f"struct {name}")
    fields: list[tuple[str, int, int, str]] = []
    at = 0
    align = 1
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        m = re.fullmatch(r"(\w+)\s+(.+)", decl)
        if m is None or m.group(1) not in _C_TYPES:
            raise AbiParseError(f"abi.h: struct {name}: cannot read member declaration {decl!r}")
        size, kind = _C_TYPES[m.group(1)]
        for member in (x.strip() for x in m.group(2).split(",")):
            if not re.fullmatch(r"\w+", member):
                raise AbiParseError(f"abi.h: struct {name}: cannot read member {member!r}")
            at = (at + size - 1) // size * size
            fields.append((member, at, size, kind))
            at += size
            align = max(align, size)
    return fields, (at + align - 1) // align * align


def enum_values(text: str, name: str) -> dict[str, int]:
    """``enum name [: type] { A = 1, B, ... }``: each enumerator's value (implicit ones count on)."""
    body = _body(text, rf"enum\s+{name}(?:\s*:\s*\w+)?", f"enum {name}")
    out: dict[str, int] = {}
    nxt = 0
    for item in (x.strip() for x in body.split(",")):
        if not item:
            continue
        m = re.fullmatch(r"(\w+)(?:\s*=\s*(-?\d+))?", item)
        if m is None:
            raise AbiParseError(f"abi.h: enum {name}: cannot read {item!r}")
        value = int(m.group(2)) if m.group(2) is not None else nxt
        out[m.group(1)] = value
        nxt = value + 1
    return out


def string_table(text: str, name: str) -> tuple[str, ...]:
    """``constexpr const char* name[] = {"a", "b"};``"""
    body = _body(text, rf"{name}\[\]\s*=", f"table {name}")
    return tuple(re.findall(r'"([^"]*)"', body))


def int_constant(text: str, name: str) -> int:
    m = re.search(rf"constexpr\s+\w+\s+{name}\s*=\s*(\d+)\s*;", text)
    if m is None:
        raise AbiParseError(f"abi.h: no constant {name}")
    return int(m.group(1))


def pair_table(text: str, name: str, values: dict[str, int]) -> dict[str, int]:
    """``kX[] = {{"NAME", ENUMERATOR}, ...}`` with enumerators resolved through ``values``."""
    body = _body(text, rf"\}}\s*{name}\[\]\s*=", f"table {name}")
    out: dict[str, int] = {}
    for label, ref in re.findall(r'\{\s*"([^"]*)"\s*,\s*(\w+)\s*\}', body):
        out[label] = values[ref] if ref in values else int(ref)
    if not out:
        raise AbiParseError(f"abi.h: table {name} is empty")
    return out


def widths_table(text: str) -> dict[int, str]:
    body = _body(text, r"\}\s*kPackedWidths\[\]\s*=", "table kPackedWidths")
    return {int(w): k for w, k in re.findall(r"\{\s*(\d+)\s*,\s*'(\w)'\s*\}", body)}


def call_field_order(text: str, members: dict[str, int], fields: list[tuple[str, int, int, str]]) -> tuple[str, ...]:
    """kCallFieldOrder's CM_* enumerators as CallRow member names."""
    body = _body(text, r"kCallFieldOrder\[\]\s*=", "table kCallFieldOrder")
    names = [f[0] for f in fields]
    return tuple(names[members[ref]] for ref in re.findall(r"\bCM_\w+", body))


def generate(header_text: str) -> str:
    """The module abi.h describes, as source text (deterministic: the same header, the same text)."""
    t = _strip_comments(header_text)
    ops, ops_size = struct_fields(t, "OpsRow")
    call, call_size = struct_fields(t, "CallRow")
    row_flags = pair_table(t, "kRowFlags", enum_values(t, "RowFlag"))
    packed = string_table(t, "kPackedColumnNames")
    if len(packed) != len(enum_values(t, "PackedColumn")) - 1:
        raise AbiParseError("abi.h: kPackedColumnNames and enum PackedColumn disagree")
    tags = pair_table(t, "kArgTags", enum_values(t, "ArgTag"))
    tensors = string_table(t, "kTensorColumnNames")
    meta_key = string_table(t, "kMetaKeyNames")
    mk = enum_values(t, "MetaKey")
    if tuple(k.lower()[3:] for k in mk if k != "MK_HEADER") != meta_key or mk["MK_HEADER"] != len(meta_key):
        raise AbiParseError("abi.h: kMetaKeyNames and enum MetaKey disagree")
    cm = enum_values(t, "CallMember")
    call_fields = call_field_order(t, cm, call)
    kinds = pair_table(t, "kCallKinds", enum_values(t, "CallKind"))

    def fields_src(fields: list[tuple[str, int, int, str]]) -> str:
        return "(\n" + "".join(f"    {f!r},\n" for f in fields) + ")"

    lines = [
        '"""The native ABI as Python reads it: generated from tensorscope/native/abi.h by tools/gen_abi.py.',
        "",
        "Do not edit: change abi.h and run ``make abi`` (tests/native/test_abi_layout.py fails while this",
        "file is not what abi.h gives). Row fields are abi()'s (name, byte offset, byte size, numpy kind).",
        '"""',
        "",
        "#: abi.h OpsRow: the engine's ops row",
        f"OPS_ROW_FIELDS = {fields_src(ops)}",
        f"OPS_ROW_SIZE = {ops_size}",
        "#: abi.h CallRow: the function mode's calls row",
        f"CALL_ROW_FIELDS = {fields_src(call)}",
        f"CALL_ROW_SIZE = {call_size}",
        "#: abi.h kCallFieldOrder: the CallRow members field(cid, k) / column(k) index, in k order",
        f"CALL_FIELDS = {call_fields!r}",
        "#: abi.h kRowFlags (OpsRow::flags bits)",
        f"ROW_FLAGS = {row_flags!r}",
        *(f"{k} = {v}" for k, v in row_flags.items()),
        "#: abi.h kPackedColumnNames: a packed chunk's columns, in PackedColumn order",
        f"PACKED_COLUMNS = {packed!r}",
        "#: abi.h kPackedWidths: a packed column's byte width -> numpy kind ('u': minus the base, 'i': raw)",
        f"PACKED_WIDTHS = {widths_table(t)!r}",
        f"BLOCK_ROWS = {int_constant(t, 'kBlockRows')}",
        "#: abi.h kArgTags: argument-encoding tags",
        f"ARG_TAGS = {tags!r}",
        *(f"TAG_{k} = {v}" for k, v in tags.items()),
        "#: abi.h kTensorColumnNames: take()'s storage columns, in TensorColumn order",
        f"TENSOR_COLUMNS = {tensors!r}",
        "#: abi.h kMetaKeyNames: an interned meta's header values (then the sizes, then the strides)",
        f"META_KEY = {meta_key!r}",
        *(f"{k} = {v}" for k, v in mk.items()),
        f"MAX_NDIM = {int_constant(t, 'kMaxNdim')}",
        "#: abi.h kCallKinds: what the function mode's classifier returns (kind | id << KIND_BITS)",
        f"CALL_KINDS = {kinds!r}",
        f"KIND_BITS = {int_constant(t, 'kKindBits')}",
        f"FMODE_STATE_ABI = {int_constant(t, 'kFmodeStateAbi')}",
        "",
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the generated file is stale")
    a = p.parse_args(argv)
    text = generate(HEADER.read_text(encoding="utf-8"))
    current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else None
    rel = OUTPUT.relative_to(ROOT)
    if a.check:
        print(f"{rel} is current" if current == text else f"{rel} is stale: run `make abi`")
        return 0 if current == text else 1
    if current != text:
        OUTPUT.write_text(text, encoding="utf-8")
        print(f"{rel} written")
    else:
        OUTPUT.touch()   # newer than abi.h: make has nothing left to do
        print(f"{rel} already current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
