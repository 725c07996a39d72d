"""casts: explicit, promotion, implicit downcast, autocast, copies; directions and round trips."""
from __future__ import annotations

import torch

import tensorscope
from tensorscope import schema as S
from tensorscope.analyses.casts import casts, computation_dtype, direction, promote, round_trip_pairs


def _rows(t, **where):
    return [r for r in t.casts.to_pylist() if all(r[k] == v for k, v in where.items())]


def test_schema_and_no_casts():
    with tensorscope.trace() as t:
        torch.randn(3) + torch.randn(3)
    assert t.casts.schema.equals(S.CASTS, check_metadata=False)
    assert t.casts.num_rows == 0


def test_f16_plus_f32_is_one_promotion():
    a = torch.randn(5).half()
    b = torch.randn(5)
    with tensorscope.trace() as t:
        y = a + b
    assert y.dtype == torch.float32
    rows = t.casts.to_pylist()
    assert len(rows) == 1
    r = rows[0]
    assert (r["op"], r["kind"], r["from_dtype"], r["to_dtype"], r["direction"]) == \
        ("aten.add.Tensor", "promotion", "float16", "float32", "up")
    assert r["numel"] == 5 and r["bytes"] == 5 * 4
    assert r["call"] == "add" and r["source_file"] == __file__ and r["source_line"] is not None


def test_scalars_and_masks_are_not_promotions():
    a = torch.randn(4).half()
    with tensorscope.trace() as t:
        a * 2.0
        a * torch.tensor(2.0)                 # 0-dim float32: the result stays float16
        torch.where(a > 0, a, torch.zeros((), dtype=torch.float16))
        a == torch.randn(4)                   # a comparison: bool result
    assert [r["kind"] for r in t.casts.to_pylist()] == []


def test_where_and_cat_promote():
    a = torch.randn(4).half()
    b = torch.randn(4)
    with tensorscope.trace() as t:
        torch.where(b > 0, a, b)
        torch.cat([a, b])
    rows = t.casts.to_pylist()
    assert [(r["op"], r["from_dtype"], r["to_dtype"]) for r in rows] == [
        ("aten.where.self", "float16", "float32"), ("aten.cat.default", "float16", "float32")]


def test_inplace_add_into_f16_is_an_implicit_downcast():
    a = torch.randn(6).half()
    b = torch.randn(6)
    with tensorscope.trace() as t:
        a.add_(b)
    rows = t.casts.to_pylist()
    assert [(r["kind"], r["from_dtype"], r["to_dtype"], r["direction"], r["numel"], r["bytes"]) for r in rows] == \
        [("implicit_downcast", "float32", "float16", "down", 6, 12)]
    assert a.dtype == torch.float16


def test_inplace_into_the_wider_dtype_promotes_the_other_input():
    a = torch.randn(6)
    b = torch.randn(6).half()
    with tensorscope.trace() as t:
        a.add_(b)
    assert [(r["kind"], r["from_dtype"], r["to_dtype"]) for r in t.casts.to_pylist()] == \
        [("promotion", "float16", "float32")]


def test_out_into_a_narrower_tensor_is_an_implicit_downcast():
    a = torch.randn(4)
    out = torch.empty(4, dtype=torch.float16)
    with tensorscope.trace() as t:
        torch.add(a, a, out=out)
    assert [(r["kind"], r["from_dtype"], r["to_dtype"]) for r in t.casts.to_pylist()] == \
        [("implicit_downcast", "float32", "float16")]


def test_explicit_casts_directions_and_copies():
    x = torch.randn(4)
    i = torch.tensor([70000, -5, 40000, 1])
    h = torch.zeros(4, dtype=torch.float16)
    with tensorscope.trace() as t:
        x.to(torch.bfloat16)
        x.half()
        x.double()
        x.long()
        i.to(torch.int16)
        i.float()
        x.bool()
        h.copy_(x)               # the user's copy_: kind copy, direction down
        h[:2] = x[:2]            # assignment into a narrower tensor: implicit downcast
        x.to(torch.float32)      # no-op: dispatches nothing
    got = [(r["call"], r["kind"], r["from_dtype"], r["to_dtype"], r["direction"]) for r in t.casts.to_pylist()]
    assert got == [
        ("to", "explicit", "float32", "bfloat16", "down"),
        ("half", "explicit", "float32", "float16", "down"),
        ("double", "explicit", "float32", "float64", "up"),
        ("long", "explicit", "float32", "int64", "float_to_int"),
        ("to", "explicit", "int64", "int16", "int_narrowing"),
        ("float", "explicit", "int64", "float32", "int_to_float"),
        ("bool", "explicit", "float32", "bool", "to_bool"),
        ("copy_", "copy", "float32", "float16", "down"),
        ("__setitem__", "implicit_downcast", "float32", "float16", "down"),
    ]


def test_int64_to_int16_wraps_and_is_int_narrowing():
    i = torch.tensor([70000, -5, 40000, 1])
    with tensorscope.trace() as t:
        j = i.to(torch.int16)
    assert j.tolist() == [70000 - 65536, -5, 40000 - 65536, 1]     # what the user did not see
    (r,) = t.casts.to_pylist()
    assert r["direction"] == "int_narrowing" and r["numel"] == 4 and r["bytes"] == 8
    assert r["nonfinite_produced"] is None      # integers are not screened


def test_fp16_overflow_cast_is_marked_as_producing_nonfinite():
    x = torch.tensor([1.0, 65519.0, 65520.0, 1e6])
    with tensorscope.trace() as t:
        x.half()
        x[:2].half()
    rows = t.casts.to_pylist()
    assert [r["nonfinite_produced"] for r in rows] == [True, False]


def test_cpu_autocast_linear_three_casts_first_call_then_one():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(2, 8)
    with tensorscope.trace() as t:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y1 = lin(x)
            y2 = lin(x)
    assert y1.dtype == torch.bfloat16
    ac = _rows(t, kind="autocast")
    assert all(r["call"] == "linear" and r["to_dtype"] == "bfloat16" and r["direction"] == "down" for r in ac)
    by_line = {}
    for r in ac:
        by_line.setdefault(r["source_line"], []).append(r["numel"])
    first, second = sorted(by_line)
    assert sorted(by_line[first]) == sorted([4, 4 * 8, 2 * 8])      # bias, weight, input
    assert by_line[second] == [2 * 8]                                # weight-cast cache: input only
    assert all(r["kind"] != "explicit" for r in t.casts.to_pylist())


def test_user_cast_inside_autocast_stays_explicit():
    x = torch.randn(3)
    with tensorscope.trace() as t:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x.to(torch.float16)
    assert [r["kind"] for r in t.casts.to_pylist()] == ["explicit"]


def test_autocast_backward_casts_inherit_the_kind():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with tensorscope.trace() as t:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
        y.float().sum().backward()
    bwd = [r for r in t.casts.to_pylist() if r["call"] == "backward"]
    assert bwd, t.casts.to_pylist()
    kinds = {(r["from_dtype"], r["to_dtype"]): r["kind"] for r in bwd}
    assert kinds[("bfloat16", "float32")] == "autocast"     # grads of the parameter casts
    assert kinds[("float32", "bfloat16")] == "explicit"     # grad of the user's .float()


def test_round_trip_on_the_same_data_is_detected_and_counted():
    x = torch.randn(16)
    with tensorscope.trace() as t:
        y = x.bfloat16().float()         # a round trip
        z = x.bfloat16()
        w = (z + 1).float()              # not the same data: no round trip
        x.half().float().half()          # f32->f16->f32 (pair) then ->f16 again
    rows = t.casts.to_pylist()
    flags = [(r["from_dtype"], r["to_dtype"], r["round_trip"]) for r in rows]
    assert flags[:2] == [("float32", "bfloat16", True), ("bfloat16", "float32", True)]
    assert flags[2:4] == [("float32", "bfloat16", False), ("bfloat16", "float32", False)]
    assert [f[2] for f in flags[4:]] == [True, True, True]
    assert round_trip_pairs(t.ops, t.calls) == 1 + 2


def test_inference_mode_gives_the_same_casts():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    h = torch.randn(4).half()

    def body():
        x.half().float()
        h + x[0]
        h.clone().add_(x[0])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lin(x)

    with torch.no_grad(), tensorscope.trace() as g:
        body()
    with torch.inference_mode(), tensorscope.trace() as i:
        body()
    def key(t):
        return [(r["kind"], r["from_dtype"], r["to_dtype"], r["numel"], r["call"], r["round_trip"])
                for r in t.casts.to_pylist()]

    assert key(g) == key(i)
    assert len(key(g)) == 2 + 1 + 1 + 3


def test_direction_and_promotion_helpers_match_torch():
    dts = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]
    def name(d):
        return str(d).replace("torch.", "")

    for a in dts:
        for b in dts:
            assert promote(name(a), name(b)) == name(torch.promote_types(a, b)), (a, b)
    assert direction("float16", "bfloat16") == "same_width"
    assert direction("int64", "uint64") == "same_width"
    assert direction("complex64", "float32") == "complex_to_real"
    # TensorIterator's rule: a 0-dim tensor only lifts the category
    for dims, zero in [(torch.float16, torch.float32), (torch.int32, torch.float64), (torch.int64, torch.int8),
                       (torch.bool, torch.int64), (torch.float32, torch.complex128), (torch.int16, torch.complex64)]:
        want = (torch.ones(2, dtype=dims) + torch.ones((), dtype=zero)).dtype
        assert computation_dtype([name(dims), name(zero)], [[2], []]) == name(want), (dims, zero)


def test_casts_is_pure_over_tables():
    x = torch.randn(4)
    with tensorscope.trace() as t:
        x.half().float()
    assert casts(t.ops, t.calls).equals(t.casts)
    assert casts(S.empty("ops"), S.empty("calls")).num_rows == 0


def test_precision_section_lists_casts_by_kind():
    a = torch.randn(4).half()
    with tensorscope.trace() as t:
        a + torch.randn(4)
        a.float().half()
    text = t.summary().to_text()
    assert "== precision ==" in text
    assert "cast: promotion" in text and "float16 → float32" in text and "round trip" in text
