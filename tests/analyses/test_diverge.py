"""tensorscope.diverge: two runs aligned op by op, their fingerprints compared.

The autocast case runs in two processes (the same script, the same seed; one Linear under bf16
autocast in run b); the compiled case runs eager against torch.compile (inductor on CPU); the
scale case aligns two 100k-op traces. Every test runs under the engine the suite runs with
(``TENSORSCOPE_FORCE_FALLBACK=1``: the python engine); subprocesses inherit it.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

import tensorscope
from tensorscope.errors import DivergeInputError
from tests.helpers import ROOT

BLOCK = '''
import sys, torch, tensorscope

class Block(torch.nn.Module):
    def __init__(self, d=32, amp=False):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)
        self.amp = amp

    def forward(self, x):
        h = self.norm(x)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.amp):
            h = self.fc1(h)  # FC1_LINE
        h = torch.nn.functional.gelu(h.float())
        h = torch.softmax(self.fc2(h), dim=-1)
        return x + h

torch.manual_seed(0)
m = Block(amp=sys.argv[1] == "amp")
x = torch.randn(8, 32)
with tensorscope.trace(fingerprints=True, leaks=False) as t:
    m(x).pow(2).mean().backward()
t.result.save(sys.argv[2])
'''


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def autocast_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("diverge")
    script = d / "block.py"
    script.write_text(BLOCK)
    for mode in ("fp32", "amp"):
        subprocess.run([sys.executable, str(script), mode, str(d / mode)], check=True, env=_env(), timeout=300,
                       capture_output=True)
    line = next(i for i, s in enumerate(BLOCK.splitlines(), 1) if "FC1_LINE" in s)
    return d / "fp32", d / "amp", line


def test_autocast_linear_is_the_first_divergence_across_processes(autocast_runs):
    a, b, fc1_line = autocast_runs
    d = tensorscope.diverge(str(a), str(b))
    f = d.first
    assert f is not None, d.to_text()
    # the Linear's first op (addmm: bias + x @ W.T) at the line that calls it
    assert f["op"] == "aten.addmm.default" and f["module"] == "fc1" and f["source_line"] == fc1_line, f
    assert f["cause"] == "numeric" and f["after_cast"] is True
    assert (f["dtype_a"], f["dtype_b"]) == ("float32", "bfloat16")
    assert f["rel_err"] > f["threshold"] and f["explained"] is True   # bf16 rounding explains it
    # nothing before it diverged: every earlier aligned pair is bit-identical or close
    before = d.pairs.filter(pc.less(d.pairs.column("seq_a"), f["seq_a"]))
    assert before.num_rows >= 1
    assert set(before.column("status").to_pylist()) <= {"identical", "close"}
    assert d.pairs.filter(pc.equal(d.pairs.column("cause"), "numeric")).num_rows == 1
    # the casts autocast inserted are structure, on run b's side, at the Linear
    s = d.structure.to_pylist()
    casts = [r for r in s if r["kind"] == "cast" and r["side"] == "b" and r["module"] == "fc1"
             and r["phase"] == "forward"]
    assert len(casts) == 3 and {r["out_dtype"] for r in casts} == {"bfloat16"}, s
    assert all(r["side"] == "b" for r in s)   # run a made no op run b did not
    # later ops inherit the error: propagated, never a second numeric divergence
    later = d.pairs.filter(pc.greater(d.pairs.column("seq_a"), f["seq_a"]))
    causes = set(later.column("cause").to_pylist()) - {None}
    assert causes <= {"propagated"}, causes
    text = d.to_text()
    assert "first divergence: aten.addmm.default in fc1 at block.py:" in text and "bfloat16" in text


def test_identical_runs_do_not_diverge(autocast_runs):
    a, _, _ = autocast_runs
    d = tensorscope.diverge(str(a), str(a))
    assert d.first is None and d.facts["diverged"] == 0
    assert d.facts["identical"] == d.facts["aligned"] == d.facts["ops_a"]
    assert d.structure.num_rows == 0
    assert "no divergence" in d.to_text()


def _mlp_step(seed=0, scale=1.0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    ctx = tensorscope.options.RunContext(keep_history=True)
    with tensorscope.trace(fingerprints=True, leaks=False, context=ctx) as t:
        y = m(x) * scale
        y.pow(2).mean().backward()
    return t.result


def test_same_process_history_indices_and_a_forced_difference():
    a = _mlp_step()
    b = _mlp_step(scale=1.001)   # one op changed in run b: the final scaling
    d = tensorscope.diverge(a, b)
    f = d.first
    assert f is not None and f["op"] == "aten.mul.Tensor" and f["cause"] == "numeric", d.to_text()
    assert f["explained"] is False   # fp32 against fp32: nothing in the precision explains 1e-3
    assert abs(f["rel_err"] - 1e-3) < 2e-4
    # history indices name the same runs
    h = tensorscope.history()
    d2 = tensorscope.diverge(len(h) - 2, -1)
    assert d2.first["seq_a"] == f["seq_a"]
    assert isinstance(d.pairs, pa.Table) and d.pairs.schema.equals(tensorscope.schema.DIVERGE_PAIRS)


def test_rtol_override():
    a = _mlp_step()
    b = _mlp_step(scale=1.001)
    assert tensorscope.diverge(a, b, rtol=0.01).first is None
    with pytest.raises(DivergeInputError, match="rtol"):
        tensorscope.diverge(a, b, rtol=-1)


def _compiled_available():
    try:
        import torch._inductor.config  # noqa: F401
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
        return None
    except Exception as e:
        return f"inductor cannot compile on this machine: {type(e).__name__}: {e}"


def test_eager_vs_compiled_aligns_across_the_region():
    why = _compiled_available()
    if why:
        pytest.skip(why)
    import torch._dynamo

    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
    x = torch.randn(4, 16)

    def middle(h):
        return torch.nn.functional.gelu(h) * 0.5 + torch.tanh(h)

    def run(mid, scale=1.0):
        with tensorscope.trace(fingerprints=True, leaks=False) as t:
            with torch.no_grad():
                h = lin1(x)
                h = mid(h)
                y = lin2(h) * scale
                y.sum()
        return t.result

    compiled = torch.compile(middle, backend="inductor")
    try:
        compiled(torch.randn(4, 32))   # compiled once, outside the traces
        eager = run(middle)
        comp = run(compiled)
        forced = run(compiled, scale=1.01)
    finally:
        torch._dynamo.reset()
    d = tensorscope.diverge(eager, comp)
    assert d.first is None, d.to_text()   # fp32: the fused region's outputs are allclose
    ops = d.pairs.column("op").to_pylist()
    assert ops[0] == "aten.addmm.default" and "aten.sum.default" in ops   # both sides of the region align
    only_a = [r for r in d.structure.to_pylist() if r["side"] == "a"]
    assert {"aten.gelu.default", "aten.tanh.default"} <= {r["op"] for r in only_a}   # fused away in run b
    d2 = tensorscope.diverge(comp, forced)
    f = d2.first
    assert f is not None and f["op"] == "aten.mul.Tensor" and f["cause"] == "numeric", d2.to_text()


def test_100k_op_pair_aligns():
    """Two 100k-op traces (run b with ops removed and inserted) align; the time is printed."""
    with tensorscope.trace(fingerprints=True, leaks=False, storages=False) as t:
        x = torch.zeros(4)
        for _ in range(1000):
            x = x + 1
            x = x * 1.0
    ops = t.result.ops
    reps = max(1, 100_000 // ops.num_rows)
    big = pa.concat_tables([ops] * reps)
    n = big.num_rows
    assert n >= 100_000 - ops.num_rows
    keep = [i for i in range(n) if i % 997 != 5]        # some ops removed in run b
    b = big.take(pa.array(keep))
    b = pa.concat_tables([b.slice(0, 50_000), ops.slice(0, 40), b.slice(50_000)])   # and some inserted
    from tensorscope.analyses.diverge import diverge_tables

    t0 = time.perf_counter()
    pairs, structure, facts = diverge_tables(big, b)
    dt = time.perf_counter() - t0
    print(f"\n100k-op pair: {n} and {b.num_rows} ops aligned in {dt:.2f} s ({facts['aligned']} pairs)")
    assert facts["aligned"] >= len(keep) - 100
    assert facts["numeric"] == 0
    assert structure.num_rows >= n - len(keep)
    assert dt < 60   # generous: the measured time is what the report quotes


def test_bad_input_is_a_clear_error(tmp_path, autocast_runs):
    a, _, _ = autocast_runs
    with tensorscope.trace(leaks=False) as t:
        torch.ones(3) + 1
    plain = t.result
    with pytest.raises(DivergeInputError, match=r"no fingerprints.*fingerprints=True"):
        tensorscope.diverge(str(a), plain)
    golden = os.path.join(ROOT, "tests", "data", "golden-schema-1.4")
    with pytest.raises(DivergeInputError, match=r"schema 1\.4.*fingerprints=True"):
        tensorscope.diverge(golden, str(a))
    with pytest.raises(DivergeInputError, match="not a saved trace directory"):
        tensorscope.diverge(str(a), str(tmp_path / "nowhere"))
    with pytest.raises(DivergeInputError, match="history index"):
        tensorscope.diverge(str(a), 10_000)
    with pytest.raises(DivergeInputError, match="run b"):
        tensorscope.diverge(str(a), object())


def test_cli_diverge(autocast_runs, tmp_path):
    a, b, _ = autocast_runs
    html, pq_path = tmp_path / "d.html", tmp_path / "pairs.parquet"
    r = subprocess.run([sys.executable, "-m", "tensorscope", "diverge", str(a), str(b), "--html", str(html),
                        "--pairs", str(pq_path)], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 1, r.stderr   # a divergence was found
    assert "first divergence: aten.addmm.default in fc1" in r.stdout
    import pyarrow.parquet as pq

    assert pq.read_table(pq_path).num_rows > 5
    assert "tensorscope-diverge" in html.read_text()
    r = subprocess.run([sys.executable, "-m", "tensorscope", "diverge", str(a), str(a)], capture_output=True,
                       text=True, env=_env(), timeout=300)
    assert r.returncode == 0 and "no divergence" in r.stdout
    r = subprocess.run([sys.executable, "-m", "tensorscope", "diverge", str(a), str(tmp_path / "x")],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 2 and "not a saved trace directory" in r.stderr


def test_html_escapes_what_the_trace_holds(autocast_runs):
    a, b, _ = autocast_runs
    d = tensorscope.diverge(str(a), str(b))
    evil = "<img src=x onerror=alert(1)>"
    mod = pc.if_else(pc.equal(d.pairs.column("module"), "fc1"), evil, d.pairs.column("module"))
    d.pairs = d.pairs.set_column(d.pairs.schema.get_field_index("module"), "module", mod)
    h = d.to_html()
    assert evil not in h and "&lt;img src=x onerror=alert(1)&gt;" in h
    assert "&lt;Block&gt;" in h or "Block" not in h
    assert not math.isnan(d.first["rel_err"])


def test_html_in_a_real_browser(autocast_runs, tmp_path):
    """The page renders in headless Chromium; a hostile module name stays text (no element, no script)."""
    import shutil

    chromium = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
                    None)
    if chromium is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium)")
    from tensorscope.render.ranks import html_document

    a, b, _ = autocast_runs
    d = tensorscope.diverge(str(a), str(b))
    evil = '<img id="pwn" src=x onerror="document.title=1">'
    s = d.structure
    s = s.set_column(s.schema.get_field_index("module"), "module", pa.array([evil] * s.num_rows, pa.string()))
    d.structure = s
    page = tmp_path / "d.html"
    probe = ("<script>window.addEventListener('load', function () {var p = document.createElement('pre');"
             "p.id = 'probe'; p.textContent = JSON.stringify({img: document.querySelectorAll('#pwn').length, "
             "text: document.body.textContent.indexOf('<img id=\"pwn\"') >= 0, "
             "rows: document.querySelectorAll('.tensorscope-diverge table tr').length}); "
             "document.body.appendChild(p);});</script>")
    page.write_text(html_document("diverge", d.to_html()).replace("</body>", probe + "</body>"))
    r = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                        "--virtual-time-budget=5000", "--dump-dom", "file://" + str(page)], capture_output=True,
                       text=True, timeout=120)
    import html as _html
    import json
    import re

    m = re.search(r'<pre id="probe">(.*?)</pre>', r.stdout, re.S)
    assert m, r.stderr[-2000:]
    got = json.loads(_html.unescape(m.group(1)))
    assert got["img"] == 0 and got["text"] is True and got["rows"] >= 3, got
