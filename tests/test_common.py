"""The shared tables and formatters (tensorscope/_common.py): one definition each, agreed on by
the builder, the analyses and the renderers."""
from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch

from tensorscope import _common as C


def test_dtype_table_covers_every_plain_torch_dtype_with_its_size():
    names = {str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}
    for name in names:
        dt = getattr(torch, name)
        if name in C.DTYPES:
            assert C.itemsize(name) == dt.itemsize, name
            assert (name in C.INEXACT_DTYPES) == (dt.is_floating_point or dt.is_complex), name
    # the one the builder and the cast analysis used to disagree on
    assert "float8_e8m0fnu" in C.INEXACT_DTYPES and C.FLOAT_BITS["float8_e8m0fnu"] == 8
    assert C.itemsize(None) == 0 and C.itemsize("no_such_dtype") == 0
    assert C.INT_BITS["uint8"] == (8, False) and C.INT_BITS["int16"] == (16, True) and "bool" not in C.INT_BITS


def test_the_builder_and_the_analyses_read_the_shared_tables():
    from tensorscope.analyses import casts, layout
    from tensorscope.recording import columns, decode

    assert columns.INEXACT_DTYPES is C.INEXACT_DTYPES and decode.COPYING_OPS is C.COPYING_OPS
    assert casts.COPY_INTO_OPS is C.COPY_INTO_OPS and casts.FLOAT_BITS is C.FLOAT_BITS
    assert layout.itemsize is C.itemsize
    assert casts.direction("float32", "float8_e8m0fnu") == "down"
    assert not C.COPYING_OPS & C.COPY_INTO_OPS   # two different sets, two names


@pytest.mark.parametrize("n,text", [(None, "-"), (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"),
                                    (-2048, "-2.0 KiB"), (5 * 2**30, "5.0 GiB"), (3 * 2**40, "3.0 TiB"),
                                    (2**52, "4096.0 TiB")])
def test_fmt_bytes(n, text):
    assert C.fmt_bytes(n) == text


@pytest.mark.parametrize("n,text", [(None, "-"), (999, "999 ns"), (1500, "1.5 µs"), (2.5e6, "2.50 ms"),
                                    (3e9, "3.00 s")])
def test_fmt_ns(n, text):
    assert C.fmt_ns(n) == text


def test_esc_escapes_markup_and_quotes_and_reads_none_as_empty():
    assert C.esc('<script>"x"&\'y\'') == "&lt;script&gt;&quot;x&quot;&amp;&#x27;y&#x27;"
    assert C.esc(None) == "" and C.esc(3) == "3"


def test_nogc_pauses_collections_and_restores_the_state_it_found():
    was = gc.isenabled()
    try:
        gc.enable()
        with C.NoGC():
            assert not gc.isenabled()
        assert gc.isenabled()
        gc.disable()
        with C.NoGC():
            pass
        assert not gc.isenabled()   # a user's gc.disable() is kept
        gc.enable()
        with pytest.raises(KeyError):
            with C.NoGC():
                raise KeyError("x")
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_displayable_is_one_mime_bundle_and_str_is_the_text():
    class R(C.Displayable):
        def to_text(self):
            return "plain"

        def to_html(self):
            return "<b>html</b>"

    r = R()
    assert r._repr_mimebundle_() == {"text/plain": "plain", "text/html": "<b>html</b>"} and str(r) == "plain"


def test_ipython_shell_never_imports_ipython():
    code = ("import sys; from tensorscope._common import ipython_shell; "
            "print(ipython_shell(), 'IPython' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "False"]


def test_fmt_rate_is_whole_or_one_decimal():
    from tensorscope._common import fmt_rate

    assert [fmt_rate(x) for x in (20, 20.0, 106 / 3, 1200, 0.5)] == ["20", "20", "35.3", "1,200", "0.5"]
