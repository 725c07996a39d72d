"""The native side behind one facade: C++ hooks for warnings and errors, the recording engine, the function mode.

``open_capture`` gives the tracer's modes a capture per trace (the compiled hooks, or the
pure-Python fallback with the same methods); ``engine``/``loaded_engine``/``engine_status`` and
``function_mode`` reach the other libraries; ``status``/``build`` (``python -m tensorscope
build-native``) report and compile; ``abi``/``abi_dtype``/``abi_flags``/``fields_dtype`` read the
layouts the libraries share with Python. ``TENSORSCOPE_FORCE_FALLBACK=1`` forces the fallback.
Importing this package imports neither torch nor the compiler tool chain, and builds nothing.

Rules and details: docs/development/native.md
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Optional

from . import _background, _build

__all__ = [
    "open_capture", "status", "build", "build_native_main", "engine", "loaded_engine", "engine_status",
    "forced_fallback", "load_test_ops", "FORCE_ENV", "function_mode", "PY_FUNCTION_MODE_ENV", "site_error_info",
    "abi", "abi_dtype", "abi_flags", "fields_dtype", "cache_root", "build_pending", "BUILD_ENV", "TEST_DELAY_ENV",
]

BUILD_ENV = _background.BUILD_ENV
TEST_DELAY_ENV = _background.TEST_DELAY_ENV

#: Set to 1 to force the pure-Python fallback (read at every call, not at import).
FORCE_ENV = "TENSORSCOPE_FORCE_FALLBACK"


def forced_fallback() -> bool:
    return os.environ.get(FORCE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def status() -> dict[str, Any]:
    """``{'state': 'built'|'building'|'fallback', 'reason': str, 'path': str|None, ...}``.

    'built' with ``loaded=False`` means a cached build exists and will be
    imported (in about a millisecond) on first use. Never compiles anything.
    """
    out = _build.lib_status(_build.HOOKS)
    mod = _build._STATES[_build.HOOKS.kind].module
    if mod is not None:
        out["source_locations"] = bool(getattr(mod, "peek_ok", False))
        out["source_locations_reason"] = str(getattr(mod, "peek_reason", ""))
        out["cpp_stacktraces"] = bool(getattr(mod, "cpp_stacktraces", False))
    eng = engine_status()
    out["engine"] = {"state": eng["state"], "reason": eng["reason"], "path": eng.get("path")}
    fm = _build.lib_status(_build.FMODE)
    out["function_mode"] = {"state": fm["state"], "reason": fm["reason"], "path": fm.get("path")}
    out["forced_fallback"] = forced_fallback()
    if out["forced_fallback"]:
        out["available"] = out["state"]
        out["state"] = "fallback"
        out["reason"] = f"{FORCE_ENV}=1 forces the pure-Python fallback (native hooks: {out['available']})"
    return out


def build(verbose: bool = False, force: bool = False) -> dict[str, Any]:
    """Compile (or load from the cache) the hooks now, blocking; returns :func:`status`.

    Builds even when the fallback is forced, so the binary is ready later.
    ``force=True`` recompiles, ignoring the cache and any remembered failure.
    """
    _build.ensure(_build.HOOKS, wait=True, verbose=verbose, force=force)
    return status()


def engine(wait: bool = True) -> tuple[Any, str]:
    """(the native recording engine's extension module or None, reason); builds it on first use
    (``wait=False`` never blocks on a build in progress). Does not look at :data:`FORCE_ENV`."""
    return _build.ensure(_build.ENGINE, wait=wait)


def cache_dir() -> str:
    """Where native builds are cached (``$TENSORSCOPE_CACHE`` or ``~/.cache/tensorscope/native``); the
    measured machine peaks (``tensorscope._peaks.machine_peaks``) are stored beside them."""
    return _build.cache_root()


def loaded_engine() -> Any:
    """The native recording engine's module if this process has loaded it, else None. Never compiles."""
    return _build._STATES[_build.ENGINE.kind].module


def cache_root() -> str:
    """Where the compiled libraries are cached: ``$TENSORSCOPE_CACHE``, else ``~/.cache/tensorscope/native``."""
    return _build.cache_root()


def engine_status() -> dict[str, Any]:
    """The engine library's build state (``state``, ``reason``, ``path`` …). Never compiles."""
    return _build.lib_status(_build.ENGINE)


def abi(lib: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The layouts the C++ libraries share with Python (abi.h) as a dict, read from the loaded
    library ``lib`` ("engine", "fmode", "hooks"; None: the first loaded); None when none is loaded.
    Never compiles. Keys: row/row_size, call/call_size/call_fields, flags, tags, packed, tensors, meta,
    kinds/kind_bits, fmode_state, site_reader (see _abi.py)."""
    from ._abi import abi as impl

    return impl(lib)


def abi_dtype(kind: str, lib: Optional[str] = None) -> Any:
    """The numpy structured dtype of a C row (``"row"``: the engine's ops row, ``"call"``: the function
    mode's calls row), built from the loaded library's layout; None when none is loaded."""
    from ._abi import abi_dtype as impl

    return impl(kind, lib)


def fields_dtype(fields: Sequence[tuple[str, int, int, str]], size: int) -> Any:
    """A numpy structured dtype laid out as a C struct: ``fields`` are (name, offset, size, kind), as
    ``abi()`` reports them; ``size`` is the struct's size."""
    from ._abi import fields_dtype as impl

    return impl(list(fields), size)


def abi_flags(lib: Optional[str] = None) -> Optional[dict[str, int]]:
    """The engine's row flags by name (``F_BACKWARD``, ``F_THREW``, ``F_OTHER_THREAD``) from the loaded
    library; None when none is loaded."""
    from ._abi import abi_flags as impl

    return impl(lib)


def build_pending() -> Optional[str]:
    """Why a trace starting now cannot use the native parts yet: they are not built and are
    compiling in a background process (started by this call when none runs; one calm line says so,
    once). None when they are loaded, cached (a trace loads them in milliseconds), known not to build,
    forced off (:data:`FORCE_ENV`), or ``TENSORSCOPE_NATIVE_BUILD=foreground``. Never blocks."""
    if forced_fallback():
        return None
    return _background.background(_background.TRACE_LIBS)


def _hooks(wait: bool = True):
    """(extension module or None, reason)."""
    if forced_fallback():
        return None, f"{FORCE_ENV}=1"
    return _build.ensure(_build.HOOKS, wait=wait)


def dict_identity(d: dict) -> Optional[int]:
    """The identities of ``d``'s (key, value) pairs in order as one integer (equal while ``d`` holds
    the same keys bound to the same objects), or None when the native hooks are not loaded (this
    never builds or waits for them)."""
    ext = _build._STATES[_build.HOOKS.kind].module if not forced_fallback() else None
    fn = getattr(ext, "dict_identity", None)
    return fn(d) if fn is not None else None


def open_capture(native: bool = True, cpp_errors: bool = False):
    """A capture for one trace: native when asked for and available, else the fallback.

    When no cached build exists the hooks compile in a background process (``build_pending``)
    and this capture is the fallback; with ``TENSORSCOPE_NATIVE_BUILD=foreground`` the first capture
    compiles them (one line on stderr says so), unless another thread is compiling them, in which
    case this capture uses the fallback instead of waiting.
    """
    from ._fallback import FallbackCapture

    if not native:
        return FallbackCapture(reason="native=False", cpp_errors=cpp_errors)
    pending = build_pending()
    if pending is not None:
        return FallbackCapture(reason=pending, cpp_errors=cpp_errors)
    ext, reason = _hooks(wait=False)
    if ext is None and "still compiling" not in reason and not forced_fallback():
        ext, reason = _hooks(wait=True)
    if ext is None:
        return FallbackCapture(reason=reason, cpp_errors=cpp_errors)
    from ._capture import NativeCapture

    return NativeCapture(ext, cpp_errors=cpp_errors, reason=reason)


def site_error_info(exc: BaseException, info: Optional[dict[str, Any]], file: Optional[str],
                    line: Optional[int], func: Optional[str]) -> Optional[dict[str, Any]]:
    """``info`` completed with the c10 source location the native engine read (see _capture)."""
    from ._capture import site_error_info as impl

    return impl(exc, info, file, line, func)


#: set to 1 to run the native engine's function mode in Python (recording/function.py TracingFunctionMode)
PY_FUNCTION_MODE_ENV = "TENSORSCOPE_PY_FUNCTION_MODE"


def function_mode(row_size: int):
    """(the compiled function mode (fmode.cpp) or None, reason); compiles it on first use.

    ``row_size``: the caller's idea of a calls row (its numpy dtype's itemsize), checked here.
    """
    if forced_fallback():
        return None, f"{FORCE_ENV}=1"
    if os.environ.get(PY_FUNCTION_MODE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off"):
        return None, f"{PY_FUNCTION_MODE_ENV}=1"
    ext, reason = _build.ensure(_build.FMODE, wait=True)
    if ext is not None and getattr(ext, "ROW_SIZE", None) != row_size:
        return None, f"native function mode row layout mismatch ({getattr(ext, 'ROW_SIZE', None)} != {row_size})"
    return ext, reason


def load_test_ops(source: str):
    """Compile/load the ``tensorscope_test`` op library from ``source``; ``torch.ops.tensorscope_test``.

    For tests only: the source is the test suite's tests/native/test_ops.cpp (not shipped in the
    package); it registers ops that throw every c10 error kind and emit every warning kind. Raises
    ``NativeBuildError`` when it cannot be built.
    """
    import torch

    from ..errors import NativeBuildError

    lib, reason = _build.ensure(_build.test_ops_spec(source), wait=True)
    if lib is None:
        raise NativeBuildError(f"test-op library unavailable: {reason}")
    return torch.ops.tensorscope_test


def _describe(st: dict[str, Any]) -> str:
    line = f"native hooks: {st['state']} ({st['reason']})"
    if st.get("path"):
        line += f"\n  path: {st['path']}"
    if "source_locations" in st:
        line += f"\n  c10 error source locations: {'yes' if st['source_locations'] else 'no'}" \
                f" ({st.get('source_locations_reason', '')})"
    return line


def build_native_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m tensorscope build-native [--force] [--verbose] [--test-ops CPP] [--status]``.

    Returns 0 when the hooks (and, with ``--test-ops``, the test library) are
    built, 1 otherwise.
    """
    import argparse

    p = argparse.ArgumentParser(prog="python -m tensorscope build-native",
                                description="Compile tensorscope's native C++ hooks into the cache ahead of time.")
    p.add_argument("--force", action="store_true", help="recompile even if a cached build (or failure) exists")
    p.add_argument("--verbose", action="store_true", help="show the compiler's output")
    p.add_argument("--test-ops", metavar="CPP", help="also build the test-op library used by the test suite "
                                                     "from CPP (tests/native/test_ops.cpp in a checkout)")
    p.add_argument("--status", action="store_true", help="only report the state; build nothing")
    p.add_argument("--cache-dir", action="store_true", help="print the cache directory and exit")
    args = p.parse_args(list(argv) if argv is not None else None)
    import time

    t0 = time.perf_counter()
    if args.cache_dir:
        print(_build.cache_root())
        return 0
    if args.status:
        st = status()
        print(_describe(st))
        return 0 if st["state"] == "built" else 1
    _build.ensure(_build.HOOKS, wait=True, verbose=args.verbose, force=args.force)
    st = _build.lib_status(_build.HOOKS)
    full = status()
    for k in ("source_locations", "source_locations_reason"):
        if k in full:
            st[k] = full[k]
    print(_describe(st))
    ok = st["state"] == "built"
    # the recording engine: a failure is not fatal (traces then use the python engine, and say so)
    _build.ensure(_build.ENGINE, wait=True, verbose=args.verbose, force=args.force)
    est = _build.lib_status(_build.ENGINE)
    print(f"native recording engine: {est['state']} ({est['reason']})")
    ok = ok and est["state"] == "built"
    # the native engine's function mode (recording/function.py falls back to the Python one without it)
    _build.ensure(_build.FMODE, wait=True, verbose=args.verbose, force=args.force)
    fst = _build.lib_status(_build.FMODE)
    print(f"native function mode: {fst['state']} ({fst['reason']})")
    ok = ok and fst["state"] == "built"
    if args.test_ops:
        spec = _build.test_ops_spec(args.test_ops)
        _build.ensure(spec, wait=True, verbose=args.verbose, force=args.force)
        tst = _build.lib_status(spec)
        print(f"test-op library: {tst['state']} ({tst['reason']})")
        ok = ok and tst["state"] == "built"
    compiled = [(spec.what, _build._STATES[spec.kind]) for spec in _background.TRACE_LIBS]
    took = ", ".join(f"{what} {st.seconds:.1f} s" for what, st in compiled if st.compiled and st.seconds is not None)
    if took:
        print(f"compiled in {time.perf_counter() - t0:.1f} s ({took}) on {os.cpu_count()} cores; "
              f"traces load the cached builds in milliseconds from now on")
    else:
        print("nothing compiled: every library was already in the cache "
              f"({_build.cache_root()}); a cold build takes {_build.BUILD_TIME}")
    if forced_fallback():
        print(f"note: {FORCE_ENV} is set, so traces use the pure-Python fallback anyway")
    return 0 if ok else 1
