"""The background build of the native libraries (built, cached and loaded by _build.py).

The first trace never waits on the compiler: when a library a trace uses
(``TRACE_LIBS``) has no cached build, ``background(TRACE_LIBS)`` starts
``background_main`` in a detached process (its output goes to a log file in the
cache) and returns the reason the trace records with the python engine; the
next trace after it finished loads the cached builds (milliseconds). One builder
at a time per cache (an ``flock`` on ``background.lock``; cpp_extension's own
lock file guards each build directory besides); a failed background build is
said once, with its log, and remembered like any failed build.
``TENSORSCOPE_NATIVE_BUILD=foreground`` compiles in the first trace instead
(blocking, as ``build-native`` does).

Nothing here runs at import: the package facade calls in on first use.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from typing import Optional

from ._build import (
    _HERE,
    _STATES,
    BUILD_TIME,
    ENGINE,
    FMODE,
    HOOKS,
    LibSpec,
    _notice,
    _read_json,
    _so_path,
    _write_json,
    build_dir,
    build_key,
    cache_root,
    ensure,
    lib_status,
    toolchain_problem,
)

#: the libraries a trace uses: the warning/error hooks, the recording engine, its function mode
TRACE_LIBS = (HOOKS, ENGINE, FMODE)
#: ``foreground``: the first trace compiles what is missing and waits (the behaviour before the
#: background build); anything else (the default): a background process compiles it
BUILD_ENV = "TENSORSCOPE_NATIVE_BUILD"
#: Test-only: seconds the background builder sleeps, holding its lock, before it compiles (so a test
#: can trace while a build is running); never set it otherwise.
TEST_DELAY_ENV = "TENSORSCOPE_TEST_BUILD_DELAY"


class _Background:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: Optional[subprocess.Popen] = None   # the builder this process started
        self.started: Optional[float] = None
        self.log: Optional[str] = None
        self.announced = False      # the start line was said (once per process)
        self.seen = False           # a trace of this process recorded with the python engine for a build
        self.reported: set[str] = set()   # status files whose failure was said


_BG = _Background()


def foreground() -> bool:
    return os.environ.get(BUILD_ENV, "").strip().lower() == "foreground"


def background_files() -> tuple[str, str, str]:
    """(lock file, status file, log file) of the background builder, in the cache root."""
    root = cache_root()
    return (os.path.join(root, "background.lock"), os.path.join(root, "background.json"),
            os.path.join(root, "background-build.log"))


def _missing(specs: tuple[LibSpec, ...]) -> list[LibSpec]:
    """The libraries of ``specs`` a trace would compile now: not loaded, no cached build and no
    remembered failure of this very build (a remembered failure, or a missing compiler, is a fast
    fallback already, not a reason to build)."""
    out = []
    for spec in specs:
        st = _STATES[spec.kind]
        if st.state in ("built", "failed"):
            continue
        try:
            key = build_key(spec)
        except Exception:
            continue   # _load reports it
        d = build_dir(spec, key)
        meta = _read_json(os.path.join(d, "build.json"))
        if meta and meta.get("ok") and os.path.exists(_so_path(spec, d)):
            continue
        failed = _read_json(os.path.join(d, "failed.json"))
        if failed and failed.get("key") == key:
            continue
        out.append(spec)
    return out


def _locked_by_other(lock_path: str) -> bool:
    """True when a builder holds the lock (another process, or our own child)."""
    try:
        import fcntl
    except ImportError:   # no flock (Windows): our own child is all we know of
        return False
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _spawn(log: str) -> subprocess.Popen:
    pkg_parent = os.path.dirname(os.path.dirname(_HERE))   # the directory holding this tensorscope package
    code = (f"import sys; sys.path.insert(0, {pkg_parent!r}); "
            "from tensorscope.native import _background; sys.exit(_background.background_main())")
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, close_fds=True, start_new_session=True)


def _report_failure(status_path: str) -> None:
    """Say a finished background build's failure once per process (with the log to read)."""
    st = _read_json(status_path)
    if not st or st.get("state") != "failed":
        return
    tag = f"{status_path}:{st.get('finished')}"
    if tag in _BG.reported:
        return
    _BG.reported.add(tag)
    why: dict[str, list[str]] = {}   # the reason (its per-library log path cut off) -> the libraries
    for kind, v in (st.get("libs") or {}).items():
        if v.get("state") != "built":
            why.setdefault(re.sub(r" \(log: [^)]*\)$", "", str(v.get("reason", "?"))), []).append(kind)
    said = "; ".join(f"{', '.join(kinds)}: {r}" for r, kinds in why.items()) or "?"
    _notice(f"the background build of the native parts failed ({said}; log: {st.get('log')}); "
            "traces keep the python engine; `python -m tensorscope build-native --force` retries.")


def background(specs: tuple[LibSpec, ...] = TRACE_LIBS) -> Optional[str]:
    """None when every library of ``specs`` is loaded, cached or known not to build (a trace then
    loads it in milliseconds, or takes its fallback at once); otherwise a background process builds
    them (started now unless one is running) and this returns why the trace records with the python
    engine. Never blocks on a compiler; says the start in one calm line (once per process).
    ``TENSORSCOPE_NATIVE_BUILD=foreground``: always None (the trace compiles and waits)."""
    if all(_STATES[s.kind].state in ("built", "failed") for s in specs):
        return None   # the fast path of every trace after the first (a failure in this process is final)
    if foreground():
        return None
    lock, status_path, log = background_files()
    with _BG.lock:
        proc = _BG.proc
        if proc is not None and proc.poll() is not None:
            _BG.proc = proc = None     # ours finished: its builds are cached (or their failures remembered)
        missing = _missing(specs)
        if not missing:
            if _BG.seen:   # a build this process waited for finished: its failure, if any, said once
                _report_failure(status_path)
            return None
        if toolchain_problem() is not None:
            return None   # _load says so and takes the fallback at once
        what = ", ".join(s.what for s in missing)
        _BG.seen = True
        if proc is not None or _locked_by_other(lock):
            since = f" for {time.time() - _BG.started:.0f} s" if proc is not None and _BG.started else ""
            return f"the native parts ({what}) are compiling in a background process{since} (log: {log})"
        try:
            os.makedirs(os.path.dirname(lock), exist_ok=True)
            _BG.proc = _spawn(log)
        except OSError as e:
            return f"the native parts ({what}) are not built and the background build could not start ({e})"
        _BG.started, _BG.log = time.time(), log
        if not _BG.announced:
            _BG.announced = True
            _notice(f"compiling the native parts in the background (first use only, {BUILD_TIME}; log: {log}). "
                    "Until then traces record with the python engine.")
        return f"the native parts ({what}) started compiling in a background process (log: {log})"


def background_main() -> int:
    """The background builder (run by ``background`` in its own process, output to the log): holds
    the builder lock, builds ``TRACE_LIBS`` (a build another process finished meanwhile just loads),
    writes ``background.json``. 0 when all built."""
    lock, status_path, log = background_files()
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)   # one builder at a time: a second waits, then finds the cache
        except ImportError:
            pass
        t0 = time.time()
        print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] background build of the native parts, pid {os.getpid()}",
              flush=True)
        _write_json(status_path, {"state": "running", "pid": os.getpid(), "started": t0, "log": log})
        delay = float(os.environ.get(TEST_DELAY_ENV, "0") or 0)
        if delay > 0:
            print(f"{TEST_DELAY_ENV}={delay:g}: sleeping before the build (test only)", flush=True)
            time.sleep(delay)
        libs = {}
        for spec in TRACE_LIBS:
            ensure(spec, wait=True, announce=True)
            st = lib_status(spec)
            libs[spec.kind] = {"state": st["state"], "reason": st["reason"]}
            print(f"{spec.what}: {st['state']} ({st['reason']})", flush=True)
        ok = all(v["state"] == "built" for v in libs.values())
        _write_json(status_path, {"state": "done" if ok else "failed", "pid": os.getpid(), "started": t0,
                                  "finished": time.time(), "seconds": round(time.time() - t0, 3), "log": log,
                                  "libs": libs})
        return 0 if ok else 1
    finally:
        os.close(fd)   # releases the lock
