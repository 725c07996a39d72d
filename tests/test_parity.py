"""Results unchanged on real-model-shaped workloads, and the facts recorded about them right.

Each workload builds its model from a seed and runs a training step (or an inference_mode
forward); the untraced run is the reference. Traced runs must give bitwise the same outputs,
gradients, buffers (BatchNorm running stats) and RNG state. Parametrised over engines: the
python dispatch-mode engine always, the native one where ``TraceOptions`` has an ``engine``.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorscope
from tensorscope.options import TraceOptions

_HAS_ENGINE = "engine" in {f.name for f in dataclasses.fields(TraceOptions)}
ENGINES = ["python"] + (["native"] if _HAS_ENGINE else [])


def _trace(engine, **kw):
    if _HAS_ENGINE:
        kw["engine"] = engine
    return tensorscope.trace(**kw)


# -- workloads -------------------------------------------------------------------------------

class SiLUMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 8)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        x = self.drop(F.silu(self.fc1(x)))
        x = F.silu(self.fc2(x))
        return self.fc3(x)


class Block(nn.Module):
    """Pre-norm transformer block: causal mask by ``torch.where(mask, s, -inf)``, softmax, dropout."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        s = q @ k.transpose(-2, -1) / math.sqrt(d // h)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        s = torch.where(mask, s, -math.inf)
        a = self.drop(s.softmax(-1)) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        x = F.silu(self.b2(self.c2(x)))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _make(name):
    torch.manual_seed(0)
    if name == "silu_mlp":
        return SiLUMLP(), torch.randn(16, 32)
    if name == "transformer_block":
        return Block(), torch.randn(2, 6, 32)
    net = ConvNet().to(memory_format=torch.channels_last)
    return net, torch.randn(4, 3, 12, 12).to(memory_format=torch.channels_last)


WORKLOADS = ["silu_mlp", "transformer_block", "channels_last_convnet"]


def _train_step(name):
    """Every tensor a training step produces that a user could look at, plus the RNG state."""
    model, x = _make(name)
    x.requires_grad_(True)
    torch.manual_seed(1)
    out = model(x)
    loss = out.float().pow(2).mean()
    loss.backward()
    res = {"out": out.detach(), "loss": loss.detach(), "x.grad": x.grad}
    for n, p in model.named_parameters():
        res[f"{n}.grad"] = p.grad
    for n, b in model.named_buffers():
        res[n] = b
    res["rng"] = torch.get_rng_state()
    return res


def _inference(name):
    model, x = _make(name)
    model.eval()
    torch.manual_seed(1)
    with torch.inference_mode():
        out = model(x)
    return {"out": out.clone(), "rng": torch.get_rng_state()}


def _assert_bitwise(ref, got):
    assert ref.keys() == got.keys()
    for k in ref:
        a, b = ref[k], got[k]
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), k
        assert torch.equal(a, b), f"{k} differs: max abs diff {(a.double() - b.double()).abs().max().item()}"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", WORKLOADS)
def test_training_step_bitwise_unchanged(name, engine):
    ref = _train_step(name)
    with _trace(engine) as t:
        got = _train_step(name)
    _assert_bitwise(ref, got)
    assert t.ops.num_rows > 0
    assert "backward" in t.ops.column("phase").to_pylist()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", WORKLOADS)
def test_inference_mode_bitwise_unchanged(name, engine):
    ref = _inference(name)
    with _trace(engine) as t:
        got = _inference(name)
    _assert_bitwise(ref, got)
    assert t.ops.num_rows > 0


@pytest.mark.parametrize("engine", ENGINES)
def test_silu_backward_runs_its_cpu_kernel(engine):
    # aten::silu_backward has a CPU kernel and a CompositeImplicitAutograd definition: eager runs
    # the CPU kernel, and so must a traced run (the composite's sigmoid arithmetic differs in bits)
    name = "aten::silu_backward"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
    torch.manual_seed(0)
    x = torch.randn(256, 256, requires_grad=True)
    g = torch.randn(256, 256)
    F.silu(x).backward(g)
    ref = x.grad
    x.grad = None
    with _trace(engine) as t:
        F.silu(x).backward(g)
    assert torch.equal(ref, x.grad)
    bwd = [r["op"] for r in t.ops.select(["op", "phase"]).to_pylist() if r["phase"] == "backward"]
    assert "aten.silu_backward.default" in bwd
    assert not any(op.startswith("aten.sigmoid") for op in bwd), bwd


@pytest.mark.parametrize("engine", ENGINES)
def test_inference_mode_composites_decompose_like_eager(engine):
    # under inference_mode composites reach a dispatch mode whole: the ones without a CPU kernel
    # (linear, reshape) are decomposed as eager decomposes them; silu_backward runs whole
    torch.manual_seed(0)
    x, w, g = torch.randn(4, 8), torch.randn(3, 8), torch.randn(4, 8)
    with torch.inference_mode():
        ref = (F.linear(x, w), torch.ops.aten.silu_backward(g, x), x.t().reshape(-1))
    with torch.inference_mode(), _trace(engine) as t:
        got = (F.linear(x, w), torch.ops.aten.silu_backward(g, x), x.t().reshape(-1))
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    ops = t.ops.column("op").to_pylist()
    assert "aten.linear.default" not in ops and "aten.mm.default" in ops
    assert "aten.silu_backward.default" in ops
    assert "aten.reshape.default" not in ops and "aten.clone.default" in ops


def test_decomposition_follows_the_backend_registration():
    from tensorscope.recording.engines.python.dispatch import _eager_decomposes

    aten = torch.ops.aten
    assert not _eager_decomposes(aten.silu_backward.default, "cpu")
    assert not _eager_decomposes(aten.mish_backward.default, "cpu")
    assert _eager_decomposes(aten.linear.default, "cpu")
    assert _eager_decomposes(aten.reshape.default, "cpu")


# -- backward -> forward links -----------------------------------------------------------------

def _rows(t, *cols):
    return t.ops.select(list(cols)).to_pylist()


@pytest.mark.parametrize("engine", ENGINES)
def test_backward_links_to_the_op_that_created_its_node(engine):
    model, x = _make("silu_mlp")
    with _trace(engine) as t:
        loss = model(x).pow(2).mean()
        unrelated = torch.zeros(2) + 1      # creates no autograd node: must claim no sequence number
        loss.backward()
    rows = _rows(t, "seq", "op", "phase", "autograd_node", "seq_nr", "fwd_seq", "source_line")
    by_seq = {r["seq"]: r for r in rows}
    fwd = [r for r in rows if r["phase"] == "forward"]
    bwd = [r for r in rows if r["phase"] == "backward"]
    assert unrelated.tolist() == [1.0, 1.0]
    zeros_add = [r for r in fwd if r["op"] == "aten.add.Tensor"][-1]
    assert zeros_add["seq_nr"] is None
    claimed = [r["seq_nr"] for r in fwd if r["seq_nr"] is not None]
    assert len(claimed) == len(set(claimed)), "two forward ops claim one autograd node"
    linked = [r for r in bwd if r["fwd_seq"] is not None]
    assert linked, "no backward op linked to its forward op"
    for r in bwd:
        if r["autograd_node"] in ("torch::autograd::AccumulateGrad",):
            assert r["fwd_seq"] is None
        if r["fwd_seq"] is not None:
            f = by_seq[r["fwd_seq"]]
            assert f["phase"] == "forward" and f["seq_nr"] == r["seq_nr"]
            assert f["seq"] != zeros_add["seq"]
    # SiLU's backward links to the silu forward op
    silu_b = [r for r in bwd if r["op"] == "aten.silu_backward.default"]
    assert silu_b and all(by_seq[r["fwd_seq"]]["op"] == "aten.silu.default" for r in silu_b)


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


@pytest.mark.parametrize("engine", ENGINES)
def test_custom_function_backward_links_into_its_forward(engine):
    # Function.apply makes the node, then runs forward without grad: its first op is the link
    x = torch.randn(3, requires_grad=True)
    with _trace(engine) as t:
        y = _Square.apply(x)
        torch.zeros(2) + 1
        y.exp().sum().backward()
    assert torch.equal(x.grad, 2 * x.detach() * y.detach().exp())
    rows = _rows(t, "seq", "op", "phase", "autograd_node", "fwd_seq")
    sq = [r for r in rows if r["autograd_node"] == "_SquareBackward"]
    assert sq and {r["fwd_seq"] for r in sq} == {0} and rows[0]["op"] == "aten.mul.Tensor"


@pytest.mark.parametrize("engine", ENGINES)
def test_backward_of_a_graph_built_before_the_trace_links_to_nothing(engine):
    # the notebook pattern: loss built in one cell (traced or not), loss.backward() traced in the next
    import inspect

    model, x = _make("silu_mlp")
    with _trace(engine) as t1:
        loss = model(x).pow(2).mean()
    with _trace(engine) as t2:
        z = torch.zeros(2) + 1
        zline = inspect.currentframe().f_lineno - 1
        loss.backward()
        bline = inspect.currentframe().f_lineno - 1
    assert z.sum().item() == 2
    assert any(r["seq_nr"] is not None for r in _rows(t1, "seq_nr"))
    rows = _rows(t2, "op", "phase", "seq_nr", "fwd_seq", "source_line", "module")
    fwd = [r for r in rows if r["phase"] == "forward"]
    bwd = [r for r in rows if r["phase"] == "backward"]
    assert fwd and bwd
    assert all(r["seq_nr"] is None for r in fwd), fwd
    assert all(r["fwd_seq"] is None for r in bwd), [r for r in bwd if r["fwd_seq"] is not None]
    lines = {r["source_line"] for r in bwd}
    assert zline not in lines and lines == {bline}, (lines, zline, bline)


# -- format labels -----------------------------------------------------------------------------

def _brute_kind(shape, stride):
    """The label from every touched offset, enumerated."""
    import itertools

    if any(s == 0 for s in shape):
        return "dense"
    offs = [sum(i * st for i, st in zip(idx, stride)) for idx in itertools.product(*(range(s) for s in shape))]
    n = len(offs)
    distinct = set(offs)
    if len(distinct) < n:
        return "expanded" if any(st == 0 and sz > 1 for sz, st in zip(shape, stride)) else "overlapping"
    return "dense" if distinct == set(range(min(offs), min(offs) + n)) else "gapped"


LAYOUTS = [
    ((2, 2), (3, 2)),        # offsets {0, 2, 3, 5}: gapped (was labelled overlapping)
    ((3, 2), (2, 3)),        # {0, 2, 3, 4, 5, 7}: gapped though the strides interleave
    ((2, 3), (3, 2)),        # {0, 2, 4, 3, 5, 7}
    ((3, 3), (2, 3)),        # 0*2 + 2*3 == 3*2 + 0*3: overlapping
    ((4, 3), (1, 1)),        # overlapping
    ((4, 3), (6, 1)),        # gapped rows
    ((4, 3), (0, 1)),        # expanded
    ((4, 3), (3, 1)),        # contiguous
    ((3, 4), (1, 3)),        # transposed: dense
    ((8, 3), (1, 1)),        # unfold(0, 3, 1): overlapping windows
    ((5, 4), (4, 5)),        # i*4 == j*5 first at i = 5, past the size: gapped
    ((2, 2, 2), (4, 3, 1)),
    ((2, 3, 5), (15, 5, 2)),
    ((7, 5), (5, 7)),
    ((6, 4), (4, 6)),
    ((3, 3, 3), (9, 4, 1)),
    ((2, 2), (2, 2)),
    ((3,), (2,)),            # 1-d with a step: gapped
    ((1, 5), (100, 2)),      # size-1 dims never matter
    ((0, 3), (3, 1)),
]


@pytest.mark.parametrize("shape,stride", LAYOUTS)
def test_non_dense_kind_matches_enumeration(shape, stride):
    from tensorscope._tensormeta import non_dense_kind

    assert non_dense_kind(shape, stride) == _brute_kind(shape, stride)


def test_non_dense_kind_random_layouts_match_enumeration():
    import random

    from tensorscope._tensormeta import non_dense_kind

    rnd = random.Random(0)
    kinds = set()
    for _ in range(3000):
        nd = rnd.randint(1, 4)
        shape = tuple(rnd.randint(1, 5) for _ in range(nd))
        stride = tuple(rnd.randint(0, 12) for _ in range(nd))
        want = _brute_kind(shape, stride)
        assert non_dense_kind(shape, stride) == want, (shape, stride)
        kinds.add(want)
    assert kinds == {"dense", "expanded", "gapped", "overlapping"}


def test_memory_format_labels_non_dense_tensors_exactly():
    from tensorscope._tensormeta import memory_format, non_dense_kind

    assert memory_format((2, 2), (3, 2)) == ("gapped", False)
    assert memory_format((4, 3), (1, 1)) == ("overlapping", False)
    assert memory_format((4, 3), (0, 1)) == ("expanded", False)
    assert memory_format((3, 4), (1, 3)) == ("strided", False)
    # past the exact budget an undecidable layout stays honest rather than guessed
    assert non_dense_kind((1 << 20, 3, 2), (3, 1 << 20, 5 << 20)) == "non_dense"
    assert non_dense_kind((1 << 20, 4, 2), (1, 2, 1 << 30)) == "overlapping"   # pigeonhole settles it
    assert non_dense_kind((1 << 20, 3), (3, 1 << 20)) == "gapped"              # two dims: closed form
    assert non_dense_kind((1 << 20, 3), (3, 1 << 19)) == "gapped"
    assert non_dense_kind((1 << 20, 3), (3, 6)) == "overlapping"


@pytest.mark.parametrize("engine", ENGINES)
def test_recorded_formats_of_gapped_and_overlapping_views(engine):
    base = torch.arange(16.0)
    with _trace(engine) as t:
        g = base.as_strided((2, 2), (3, 2)).clone()
        o = base.as_strided((4, 3), (1, 1)).clone()
        e = base[:3].expand(4, 3).clone()
    assert g.tolist() == [[0.0, 2.0], [3.0, 5.0]] and o.shape == e.shape == (4, 3)
    clones = [r for r in _rows(t, "op", "in_formats", "in_strides") if r["op"] == "aten.clone.default"]
    assert [r["in_formats"] for r in clones] == [["gapped"], ["overlapping"], ["expanded"]]


# -- dictionary-encoded string columns (schema 1.2) ----------------------------------------------

def _small_trace():
    model, x = _make("channels_last_convnet")
    # many batches sharing one dictionary: the python engine freezes a chunk every chunk_rows rows
    # (the native engine keeps its rows in one native buffer and builds one batch)
    with tensorscope.trace(leaks=False, chunk_rows=16, engine="python") as t:
        model(x).sum().backward()
    return t


def _dict_fields(schema):
    import pyarrow as pa

    out = []
    for f in schema:
        typ = f.type.value_type if pa.types.is_list(f.type) else f.type
        if pa.types.is_dictionary(typ):
            out.append(f.name)
    return out


def test_string_columns_are_dictionary_encoded():
    from tensorscope import schema as S

    assert S.parse_version(S.SCHEMA_VERSION) >= (1, 2)
    t = _small_trace()
    for name in ("ops", "calls", "tensors"):
        table = t.table(name)
        assert table.schema.equals(S.TABLES[name], check_metadata=False), name
        assert table.num_rows > 0
    assert {"op", "namespace", "overload", "phase", "autograd_node", "module", "source_file", "tags",
            "in_dtypes", "in_formats", "out_devices"} <= set(_dict_fields(t.ops.schema))
    assert {"name", "qualname", "source_file"} <= set(_dict_fields(t.calls.schema))
    assert {"dtype", "device", "alloc_op"} <= set(_dict_fields(t.tensors.schema))
    assert t.ops.column("op").num_chunks > 1
    ops = t.ops.to_pylist()
    assert {r["phase"] for r in ops} == {"forward", "backward"}
    conv = next(r for r in ops if r["op"] == "aten.convolution.default")
    assert conv["in_formats"][0] == "channels_last" and conv["in_dtypes"] == ["float32"] * 3
    assert conv["namespace"] == "aten" and conv["overload"] == "default" and conv["module"] == "c1"
    assert all(r["autograd_node"] is None for r in ops if r["phase"] == "forward")
    assert all(r["autograd_node"] for r in ops if r["phase"] == "backward")


def test_dictionary_columns_round_trip_and_query(tmp_path):
    import duckdb
    import pyarrow.parquet as pq

    t = _small_trace()
    path = t.save(tmp_path / "tr")
    back = tensorscope.load(path)
    for name in ("ops", "calls", "tensors"):
        assert back.table(name).schema.equals(t.table(name).schema, check_metadata=False)
        assert back.table(name).to_pylist() == t.table(name).to_pylist(), name
    # a reader that knows nothing of Arrow dictionaries sees plain strings
    raw = pq.read_table(f"{path}/ops.parquet", read_dictionary=[])
    want = t.ops.column("op").to_pylist()
    assert raw.column("op").to_pylist() == want
    q = "SELECT op, count(*) AS n FROM read_parquet('{}') GROUP BY op ORDER BY n DESC, op".format(f"{path}/ops.parquet")
    from_file = duckdb.sql(q).fetchall()
    from_trace = [tuple(r) for r in t.sql("SELECT op, count(*) AS n FROM ops GROUP BY op ORDER BY n DESC, op")
                  .itertuples(index=False)]
    assert from_file == from_trace and sum(n for _, n in from_file) == t.ops.num_rows
    hit = t.sql("SELECT count(*) AS n FROM ops WHERE list_contains(in_formats, 'channels_last') "
                "AND phase = 'backward'")
    assert int(hit["n"][0]) > 0
    df = t.df("ops")
    assert df["op"].tolist() == want
    assert str(df["op"].dtype) != "category"   # plain strings: sorting and grouping by value
    assert df.sort_values("op")["op"].tolist() == sorted(want)
    assert df["in_dtypes"].map(list).tolist() == t.ops.column("in_dtypes").to_pylist()


def test_dictionary_columns_read_by_polars(tmp_path):
    pl = pytest.importorskip("polars")
    t = _small_trace()
    path = t.save(tmp_path / "tr")
    df = pl.read_parquet(f"{path}/ops.parquet")
    counts = dict(df.group_by("op").len().iter_rows())
    want = {}
    for op in t.ops.column("op").to_pylist():
        want[op] = want.get(op, 0) + 1
    assert counts == want
    assert df.filter(pl.col("phase") == "backward").height == t.ops.column("phase").to_pylist().count("backward")


def test_trace_saved_with_schema_1_1_loads_with_dictionary_columns():
    import os

    import pyarrow.parquet as pq

    from tensorscope import schema as S

    d = os.path.join(os.path.dirname(__file__), "data", "golden-schema-1.1")
    raw = pq.read_table(os.path.join(d, "ops.parquet"))
    assert str(raw.schema.field("op").type) == "string"   # 1.1 wrote plain strings
    t = tensorscope.load(d)
    assert t.metadata["schema_version"] == "1.1"
    assert t.ops.schema.equals(S.OPS, check_metadata=False)
    assert t.ops.column("op").to_pylist() == raw.column("op").to_pylist()
    assert t.ops.column("in_dtypes").to_pylist() == raw.column("in_dtypes").to_pylist()
    assert t.calls.column("name").to_pylist() == pq.read_table(os.path.join(d, "calls.parquet")).column("name").to_pylist()
    assert t.layout_changes is not None and t.casts is not None   # analyses run on the cast columns


def test_perfetto_and_analyses_on_dictionary_columns(tmp_path):
    import json

    t = _small_trace()
    out = t.to_perfetto(tmp_path / "t.json")
    events = json.load(open(out))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e.get("name") for e in events}
    assert "aten.convolution.default" in names
    # analyses read the dictionary columns: the channels_last net's layout findings are there
    changes = t.layout_changes.select(["op", "kind", "from_format"]).to_pylist()
    assert {"op": "aten.mm.default", "kind": "non_dense_input", "from_format": "expanded"} in changes
    assert any(c["kind"] == "format_change" and c["from_format"] == "channels_last" for c in changes)
    assert t.memory.num_rows > 0 and set(t.memory.column("device").to_pylist()) == {"cpu"}
    bundle = t._repr_mimebundle_()
    assert "convolution" in bundle["text/html"] and bundle["text/plain"]


@pytest.mark.kernel
def test_notebook_forward_in_one_cell_backward_in_the_next(tmp_path):
    from tests.helpers.kernel_utils import Kernel

    k = Kernel(cwd=str(tmp_path))
    try:
        r = k.run("%load_ext tensorscope\nimport torch\ntorch.manual_seed(0)\n"
                  "m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.SiLU(), torch.nn.Linear(8, 1))\n"
                  "x = torch.randn(8, 4)")
        assert r.status == "ok", r.error
        r = k.run("%%tensorscope -o t1 --no-leaks\nloss = m(x).pow(2).mean()")
        assert r.status == "ok", r.error
        r = k.run("%%tensorscope -o t2 --no-leaks\nz = torch.zeros(2) + 1\nloss.backward()")
        assert r.status == "ok", r.error
        rows = k.value("[(r['phase'], r['seq_nr'], r['fwd_seq'], r['source_line']) for r in "
                       "t2.ops.select(['phase', 'seq_nr', 'fwd_seq', 'source_line']).to_pylist()]")
        fwd = [r for r in rows if r[0] == "forward"]
        bwd = [r for r in rows if r[0] == "backward"]
        assert fwd and bwd
        assert all(r[1] is None for r in fwd), fwd            # zeros/add created no autograd node
        assert all(r[2] is None for r in bwd), bwd            # their forward ran in the previous cell
        assert {r[3] for r in bwd} == {3}, bwd                 # the backward() line, not the zeros line
        assert k.value("any(v is not None for v in t1.ops.column('seq_nr').to_pylist())") is True
    finally:
        k.close()


def test_tables_from_several_traces_share_one_dictionary_after_conform():
    import pyarrow as pa

    from tensorscope import schema as S

    with tensorscope.trace(leaks=False) as t1:
        torch.ones(3).relu()
    with tensorscope.trace(leaks=False) as t2:
        torch.ones(3).sigmoid().relu()
    both = pa.concat_tables([t1.ops, t2.ops])
    with pytest.raises(pa.ArrowNotImplementedError):   # what conform protects every reader from
        both.group_by("op").aggregate([("seq", "count")])
    ops = S.conform("ops", both)
    got = {r["op"]: r["seq_count"] for r in ops.group_by("op").aggregate([("seq", "count")]).to_pylist()}
    assert got == {"aten.ones.default": 2, "aten.relu.default": 2, "aten.sigmoid.default": 1}
    assert S.unify_dictionaries(t1.ops) is t1.ops   # one trace's batches already share theirs
