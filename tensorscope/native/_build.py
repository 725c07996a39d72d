"""Build, cache and load the native libraries (hooks and the test-op library).

Each library is compiled with ``torch.utils.cpp_extension.load`` (its
translation units into one extension) into a cache directory keyed on
everything the binary depends on (torch version and git hash, Python version
and ABI tag, platform, compiler flags, the hash of every source and header
file of the library), so a binary is never used with a torch it was not built
against, and a new torch simply gets a new directory. A cached build is imported directly
(about a millisecond) without importing ``cpp_extension`` or running ninja.

A compile failure is remembered in the cache directory, so later processes go
straight to the fallback instead of spending the compile time again; an
explicit ``build(force=True)`` (``python -m tensorscope build-native --force``)
retries. Messages are one line each, on stderr.

The first trace never waits on the compiler: _background.py builds what is missing in a detached
process meanwhile.

Nothing here runs at import: the package facade calls in on first use.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

#: what a cold build of the three libraries (hooks, engine, function mode) takes, measured with an
#: empty TENSORSCOPE_CACHE on a 2-core machine (docs/guide/display-and-build.md)
BUILD_TIME = "~25 s on 2 idle cores, up to ~3 min on busy ones"

#: Bump when the build recipe changes in a way the key would not see.
BUILD_RECIPE = "1"
#: -DNDEBUG: cpp_extension does not pass it, and against a release torch some
#: headers' debug-only checks and struct members would then be compiled in.
CFLAGS = ("-O2", "-DNDEBUG")

_HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class LibSpec:
    kind: str            # "hooks" / "test_ops": the cache directory's prefix
    name: str            # extension (and PyInit_) name
    source: Union[str, tuple[str, ...]]   # its translation unit(s): files in this package, or absolute paths
    python_module: bool  # False: a TORCH_LIBRARY .so loaded with torch.ops.load_library
    what: str            # for messages
    headers: tuple[str, ...] = ()   # the headers its sources include (hashed into the build key)

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source,) if isinstance(self.source, str) else tuple(self.source)

    @property
    def files(self) -> tuple[str, ...]:
        """Every file the build reads from this package: sources, then headers."""
        return self.sources + self.headers


#: the ABI header (abi.h: layouts shared with Python) and its Python view, in every library
_ABI = ("abi.h", "abi_py.h")
HOOKS = LibSpec("hooks", "tensorscope_hooks", ("hooks.cpp", "hooks_fetcher.cpp"), True, "native C++ hooks",
                headers=("hooks.h",) + _ABI)
ENGINE = LibSpec("engine", "tensorscope_engine",
                 ("engine.cpp", "engine_observer.cpp", "engine_ops.cpp", "engine_buffers.cpp", "engine_gather.cpp"),
                 True, "native recording engine",
                 headers=("engine.h", "engine_storages.h", "engine_screen.h", "engine_fp_runs.h", "engine_known.h") + _ABI)
#: the function mode's hot path (Python C API only; used with the native engine)
FMODE = LibSpec("fmode", "tensorscope_fmode", ("fmode.cpp", "fmode_state.cpp"), True, "native function mode",
                headers=("fmode.h", "fmode_frames.h") + _ABI)


def test_ops_spec(source: str) -> LibSpec:
    """The test-op library built from ``source``: the test suite's tests/native/test_ops.cpp (it is
    not part of the package, nor of the wheel)."""
    return LibSpec("test_ops", "tensorscope_test_ops", os.path.abspath(source), False, "native test-op library")


class _LibState:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.state = "idle"          # idle / building / built / failed
        self.reason = ""
        self.module: Any = None
        self.path: Optional[str] = None
        self.seconds: Optional[float] = None
        self.compiled = False        # compiled in this process (vs loaded from the cache)


_STATES: dict[str, _LibState] = {HOOKS.kind: _LibState(), "test_ops": _LibState(), ENGINE.kind: _LibState(),
                                 FMODE.kind: _LibState()}


def _say(msg: str) -> None:
    try:
        print("tensorscope: " + msg, file=sys.stderr, flush=True)
    except Exception:
        pass


def _notice(msg: str) -> None:
    """One calm line: on stdout in an IPython kernel or shell (a plain output line of the cell, not a
    red stderr one), on stderr elsewhere (a script's stdout stays its own)."""
    from .._common import ipython_shell

    try:
        print("tensorscope: " + msg, file=sys.stdout if ipython_shell() is not None else sys.stderr, flush=True)
    except Exception:
        pass


# ---------------------------------------------------------------------------
# cache location and key
# ---------------------------------------------------------------------------

def cache_root() -> str:
    """``$TENSORSCOPE_CACHE`` if set, else ``~/.cache/tensorscope/native``."""
    env = os.environ.get("TENSORSCOPE_CACHE")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tensorscope", "native")


def file_path(name: str) -> str:
    return os.path.join(_HERE, name)   # an absolute path stays what it is


def source_paths(spec: LibSpec) -> list[str]:
    return [file_path(s) for s in spec.sources]


def files_hash(spec: LibSpec) -> str:
    """One hash over every source and header file of ``spec`` (names and contents), so a change to
    any of them, a header included, is a new build."""
    h = hashlib.sha256()
    for name in spec.files:
        with open(file_path(name), "rb") as f:
            data = f.read()
        h.update(f"{os.path.basename(name)}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def build_key(spec: LibSpec, source_text: Optional[bytes] = None) -> str:
    """The cache key of ``spec``; ``source_text`` stands in for its files' contents (tests)."""
    import torch

    parts = [
        BUILD_RECIPE,
        spec.name,
        files_hash(spec) if source_text is None else hashlib.sha256(source_text).hexdigest(),
        torch.__version__,
        str(getattr(torch.version, "git_version", "")),
        str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "")),
        sys.version,
        sys.implementation.cache_tag or "",
        sys.platform,
        platform.machine(),
        " ".join(CFLAGS),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def build_dir(spec: LibSpec, key: Optional[str] = None) -> str:
    return os.path.join(cache_root(), f"{spec.kind}-{key or build_key(spec)}")


def _so_path(spec: LibSpec, d: str) -> str:
    return os.path.join(d, spec.name + ".so")


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def cached(spec: LibSpec) -> Optional[dict]:
    """The metadata of a finished cached build of ``spec``, or None."""
    d = build_dir(spec)
    meta = _read_json(os.path.join(d, "build.json"))
    if meta and meta.get("ok") and os.path.exists(_so_path(spec, d)):
        meta["dir"] = d
        return meta
    return None


# ---------------------------------------------------------------------------
# toolchain
# ---------------------------------------------------------------------------

def _ninja_dir() -> Optional[str]:
    """Where a ninja binary is, also when the venv's bin/ is not on PATH."""
    found = shutil.which("ninja")
    if found:
        return os.path.dirname(found)
    candidates = [os.path.dirname(sys.executable)]
    try:
        import ninja  # the PyPI package ships the binary

        candidates.insert(0, getattr(ninja, "BIN_DIR", ""))
    except Exception:
        pass
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "ninja")) and os.access(os.path.join(c, "ninja"), os.X_OK):
            return c
    return None


def toolchain_problem() -> Optional[str]:
    """Why nothing can be compiled here, or None when a compiler and ninja exist."""
    cxx = os.environ.get("CXX", "c++")
    if not shutil.which(cxx.split()[0] if cxx.strip() else "c++"):
        return f"no C++ compiler ({cxx!r} is not on PATH)"
    if _ninja_dir() is None:
        return "ninja is not installed (pip install ninja)"
    return None


class _PathWithNinja:
    """Puts ninja's directory on PATH for the build only (cpp_extension runs `ninja`)."""

    def __init__(self, d: Optional[str]):
        self.d = d
        self.old: Optional[str] = None

    def __enter__(self):
        path = os.environ.get("PATH", "")
        if self.d and self.d not in path.split(os.pathsep):
            self.old = path
            os.environ["PATH"] = self.d + os.pathsep + path
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            os.environ["PATH"] = self.old
        return False


# ---------------------------------------------------------------------------
# load / compile
# ---------------------------------------------------------------------------

def _import_built(spec: LibSpec, so: str):
    if not spec.python_module:
        import torch

        torch.ops.load_library(so)
        return so
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(spec.name, so)
    mspec = importlib.util.spec_from_file_location(spec.name, so, loader=loader)
    if mspec is None:
        raise ImportError(f"cannot load {so}")
    mod = importlib.util.module_from_spec(mspec)
    loader.exec_module(mod)
    return mod


_COMPILER_ERROR = re.compile(r":\d+(:\d+)?: (fatal )?error: ")


def _first_error_line(text: str) -> str:
    """The compiler's first diagnostic (file:line:col: error: ...), else the first error-ish line."""
    lines = text.splitlines()
    for pred in (lambda ln: _COMPILER_ERROR.search(ln), lambda ln: "error:" in ln.lower()):
        for line in lines:
            if pred(line):
                return line.strip()[:300]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[-1] if lines else "unknown error")[:300]


def _compile(spec: LibSpec, d: str, verbose: bool):
    """Compile and import; returns the module (or .so path for op libraries)."""
    os.makedirs(d, exist_ok=True)
    with _PathWithNinja(_ninja_dir()):
        from torch.utils import cpp_extension

        return cpp_extension.load(
            name=spec.name,
            sources=source_paths(spec),
            extra_cflags=list(CFLAGS),
            build_directory=d,
            verbose=verbose,
            is_python_module=spec.python_module,
        )


def _load(spec: LibSpec, st: _LibState, *, verbose: bool = False, force: bool = False, announce: bool = True) -> None:
    """Bring ``spec`` to state built or failed (the caller holds ``st.lock``)."""
    try:
        key = build_key(spec)  # imports torch: kept out of the timings below
    except Exception as e:  # torch missing or broken
        st.state, st.reason = "failed", f"cannot compute the build key ({type(e).__name__}: {e})"
        return
    t0 = time.perf_counter()
    d = build_dir(spec, key)
    so = _so_path(spec, d)
    st.path = so
    meta_path = os.path.join(d, "build.json")
    failed_path = os.path.join(d, "failed.json")

    if not force:
        meta = _read_json(meta_path)
        if meta and meta.get("ok") and os.path.exists(so):
            try:
                st.module = _import_built(spec, so)
                st.state, st.compiled = "built", False
                st.seconds = time.perf_counter() - t0
                st.reason = f"loaded from the cache in {st.seconds * 1e3:.1f} ms (compiled in {meta.get('seconds', 0):.1f} s)"
                return
            except Exception as e:
                if announce:
                    _say(f"cached {spec.what} at {d} would not load ({type(e).__name__}: {e}); recompiling")
        failed = _read_json(failed_path)
        if failed and failed.get("key") == key:
            st.state = "failed"
            st.reason = (f"an earlier build failed: {failed.get('error', '?')} (log: {failed.get('log')}); "
                         "`python -m tensorscope build-native --force` retries")
            return

    problem = toolchain_problem()
    if problem:
        st.state, st.reason = "failed", problem
        if announce:
            _say(f"{spec.what} unavailable: {problem}; using the pure-Python fallback")
        return

    import torch

    if announce:
        _say(f"compiling {spec.what} for torch {torch.__version__} (first use only, {BUILD_TIME}; cached in {d}) ...")
    st.state = "building"
    # cpp_extension's lock file: another process is compiling this very build,
    # and cpp_extension.load will wait for it rather than compile.
    waited = os.path.exists(os.path.join(d, "lock"))
    try:
        mod = _compile(spec, d, verbose)
    except BaseException as e:
        text = f"{type(e).__name__}: {e}"
        log = os.path.join(d, "build.log")
        try:
            os.makedirs(d, exist_ok=True)
            with open(log, "w") as f:
                f.write(text)
            _write_json(failed_path, {"key": key, "error": _first_error_line(text), "log": log, "time": time.time()})
        except OSError:
            log = "(not written)"
        st.state = "failed"
        st.reason = f"build failed: {_first_error_line(text)} (log: {log})"
        if announce:
            _say(f"{spec.what} unavailable: {st.reason}; using the pure-Python fallback")
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return
    st.seconds = time.perf_counter() - t0
    st.module = mod if spec.python_module else so
    st.state = "built"
    meta = _read_json(meta_path)
    if waited and meta and meta.get("ok") and meta.get("key") == key:
        # cpp_extension's lock made this process wait while another compiled.
        st.compiled = False
        st.reason = f"compiled by another process ({meta.get('seconds', 0):.1f} s); waited {st.seconds:.1f} s"
        return
    st.compiled = True
    st.reason = f"compiled in {st.seconds:.1f} s"
    try:
        _write_json(meta_path, {
            "ok": True, "key": key, "name": spec.name, "seconds": round(st.seconds, 3),
            "torch": torch.__version__, "python": sys.version.split()[0], "time": time.time(),
        })
        if os.path.exists(failed_path):
            os.remove(failed_path)
    except OSError:
        pass


def ensure(spec: LibSpec, *, wait: bool = True, verbose: bool = False, force: bool = False,
           announce: bool = True) -> tuple[Any, str]:
    """(module or None, reason). ``wait=False`` never blocks on a build in progress."""
    st = _STATES[spec.kind]
    if st.state == "built" and not force:
        return st.module, st.reason
    if not wait and st.state == "building":
        return None, f"{spec.what} still compiling in another thread"
    if not st.lock.acquire(blocking=wait):
        return None, f"{spec.what} still compiling in another thread"
    try:
        if force and st.state == "built" and spec.python_module:
            # A module cannot be replaced in a running process: rebuild the
            # files for the next one, keep using the loaded one.
            loaded = st.module
            _load(spec, st, verbose=verbose, force=True, announce=announce)
            if st.state == "built":
                st.module = loaded
                st.reason += " (rebuilt; this process keeps the module it had loaded)"
        elif st.state != "built" or force:
            if st.state == "failed" and not force:
                return None, st.reason
            _load(spec, st, verbose=verbose, force=force, announce=announce)
    finally:
        st.lock.release()
    return (st.module, st.reason) if st.state == "built" else (None, st.reason)


def lib_status(spec: LibSpec) -> dict[str, Any]:
    st = _STATES[spec.kind]
    out: dict[str, Any] = {"path": st.path, "loaded": st.state == "built", "seconds": st.seconds}
    if st.state == "built":
        out.update(state="built", reason=st.reason, compiled=st.compiled)
        return out
    if st.state == "building":
        out.update(state="building", reason=st.reason)
        return out
    if st.state == "failed":
        out.update(state="fallback", reason=st.reason)
        return out
    try:
        meta = cached(spec)
    except Exception as e:
        out.update(state="fallback", reason=f"cannot inspect the cache ({type(e).__name__}: {e})")
        return out
    if meta is not None:
        out.update(state="built", loaded=False, path=_so_path(spec, meta["dir"]),
                   reason=f"cached build ready (compiled in {meta.get('seconds', 0):.1f} s); loads on first use")
        return out
    problem = toolchain_problem()
    if problem:
        out.update(state="fallback", reason=problem)
    else:
        out.update(state="fallback", reason=f"not built yet: compiles in a background process on first use "
                                            f"({BUILD_TIME} for all three libraries), or ahead of time with "
                                            "`python -m tensorscope build-native`")
    return out
