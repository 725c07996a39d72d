"""The public API: every name in ``tensorscope.__all__`` survives the import of every submodule and
works after a trace; ``history()`` is bounded in bytes as well as in count; ``%tensorscope save`` fails
in one line."""
from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import types

import pyarrow as pa
import pytest
import torch

import tensorscope
from tensorscope.recording import history as H


def _import_every_submodule():
    names = []
    for info in pkgutil.walk_packages(tensorscope.__path__, "tensorscope."):
        if info.name == "tensorscope.__main__":
            continue   # importing it is harmless, but it is the CLI's entry point, not a library module
        importlib.import_module(info.name)
        names.append(info.name)
    return names


def test_every_public_name_survives_every_submodule_import_and_works_after_a_trace(tmp_path):
    m = torch.nn.Linear(4, 3)
    with tensorscope.trace() as t:
        m(torch.randn(2, 4)).sum().backward()
    imported = _import_every_submodule()
    assert "tensorscope._env" in imported and "tensorscope.tracking.leaks.report" in imported
    for name in tensorscope.__all__:
        v = getattr(tensorscope, name)
        assert not isinstance(v, types.ModuleType), f"tensorscope.{name} is a module after importing submodules"
    # every public callable, called
    rep = tensorscope.env()
    assert "torch" in str(rep)
    tr = t.result
    assert isinstance(tr, tensorscope.Trace) and tensorscope.last() is tr
    assert isinstance(tensorscope.history(), list)
    assert tensorscope.TraceOptions().leaks is True
    assert tensorscope.schema.SCHEMA_VERSION == tr.metadata["schema_version"]
    back = tensorscope.load(tr.save(tmp_path / "t"))
    assert back.ops.num_rows == tr.ops.num_rows
    assert isinstance(tensorscope.find_leaks(user_ns={}, frames=False).table, pa.Table)
    assert tensorscope.tracking.leaks.leak_table([], user_ns={}).num_rows == 0
    d = tensorscope.enable_discovery()
    assert d is not None
    tensorscope.disable_discovery()
    for err in ("TensorscopeError", "TraceActiveError", "SchemaVersionError", "TraceFormatError", "ExportError",
                "OptionsError", "GuardError", "NativeBuildError"):
        assert issubclass(getattr(tensorscope.errors, err), tensorscope.TensorscopeError)
    assert callable(tensorscope.load_ipython_extension) and callable(tensorscope.unload_ipython_extension)
    assert isinstance(tensorscope.__version__, str)
    assert callable(tensorscope.trace) and inspect.isfunction(tensorscope.env)


def test_the_public_names_are_grouped_and_the_moved_ones_still_work_with_a_warning():
    import warnings

    grouped = [n for names in tensorscope.GROUPS.values() for n in names]
    assert sorted(grouped) == sorted(tensorscope.__all__) and len(set(grouped)) == len(grouped)
    assert set(tensorscope.GROUPS) == {"record", "results", "options", "leaks", "compare", "errors", "environment"}
    for name in tensorscope.__all__:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            getattr(tensorscope, name)            # a public name never warns
    for name, home in tensorscope._MOVED.items():
        assert name not in tensorscope.__all__ and name not in dir(tensorscope)
        with pytest.warns(DeprecationWarning, match=rf"tensorscope\.{name} is deprecated: use {home}\.{name}"):
            old = getattr(tensorscope, name)
        assert old is getattr(importlib.import_module(home), name)
    with pytest.raises(AttributeError):
        tensorscope.no_such_name


def test_trace_tables_are_properties_and_the_old_method_spelling_warns(tmp_path):
    with tensorscope.trace(leaks=False) as t:
        torch.ones(4, 4).relu().sum()
    tr = t.result
    for name in ("memory_timeline", "module_memory", "allocator_timeline"):
        view = getattr(tr, name)
        assert isinstance(inspect.getattr_static(tensorscope.Trace, name), property)
        with pytest.warns(DeprecationWarning, match=rf"t\.{name}\(\) is deprecated: t\.{name} is a property"):
            assert view() is view
    before = tr.metadata
    path = tr.save(tmp_path / "run")
    assert tr.metadata is before and before.saved_to is None and tr.saved_to == path
    assert f"saved to: {path}" in tr.summary().to_text()   # the summary's line reads t.saved_to
    assert tensorscope.load(path).saved_to == path


def test_env_is_callable_in_a_fresh_process_after_a_trace(tmp_path):
    # the original failure: the trace builder imports the env submodule, which replaced the function
    import subprocess
    import sys

    code = ("import torch, tensorscope\n"
            "with tensorscope.trace():\n    torch.ones(2) + 1\n"
            "print(type(tensorscope.env()).__name__)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "EnvReport"


def _trace_with_history(rows: int):
    with tensorscope.trace(leaks=False, context=tensorscope.options.RunContext(keep_history=True)) as t:
        x = torch.zeros(1)
        for _ in range(rows):
            x = x + 1
    return t.result


@pytest.fixture
def clean_history():
    saved = (list(H._history), list(H._sizes), H._HISTORY_MAX, H._HISTORY_MAX_BYTES)
    H._history.clear()
    H._sizes.clear()
    yield
    H._history[:], H._sizes[:] = saved[0], saved[1]
    H._HISTORY_MAX, H._HISTORY_MAX_BYTES = saved[2], saved[3]


def test_history_is_bounded_in_bytes_and_a_dropped_saved_trace_loads_back(tmp_path, capsys, clean_history):
    first = _trace_with_history(50)
    path = first.save(tmp_path / "first")
    assert first.saved_to == path        # the trace remembers where it was saved (its metadata is unchanged)
    size = H.trace_nbytes(first)
    assert size > 0
    H.set_history_limits(max_traces=64, max_bytes=int(size * 2.5))
    second = _trace_with_history(50)
    assert tensorscope.history() == [first, second]
    third = _trace_with_history(50)                   # over 2.5 traces' bytes: the oldest falls out
    assert tensorscope.history() == [second, third]
    err = capsys.readouterr().err
    assert "history() keeps at most" in err and "dropped" in err and f"tensorscope.load({path!r})" in err
    assert tensorscope.load(path).ops.num_rows == first.ops.num_rows
    # an unsaved trace says how to keep one; the count bound says so too
    H.set_history_limits(max_traces=1)
    assert tensorscope.history() == [third]
    err = capsys.readouterr().err
    assert "at most 1 traces" in err and "--save PATH" in err
    # the newest trace stays, even alone over the byte bound
    H.set_history_limits(max_traces=64, max_bytes=0)
    assert tensorscope.history() == [third] and tensorscope.last() is third


@pytest.mark.kernel
def test_line_magic_save_fails_in_one_line(tmp_path):
    from tests.helpers.kernel_utils import Kernel

    k = Kernel(cwd=str(tmp_path))
    try:
        assert k.run("%load_ext tensorscope\nimport torch").status == "ok"
        assert k.run("%%tensorscope -q\ntorch.ones(3) * 2").status == "ok"
        (tmp_path / "afile").write_text("x")
        r = k.run(f"%tensorscope save {tmp_path / 'afile'}")
        assert r.status == "error" and r.error["ename"] == "UsageError", r.error
        assert "a file with that name exists" in r.error["evalue"]
        assert not r.error.get("traceback") or len(r.error["traceback"]) <= 1, r.error
        r = k.run(f"%tensorscope save {tmp_path / 'ok'}")
        assert r.status == "ok" and "saved to" in r.stdout
    finally:
        k.close()
