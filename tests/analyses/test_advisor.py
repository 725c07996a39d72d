"""The advisor: workloads whose cause is known by construction, found from the rows, under both engines."""
from __future__ import annotations

import inspect
import json
import os

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

import tensorscope
from tensorscope import schema as S
from tensorscope.analyses.findings import finding_rows
from tensorscope.errors import GuardError, OptionsError
from tests.helpers.synthetic import make_trace, no_cpu_wait, table

ENGINES = ("native", "python")


def _line_of(marker: str, fn) -> int:
    src, first = inspect.getsourcelines(fn)
    for i, text in enumerate(src):
        if marker in text:
            return first + i
    raise AssertionError(marker)


def _noise(t) -> dict:
    return dict(zip(t.ops.column("seq").to_pylist(), t.ops.column("is_noise").to_pylist()))


def _warm(engine, fn, *args):
    """Run ``fn`` once under a trace first: the traced run after it is warm (no ``first_run`` rows, which
    the advisor leaves out of its timing findings, or reads as a cold cell when they dominate)."""
    with tensorscope.trace(engine=engine, leaks=False):
        fn(*args)


def _check_no_noise_subjects(t, adv) -> None:
    """No finding's subject is a bookkeeping row: rows of every finding but a scalar read's are not
    noise, and a scalar read's subject is the call, never the op."""
    noise = _noise(t)
    for f in adv.findings.to_pylist():
        if f["kind"] == "sync" and "scalar read" in f["subject"]:
            assert "_local_scalar_dense" not in f["subject"]
            continue
        if f["kind"] in ("outside_ops", "gpu_idle"):
            continue   # rows are the ops next to the gaps, not the subject
        assert not any(noise[s] for s in finding_rows(f).tolist()), f


# -- syncs ---------------------------------------------------------------------------------------

def _item_loop(steps):
    model = torch.nn.Linear(8, 1)
    x = torch.randn(4, 8)
    losses = []
    for _ in range(steps):
        loss = model(x).sum()
        loss.backward()
        losses.append(loss.item())  # SYNC-HERE
    return losses


@pytest.mark.parametrize("engine", ENGINES)
def test_item_per_step_is_found_at_its_line_with_the_right_count(engine):
    steps = 7
    _warm(engine, _item_loop, steps)
    with tensorscope.trace(engine=engine) as t:
        _item_loop(steps)
    adv = tensorscope.advise(t)
    line = _line_of("SYNC-HERE", _item_loop)
    sy = adv.syncs.filter(pc.equal(adv.syncs.column("source_line"), line))
    assert sy.num_rows == steps
    assert set(sy.column("call").to_pylist()) == {"Tensor.item"}
    assert set(sy.column("kind").to_pylist()) == {"scalar_read"}
    assert set(sy.column("device").to_pylist()) == {"cpu"}
    (f,) = [f for f in adv.findings.to_pylist() if f["kind"] == "sync" and f["source_line"] == line]
    assert f["n_rows"] == steps and f["per_step"] == 1.0          # steps: the outermost backward() calls
    assert f["subject"].startswith("Tensor.item")
    (o,) = adv.outside
    assert o["steps"] == steps and o["tiny_ops"] >= 4 * steps and "tiny ops" in str(adv)
    assert os.path.basename(__file__) in f["seen"] and f"{line}" in f["seen"]
    assert "read it once after the loop" in f["fix"]
    ops = {r["seq"]: r["op"] for r in t.ops.select(["seq", "op"]).to_pylist()}
    assert {ops[s] for s in finding_rows(f).tolist()} == {"aten._local_scalar_dense.default"}
    assert f["cost_ns"] == sum(sy.column("cpu_ns").to_pylist())
    _check_no_noise_subjects(t, adv)


@pytest.mark.parametrize("engine", ENGINES)
def test_data_dependent_shapes_and_branching_on_a_tensor_are_syncs(engine):
    x = torch.randn(64)
    mask = x > 0
    with tensorscope.trace(engine=engine) as t:
        a = torch.nonzero(x)
        b = x[mask]
        c = torch.unique(x)
        if x.sum() > 0:
            pass
        d = x[:4]                         # a slice: no sync
        e = x[torch.tensor([0, 1])]       # an integer index: no sync
    del a, b, c, d, e
    adv = t.advice()
    kinds = {(r["op"], r["kind"]) for r in adv.syncs.to_pylist()}
    assert ("aten.nonzero.default", "data_dependent_shape") in kinds
    assert ("aten.index.Tensor", "data_dependent_shape") in kinds
    assert any(op.startswith("aten._unique2") for op, _ in kinds)
    assert ("aten._local_scalar_dense.default", "scalar_read") in kinds
    calls = {r["call"] for r in adv.syncs.to_pylist()}
    assert "Tensor.__bool__" in calls
    assert sum(1 for r in adv.syncs.to_pylist() if r["op"] == "aten.index.Tensor") == 1   # not the int index
    assert not any(r["op"] == "aten.slice.Tensor" for r in adv.syncs.to_pylist())


@pytest.mark.parametrize("engine", ENGINES)
def test_no_syncs_guard_fails_on_a_sync_and_passes_without(engine):
    x = torch.randn(16)
    with pytest.raises(GuardError) as ei:
        with tensorscope.trace(engine=engine, expect="no_syncs"):
            v = x.sum().item()  # GUARD-LINE
    del v
    (msg,) = ei.value.failures
    line = _line_of("GUARD-LINE", test_no_syncs_guard_fails_on_a_sync_and_passes_without)
    assert "expect no_syncs" in msg and "Tensor.item" in msg and f"{os.path.basename(__file__)}:{line}" in msg
    with tensorscope.trace(engine=engine, expect=("no_syncs",)) as t:
        y = (x * 2).sum()
    assert t.result.ops.num_rows >= 2 and y is not None


def test_no_syncs_is_a_magic_and_cli_choice():
    import argparse

    from tensorscope.options import EXPECTATIONS, add_to_parser, parse_namespace

    assert "no_syncs" in EXPECTATIONS
    p = argparse.ArgumentParser()
    add_to_parser(p)
    opts, _ = parse_namespace(p.parse_args(["--expect", "no_syncs"]))
    assert opts.expect == ("no_syncs",)
    with pytest.raises(SystemExit):
        p.parse_args(["--expect", "no_sync"])


# -- layout --------------------------------------------------------------------------------------

def _conv_net(hostile=False):
    torch.manual_seed(0)
    net = torch.nn.Sequential()
    net.add_module("<img src=x onerror=alert(1)>" if hostile else "c1", torch.nn.Conv2d(3, 8, 3))
    net.add_module("act", torch.nn.ReLU())
    net.add_module("c2", torch.nn.Conv2d(8, 8, 3))
    return net


@pytest.mark.parametrize("engine", ENGINES)
def test_nchw_conv_net_fed_channels_last_finds_the_copies_and_recommends_channels_last(engine):
    net = _conv_net()
    x = torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)
    _warm(engine, lambda: _conv_net()(x).sum().backward())   # a fresh net: this one's grads stay unset
    with tensorscope.trace(engine=engine) as t:
        net(x).sum().backward()
    adv = tensorscope.advise(t)
    (f,) = [f for f in adv.findings.to_pylist() if f["subject"] == "mixed memory formats around convolutions"]
    assert "model.to(memory_format=torch.channels_last)" in f["fix"]
    rows = {r["seq"]: r for r in t.ops.select(["seq", "op", "in_formats", "out_formats", "cpu_ns"]).to_pylist()}
    ops = [rows[s]["op"] for s in finding_rows(f).tolist()]
    # the two forward convolutions (channels_last input, contiguous weight) and the weight-gradient copies
    assert ops.count("aten.convolution.default") == 2
    copies = [rows[s] for s in finding_rows(f).tolist() if rows[s]["op"] == "aten.copy_.default"]
    assert len(copies) == 2 and all(c["in_formats"][1] == "channels_last" and c["out_formats"] == ["contiguous"]
                                    for c in copies)
    assert f["cost_ns"] == sum(c["cpu_ns"] for c in copies)
    _check_no_noise_subjects(t, adv)
    # fixed: model converted too -> no such finding
    net2 = _conv_net().to(memory_format=torch.channels_last)
    with tensorscope.trace(engine=engine) as t2:
        net2(x).sum().backward()
    assert not [f for f in t2.advice().findings.to_pylist() if f["kind"] == "layout" and "convolutions" in f["subject"]]


def test_a_hostile_module_name_is_escaped_in_the_advice_section():
    net = _conv_net(hostile=True)
    x = torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)
    with tensorscope.trace() as t:
        for _ in range(3):
            y = net(x)
            y.sum().item()
    adv = t.advice()
    assert any("onerror" in (f["seen"] or "") for f in adv.findings.to_pylist()), adv.findings.to_pylist()
    html = t.summary().to_html()
    assert "why is it slow: the advisor" in html
    assert "<img src=x" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    import re

    from tensorscope.render.summary import summarize

    full = summarize(t, full=True).to_html()   # the report draws the charts inline (the summary: SVG images)
    (roof,) = [s for s in re.findall(r"<svg.*?</svg>", full, re.S) if "roofline" in s]
    dots = set(re.findall(r'<circle [^>]*fill="(#[0-9a-f]{6})" fill-opacity', roof))
    legend = set(re.findall(r'<circle [^>]*r="4" fill="(#[0-9a-f]{6})"/>', roof))
    assert dots and dots <= legend                      # every colour drawn has a legend entry
    assert "aten.convolution.default (float32" in roof   # a hover title per op group


# -- overhead, compute -----------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
def test_thousands_of_tiny_ops_are_overhead_bound(engine):
    x = torch.ones(4)
    _warm(engine, lambda: x * 1.0001 + 0.0001)
    with tensorscope.trace(engine=engine) as t:
        for _ in range(600):
            x = x * 1.0001 + 0.0001
    adv = t.advice()
    (f,) = [f for f in adv.findings.to_pylist() if f["kind"] == "overhead"]
    assert f["n_rows"] >= 1200 and "torch.compile" in f["fix"]
    noise = _noise(t)
    first = dict(zip(t.ops.column("seq").to_pylist(), t.ops.column("first_run").to_pylist()))
    # every op here is tiny; the first mul and add of the process are one-time initialisation, left out
    assert f["n_rows"] == sum(1 for s, n in noise.items() if not n and not first[s])
    roof = {r["name"]: r for r in adv.roofline.to_pylist() if r["level"] == "op"}
    assert roof["aten.mul.Tensor"]["bound"] == "overhead" and roof["aten.add.Tensor"]["bound"] == "overhead"
    _check_no_noise_subjects(t, adv)


@pytest.mark.parametrize("engine", ENGINES)
def test_gemm_heavy_mlp_is_compute_bound_and_the_roofline_matches_the_rows(engine):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    x = torch.randn(512, 512)
    with torch.no_grad():
        _warm(engine, mlp, x)
    with torch.no_grad(), tensorscope.trace(engine=engine) as t:
        for _ in range(3):
            mlp(x)
    peaks = tensorscope._peaks.machine_peaks()
    adv = tensorscope.advise(no_cpu_wait(t), peaks={"cpu": peaks})
    ops = t.ops.filter(pc.equal(t.ops.column("op").cast(pa.string()), "aten.addmm.default"))
    fl = sum(ops.column("flops").to_pylist())
    ns = sum(ops.column("cpu_ns").to_pylist())
    nb = sum(ops.column("bytes_read").to_pylist()) + sum(ops.column("bytes_written").to_pylist())
    assert fl == 9 * 2 * 512 ** 3
    (r,) = [r for r in adv.roofline.to_pylist() if r["level"] == "op" and r["name"] == "aten.addmm.default"]
    assert r["n_ops"] == 9 and r["flops"] == fl and r["bytes"] == nb and r["time_ns"] == ns
    assert r["flops_per_s"] == pytest.approx(fl / (ns / 1e9))
    assert r["intensity"] == pytest.approx(fl / nb)
    pf, bw = peaks["flops"]["float32"], peaks["bytes_per_s"]
    ideal = max(fl / pf, nb / bw) * 1e9
    assert r["ideal_ns"] == round(ideal) and r["roof_fraction"] == pytest.approx(min(ideal / ns, 1.0))
    assert r["roof_flops_per_s"] == pytest.approx(min(pf, fl / nb * bw))
    # compute-bound only at a stated share of the roof (a 0.3 GFLOP/s "compute-bound" contradicted its numbers):
    # near the peak on an idle machine, below the roof beside a competing load; never above the roof
    from tensorscope.analyses.roofline import ROOF_SHARE

    assert r["bound"] == ("compute" if ideal / ns >= ROOF_SHARE else "below_roof"), r
    assert 0.001 < r["roof_fraction"] <= 1, r
    kind = "compute_bound" if r["bound"] == "compute" else "below_roof"
    (f,) = [f for f in adv.findings.to_pylist() if f["kind"] == kind]
    assert f["subject"] == "aten.addmm.default" and f["n_rows"] == 9
    mod = {r["name"]: r for r in adv.roofline.to_pylist() if r["level"] == "module"}
    assert set(mod) == {"0", "1", "2"} and all(m["bound"] in ("compute", "below_roof") for m in mod.values())
    assert sum(m["flops"] for m in mod.values()) == fl


def test_a_saved_trace_is_advised_alike_and_flops_off_gives_no_bound(tmp_path):
    tensorscope._peaks.machine_peaks()          # measured (or cached) before the trace: its device report holds them
    mlp = torch.nn.Linear(256, 256)
    x = torch.randn(256, 256)
    with torch.no_grad():
        _warm("auto", lambda: mlp(x).sum().item())
    with torch.no_grad(), tensorscope.trace() as t:
        for _ in range(3):
            mlp(x).sum().item()
    a = tensorscope.advise(t)
    b = tensorscope.advise(tensorscope.load(t.save(tmp_path / "t")))
    assert b.peaks_source.startswith("recorded")         # the saved trace carries the peaks it was advised with
    assert b.peaks["cpu"]["flops"] == a.peaks["cpu"]["flops"]
    assert a.syncs.column("seq").to_pylist() == b.syncs.column("seq").to_pylist()
    assert a.roofline.column("flops_per_s").to_pylist() == b.roofline.column("flops_per_s").to_pylist()
    with torch.no_grad(), tensorscope.trace(flops=False) as t2:
        mlp(x)
    c = t2.advice()
    assert c.roofline.num_rows and set(c.roofline.column("bound").to_pylist()) == {None}
    assert any("flops=False" in n for n in c.notes)


# -- peaks -----------------------------------------------------------------------------------------

def test_peaks_are_measured_once_cached_beside_the_native_cache_and_hidden(tmp_path, monkeypatch):
    from tensorscope import _peaks
    from tensorscope.native import cache_dir

    with tensorscope.trace():          # the native engine loaded from the real cache first (not built into tmp_path)
        torch.ones(1).add(1)
    monkeypatch.setenv("TENSORSCOPE_CACHE", str(tmp_path))
    monkeypatch.setattr(_peaks, "_MEMO", {})
    assert _peaks.machine_peaks(measure=False) is None                 # nothing cached there yet
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    rng = torch.random.get_rng_state()
    x = torch.ones(3)
    with tensorscope.trace() as t:
        with Spy():
            p = _peaks.machine_peaks()
        y = x + 1
    assert torch.equal(torch.random.get_rng_state(), rng)              # no random number drawn
    assert seen == []                                                   # the user's mode saw nothing
    assert [r for r in t.ops.column("op").to_pylist()] == ["aten.add.Tensor"]   # the trace recorded the cell only
    assert y.tolist() == [2.0, 2.0, 2.0]
    assert p["flops"]["float32"] > 0 and p["bytes_per_s"] > 0 and p["overhead_ns"] > 0
    assert p["threads"] == torch.get_num_threads() and p["torch"] == torch.__version__
    path = p["cache_file"]
    assert os.path.dirname(path) == cache_dir() == str(tmp_path) and os.path.exists(path)
    with open(path) as fh:
        on_disk = json.load(fh)
    assert on_disk["flops"] == p["flops"] and on_disk["device"] == "cpu"
    monkeypatch.setattr(_peaks, "_MEMO", {})
    again = _peaks.machine_peaks(measure=False)                          # read back, not measured
    assert again is not None and again["measured_at"] == p["measured_at"] and again["flops"] == p["flops"]
    rep = tensorscope.env()
    assert rep.peaks["cpu"]["flops"] == p["flops"] and "peaks cpu" in str(rep)
    with pytest.raises(OptionsError):
        _peaks.machine_peaks("tpu")


def test_peaks_are_invisible_to_the_profiler_or_not_measured(tmp_path, monkeypatch):
    from tensorscope import _peaks
    from tensorscope.native import loaded_engine

    with tensorscope.trace():          # the native engine loaded from the real cache first (not built into tmp_path)
        torch.ones(1).add(1)
    monkeypatch.setenv("TENSORSCOPE_CACHE", str(tmp_path))
    monkeypatch.setattr(_peaks, "_MEMO", {})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        p = _peaks.machine_peaks(refresh=True)
        torch.ones(2).add_(1)
    names = [e.name for e in prof.events()]
    if p is not None:      # measured again: each figure is the best of the two runs
        q = _peaks.machine_peaks(refresh=True)
        assert all(q["flops"][k] >= v for k, v in p["flops"].items()) and q["bytes_per_s"] >= p["bytes_per_s"]
    assert "aten::mm" not in names and "aten::add_" in names
    ext = loaded_engine()
    if ext is not None and hasattr(ext, "unobserved"):
        assert p is not None and p["flops"]["float32"] > 0
    else:
        assert p is None    # no way to hide it from the profiler: measured another time


# -- schedule --------------------------------------------------------------------------------------

def _steps_in(trace) -> list:
    """The steps a window recorded: each step makes a tensor of its own length."""
    return sorted({r[0][0] - 1 for r in trace.ops.column("out_shapes").to_pylist() if r and r[0]})


@pytest.mark.parametrize("engine", ENGINES)
def test_schedule_traces_exactly_the_windows_asked(engine, tmp_path):
    with tensorscope.schedule(wait=1, warmup=1, active=2, repeat=2, engine=engine,
                              dataset=str(tmp_path / "ds")) as s:
        for step in range(12):
            torch.ones(step + 1).sum().item()
            s.step()
    assert s.windows == [[2, 3], [6, 7]] and s.steps == [2, 2]
    assert len(s.traces) == 2
    assert [_steps_in(t) for t in s.traces] == [[2, 3], [6, 7]]
    assert [s.action(i) for i in range(9)] == ["wait", "warmup", "active", "active", "wait", "warmup", "active",
                                               "active", "done"]
    ds = tensorscope.open_dataset(str(tmp_path / "ds"))
    assert ds.sql("select count(distinct trace_id) as n from ops")["n"][0] == 2
    adv = s.advice()                                                    # every window read
    assert adv.n_windows == 2 and adv.steps == 4
    assert sorted(set(adv.syncs.column("window").to_pylist())) == [0, 1]
    (f,) = [f for f in adv.findings.to_pylist() if f["kind"] == "sync"]
    assert f["n_rows"] == 4 and f["per_step"] == 1.0 and "(window/seq)" in f["evidence"]


def test_schedule_repeat_zero_runs_to_the_end_and_an_error_closes_the_window():
    with tensorscope.schedule(wait=0, active=3) as s:
        for step in range(7):
            torch.ones(step + 1).sum()
            s.step()
    assert s.windows == [[0, 1, 2], [3, 4, 5], [6]]
    assert [_steps_in(t) for t in s.traces] == [[0, 1, 2], [3, 4, 5], [6]]
    with tensorscope.schedule(active=3) as s1:      # the loop ends on a window boundary: no empty window
        for step in range(6):
            torch.ones(step + 1).sum()
            s1.step()
    assert s1.windows == [[0, 1, 2], [3, 4, 5]] and len(s1.traces) == 2
    with pytest.raises(ValueError, match="boom"):
        with tensorscope.schedule(wait=1, active=2) as s2:
            for step in range(5):
                torch.ones(step + 1).sum()
                if step == 2:
                    raise ValueError("boom")
                s2.step()
    assert s2.windows == [[1, 2]] and len(s2.traces) == 1 and _steps_in(s2.traces[0]) == [1, 2]
    from tests.helpers.state import GlobalState  # noqa: F401  (the autouse fixture checks the modes were restored)
    with pytest.raises(OptionsError):
        tensorscope.schedule(active=0)
    with pytest.raises(OptionsError):
        tensorscope.schedule(active=1, bogus=True)


# -- kernels (hand-built rows: a CPU run has no kernels), CUDA for real ------------------------------

def test_gpu_idle_time_is_split_into_host_wait_and_launch_gaps():
    ops = table("ops", [
        {"seq": 0, "op": "aten.mm.default", "start_ns": 0, "cpu_ns": 10, "is_noise": False},
        {"seq": 1, "op": "aten.mm.default", "start_ns": 150, "cpu_ns": 10, "is_noise": False},
        {"seq": 2, "op": "aten.mm.default", "start_ns": 170, "cpu_ns": 10, "is_noise": False},
    ])
    kernels = table("kernels", [
        {"seq": 0, "name": "k0", "device": 0, "stream": 7, "start_ns": 20, "dur_ns": 80},     # ends 100
        {"seq": 1, "name": "k1", "device": 0, "stream": 7, "start_ns": 160, "dur_ns": 20},    # idle 100-160
        {"seq": 2, "name": "k2", "device": 0, "stream": 7, "start_ns": 230, "dur_ns": 70},    # idle 180-230
    ])
    from tensorscope.analyses.idle import gpu_idle

    (d,) = gpu_idle(ops, kernels)
    # gap 1: op 1 started at 150 > 100: 50 host wait, 10 launch; gap 2: op 2 started at 170 < 180: 50 launch
    assert d["busy_ns"] == 170 and d["idle_ns"] == 110 and d["host_wait_ns"] == 50 and d["launch_ns"] == 60
    assert d["n_gaps"] == 2 and d["gap_seqs"] == [1, 2] and d["span_ns"] == 280
    t = make_trace({"wall_ns": 400}, ops=ops, kernels=kernels)
    adv = tensorscope.advise(t, peaks={})
    (f,) = [f for f in adv.findings.to_pylist() if f["kind"] == "gpu_idle"]
    assert f["cost_ns"] == 110 and "50 ns waiting for the host" in f["seen"] and finding_rows(f).tolist() == [1, 2]
    assert "launch-bound" in f["fix"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_item_sync_and_peaks_for_real():
    x = torch.randn(1 << 20, device="cuda")
    with tensorscope.trace(kernels=True) as t:
        for _ in range(5):
            (x * 2).sum().item()
    adv = t.advice()
    sy = adv.syncs.to_pylist()
    assert len(sy) == 5 and {r["device"] for r in sy} == {"cuda:0"}
    assert any("each one waits" in f["seen"] for f in adv.findings.to_pylist() if f["kind"] == "sync")
    p = tensorscope._peaks.machine_peaks("cuda")
    assert p["flops"]["float32"] > 1e12 and p["bytes_per_s"] > 1e11
    assert adv.gpu_idle and adv.gpu_idle[0]["n_kernels"] >= 10


def test_advise_refuses_what_is_not_a_trace_and_a_wrong_steps_count():
    with pytest.raises(OptionsError):
        tensorscope.advise(42)
    t = make_trace({"wall_ns": 1})
    with pytest.raises(OptionsError):
        tensorscope.advise([t, t], steps=3)
    with pytest.raises(OptionsError):
        tensorscope.advise([t, t], steps=[1])
    adv = tensorscope.advise(t, peaks={})
    assert adv.findings.num_rows == 0 and adv.findings.schema.equals(S.ADVICE)
    assert "no finding" in str(adv)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_scheduled_loop_computes_exactly_what_it_computes_untraced(engine):
    def train(sched=None):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Dropout(0.3), torch.nn.Linear(6, 1))
        opt = torch.optim.Adam(model.parameters())
        out = []
        for _ in range(6):
            loss = model(torch.randn(5, 6)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.detach().clone())
            if sched is not None:
                sched.step()
        return out, [p.detach().clone() for p in model.parameters()], torch.random.get_rng_state()

    plain = train()
    with tensorscope.schedule(wait=1, active=2, engine=engine) as s:
        traced = train(s)
    assert len(s.traces) == 2
    for a, b in zip(plain[0] + plain[1], traced[0] + traced[1]):
        assert torch.equal(a, b)                      # bit for bit, RNG included
    assert torch.equal(plain[2], traced[2])
    adv = s.advice()
    assert adv.n_windows == 2 and adv.steps == 4


# -- time outside ops: the program's, not the tracer's ------------------------------------------

def _kinds(adv):
    return {f["kind"] for f in adv.findings.to_pylist()}


@pytest.mark.parametrize("engine", ENGINES)
def test_back_to_back_ops_are_no_outside_ops_finding(engine):
    """Many small ops with no Python between them: the gaps are the tracer's own per-op work
    (largest under the python engine), which is no finding about the program."""
    x = torch.ones(16)
    with tensorscope.trace(engine=engine, leaks=False) as t:
        for _ in range(600):
            x = x.add(1.0)
    assert "outside_ops" not in _kinds(t.advice())


@pytest.mark.parametrize("engine", ENGINES)
def test_python_work_between_ops_is_an_outside_ops_finding(engine):
    import time
    x = torch.ones(16)
    with tensorscope.trace(engine=engine, leaks=False) as t:
        for _ in range(4):
            x = x.add(1.0)
            deadline = time.thread_time() + 0.004    # 4 ms of host-side CPU work the program does between two ops
            while time.thread_time() < deadline:     # (CPU time: on a busy machine a wall deadline is partly
                pass                                 # other processes' time, which the advisor leaves out)
        x = x.add(1.0)
    (f,) = [f for f in t.advice().findings.to_pylist() if f["kind"] == "outside_ops"]
    assert f["cost_ns"] >= 4 * 3_000_000            # the 4 busy waits, less the tracer's allowance per gap
