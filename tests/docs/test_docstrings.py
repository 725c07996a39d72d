"""The examples in the public API's docstrings (what the API reference shows) run and print what they say."""
from __future__ import annotations

import doctest
import inspect

import pytest

import tensorscope


def _public_objects():
    """The top-level names and the exceptions (``tensorscope.errors``: the API reference's errors group)."""
    import tensorscope.errors as errors

    seen = set()
    names = [(f"tensorscope.{n}", getattr(tensorscope, n)) for n in tensorscope.__all__]
    names += [(f"tensorscope.errors.{n}", obj) for n, obj in vars(errors).items()
              if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__]
    for qual, obj in names:
        if not (inspect.isclass(obj) or callable(obj)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        yield qual, obj
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and (inspect.isfunction(member) or isinstance(member, property)):
                    yield f"{qual}.{attr}", member


def _with_examples():
    finder = doctest.DocTestFinder(recurse=False)
    out = []
    for qual, obj in _public_objects():
        target = obj.fget if isinstance(obj, property) else obj
        for test in finder.find(target, qual, globs={}):
            if test.examples:
                out.append(pytest.param(test, id=qual))
    return out


EXAMPLES = _with_examples()


def test_the_api_docstrings_have_examples():
    have = {p.id for p in EXAMPLES}
    for name in ("tensorscope.trace", "tensorscope.Trace", "tensorscope.load", "tensorscope.predict",
                 "tensorscope.TraceOptions", "tensorscope.errors.GuardError"):
        assert name in have, f"{name}'s docstring lost its example"


@pytest.mark.parametrize("test", EXAMPLES)
def test_docstring_example_runs(test, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out = []
    runner.run(test, out=out.append)
    assert runner.failures == 0, "".join(out)
