"""The first trace never waits on the compiler: with nothing built, it starts the build in a background
process and records with the python engine, saying so once; the trace after the build is native.

Each test uses its own empty TENSORSCOPE_CACHE. ``TENSORSCOPE_TEST_BUILD_DELAY`` (test only) makes the
background builder hold its lock and sleep before compiling, so a trace certainly runs while the build
is under way. The failure tests build with ``CXX=/bin/false`` (a real compile that fails in a second).
``test_kernel_first_cell_python_then_native`` is the suite's one real cold build (~25 s on 2 idle cores,
up to ~3 min on busy ones), bounded by its timeout; marked `cold_build` (`-m "not cold_build"` skips it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tensorscope.native import _background, _build, forced_fallback
from tests.helpers.kernel_utils import Kernel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
START = "compiling the native parts in the background"
FAILED = "the background build of the native parts failed"

needs_toolchain = pytest.mark.skipif(_build.toolchain_problem() is not None,
                                     reason=f"no toolchain: {_build.toolchain_problem()}")


def _env(cache, **kw):
    env = dict(os.environ, TENSORSCOPE_CACHE=str(cache), PYTHONPATH=ROOT, **kw)
    for k in ("TENSORSCOPE_FORCE_FALLBACK", _background.BUILD_ENV):
        env[k] = ""   # set empty, not removed: the Kernel helper starts from os.environ again (off either way)
    return env


def _status(cache):
    try:
        with open(os.path.join(cache, "background.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _wait_finished(cache, timeout):
    t0 = time.time()
    while time.time() - t0 < timeout:
        st = _status(cache)
        if st.get("state") in ("done", "failed"):
            return st
        time.sleep(0.5)
    raise AssertionError(f"the background build did not finish in {timeout} s: {_status(cache)}")


_SCRIPT = r"""
import json, sys, time, torch, tensorscope
x = torch.randn(4, 4)

def traced():
    with tensorscope.trace() as tr:
        (x @ x).relu().sum()
    md = tr.result.metadata
    return {"engine": md["engine"], "reason": md["engine_reason"], "ops": tr.result.ops.num_rows}

out = [traced(), traced()]
print("WAIT", flush=True)
sys.stdin.readline()            # the test says when the builder finished
out += [traced(), traced()]
print("RESULT " + json.dumps(out), flush=True)
"""


@needs_toolchain
def test_failed_background_build_is_said_once_and_the_python_engine_stays(tmp_path):
    cache = tmp_path / "cache"
    env = _env(cache, CXX="/bin/false", **{_background.TEST_DELAY_ENV: "15"})
    p = subprocess.Popen([PY, "-c", _SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=str(tmp_path))
    try:
        assert p.stdout.readline().strip() == "WAIT"
        # a second process while the first one's builder holds the lock: it starts no builder of its own
        other = subprocess.run([PY, "-c", "from tensorscope import native; print(native.build_pending())"],
                               capture_output=True, text=True, env=env, timeout=120)
        assert "are compiling in a background process" in other.stdout, other.stdout + other.stderr
        assert _status(cache)["state"] == "running"   # (the check above ran while the builder held its lock)
        st = _wait_finished(cache, 120)
        out, err = p.communicate("go\n", timeout=120)
    finally:
        p.kill()
    assert p.returncode == 0, err
    first, second, third, fourth = json.loads(out.split("RESULT ", 1)[1])
    assert [r["engine"] for r in (first, second, third, fourth)] == ["python"] * 4
    assert all(r["ops"] == 3 for r in (first, second, third, fourth))      # mm, relu, sum: recorded all the same
    assert "started compiling in a background process" in first["reason"]
    assert "are compiling in a background process" in second["reason"]
    assert "an earlier build failed" in third["reason"] and "build.log" in third["reason"]
    # one line at the start and one for the failure, with the log; a script's stdout stays its own
    assert err.count(START) == 1 and err.count(FAILED) == 1, err
    assert "log: " + str(cache / "background-build.log") in err
    assert START not in out and FAILED not in out
    assert st["state"] == "failed" and {k: v["state"] for k, v in st["libs"].items()} == \
        {"hooks": "fallback", "engine": "fallback", "fmode": "fallback"}
    with open(cache / "background-build.log") as f:
        log = f.read()
    assert log.count("background build of the native parts, pid") == 1    # one builder, not two
    for spec in _background.TRACE_LIBS:   # remembered like any failed build: no later process compiles again
        assert list(cache.glob(f"{spec.kind}-*/failed.json")), spec.kind


@needs_toolchain
def test_foreground_env_and_forced_fallback_start_nothing(tmp_path):
    cache = tmp_path / "cache"
    code = ("from tensorscope import native; print(native.build_pending()); "
            "import os; print(sorted(os.listdir(os.environ['TENSORSCOPE_CACHE'])) "
            "if os.path.isdir(os.environ['TENSORSCOPE_CACHE']) else [])")
    for extra in ({_background.BUILD_ENV: "foreground"}, {"TENSORSCOPE_FORCE_FALLBACK": "1"}):
        r = subprocess.run([PY, "-c", code], capture_output=True, text=True, env={**_env(cache), **extra}, timeout=120)
        assert r.returncode == 0 and r.stdout.split("\n")[:2] == ["None", "[]"], r.stdout + r.stderr


def test_build_native_says_what_it_compiled(capsys):
    from tensorscope import native

    if _build.cached(_build.ENGINE) is None:
        pytest.skip("the native parts are not in the cache")
    assert native.build_native_main([]) in (0, 1)
    out = capsys.readouterr().out
    assert "nothing compiled: every library was already in the cache" in out and _build.BUILD_TIME in out


def _run(k, code, timeout=180):
    """(reply status, [(stream name, text)], results) of one cell."""
    streams, results = [], []

    def hook(msg):
        if msg["msg_type"] == "stream":
            streams.append((msg["content"]["name"], msg["content"]["text"]))
        elif msg["msg_type"] in ("execute_result", "display_data"):
            results.append(msg["content"]["data"])

    reply = k.kc.execute_interactive(code, output_hook=hook, timeout=timeout, allow_stdin=False)
    return reply["content"]["status"], streams, results


@pytest.mark.kernel
@pytest.mark.cold_build
@needs_toolchain
@pytest.mark.skipif(forced_fallback(), reason="the suite's one real cold build runs in the native pass; "
                    "TENSORSCOPE_FORCE_FALLBACK=1 (the python-engine pass) would only build it twice")
def test_kernel_first_cell_python_then_native(tmp_path):
    """The suite's one real cold build: the first %%tensorscope cell runs at once with the python engine
    and one plain stdout line; the cell after the build finished records with the native engine."""
    cache = tmp_path / "cache"
    k = Kernel(cwd=str(tmp_path), env=_env(cache, **{_background.TEST_DELAY_ENV: "3"}))
    try:
        assert _run(k, "%load_ext tensorscope\nimport torch, tensorscope\nx = torch.randn(8, 8)")[0] == "ok"
        t0 = time.time()
        status, streams, results = _run(k, "%%tensorscope -o t1\ny = (x @ x).relu()")
        first_cell_s = time.time() - t0
        assert status == "ok"
        said = [(n, s) for n, s in streams if "tensorscope" in s]
        assert len(said) == 1 and said[0][0] == "stdout" and START in said[0][1], streams
        assert results and "text/html" in results[0]          # the summary still shows
        status, streams, _ = _run(k, "%%tensorscope -q -o t2\ny = (x @ x).relu()")
        assert status == "ok" and not [s for _, s in streams if "tensorscope" in s], streams   # said once
        assert first_cell_s < 60, f"the first cell waited {first_cell_s:.0f} s"
        assert _status(cache).get("state") == "running"          # the builder was still at it
        for name in ("t1", "t2"):
            assert k.value(f"{name}.metadata['engine']") == "python"
            assert "compiling in a background process" in k.value(f"{name}.metadata['engine_reason']")
            assert k.value(f"{name}.ops.column('op').to_pylist()") == ["aten.mm.default", "aten.relu.default"]
        st = _wait_finished(cache, 540)
        assert st["state"] == "done", st
        libs = ", ".join(f"{k} {v['reason']}" for k, v in st["libs"].items())
        print(f"first traced cell {first_cell_s:.2f} s while the background build took {st['seconds']:.1f} s ({libs})")
        status, streams, _ = _run(k, "%%tensorscope -q -o t3\ny = (x @ x).relu()")
        assert status == "ok" and not [s for n, s in streams if n == "stderr"], streams
        assert k.value("t3.metadata['engine']") == "native"
        assert "loaded from the cache" in k.value("t3.metadata['engine_reason']")
        assert k.value("t3.ops.column('op').to_pylist()") == ["aten.mm.default", "aten.relu.default"]
    finally:
        k.close()
