"""Who this process is in a multi-rank job, which run it belongs to, and its clock offset to rank 0.

Decided as late as possible: a trace may start before
``init_process_group`` and a script usually calls ``destroy_process_group``
before the trace ends, so ``DistContext.capture()`` runs at the trace start,
at its first collective and at its end, and keeps what it learned while the
process group was alive.

* Rank: ``torch.distributed`` when initialised, else ``RANK/WORLD_SIZE/LOCAL_RANK``
  (torchrun), ``SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID``, ``OMPI_COMM_WORLD_*``,
  else rank 0 of 1.
* Run id: ``TENSORSCOPE_RUN_ID``; else ``TORCHELASTIC_RUN_ID`` (unless ``none``,
  as under static rendezvous); else agreed through the process group's store
  (every rank proposes, ``compare_set`` keeps the first: no collective, nothing
  dispatched); else the SLURM job/step; else one id per process. Always starts
  with a letter and holds only ``[A-Za-z0-9_.-]`` (no ``=``, ``/``, ``:``; not
  date-like), so every engine reads the hive partition as a string.
* Clock: an anchor pair (``time_ns``, ``perf_counter_ns``) per trace; with
  ``sync_clocks=True`` the offset to rank 0 is measured by send/recv ping-pong
  on a gloo group (the default group when it is gloo, else a gloo group made
  once), keeping the shortest of 16 round trips; bounded in time. It runs with
  every Python mode disabled, so neither the trace nor a user's mode sees it.
"""
from __future__ import annotations

import os
import re
import socket
import time
import uuid
from datetime import timedelta
from typing import Any, Optional

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_process_run_id: Optional[str] = None
_STORE_KEY = "tensorscope/run_id"
_gloo_group: Any = None   # a torch ProcessGroup, made once


def sanitize_run_id(s: str) -> str:
    s = _SAFE.sub("-", str(s)).strip("-.") or "run"
    if not s[0].isalpha():
        s = "r" + s
    return s[:128]


def env_identity() -> dict[str, Any]:
    """Rank identity from the environment a launcher sets."""
    e = os.environ
    for src, r, w, lr in (("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
                          ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
                          ("ompi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")):
        if r in e and w in e:
            try:
                return {"rank": int(e[r]), "world_size": int(e[w]), "local_rank": int(e.get(lr, e[r])),
                        "rank_source": src}
            except ValueError:
                continue
    return {"rank": 0, "world_size": 1, "local_rank": 0, "rank_source": "default"}


def _dist() -> Any:
    """``torch.distributed`` when a process group is live, else None."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist
    except Exception:
        pass
    return None


def attempt() -> int:
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def local_run_id() -> str:
    global _process_run_id
    if _process_run_id is None:
        _process_run_id = "r" + uuid.uuid4().hex[:16]
    return _process_run_id


def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # unannotated in torch
            return f"cuda:{torch.cuda.current_device()}"
    except Exception:
        pass
    return "cpu"


class DistContext:
    """What one trace learns about its rank; holds no process group, no tensor."""

    def __init__(self, sync_clocks: bool = False, sync_timeout_s: float = 10.0) -> None:
        self.identity = env_identity()
        self.run_id: Optional[str] = None
        self.run_source: Optional[str] = None
        self.backend: Optional[str] = None
        self.sync_clocks = sync_clocks
        self.sync_timeout_s = sync_timeout_s
        self.clock: Optional[tuple[int, int]] = None       # (offset_ns, error_ns) at the start
        self.clock_end: Optional[tuple[int, int]] = None
        self.notes: list[str] = []
        self.anchor_unix_ns = 0
        self.anchor_perf_ns = 0

    def set_anchor(self, perf_ns: int) -> None:
        """Anchor the trace start (perf_counter ``perf_ns``) to the wall clock."""
        now_perf, now_unix = time.perf_counter_ns(), time.time_ns()
        self.anchor_perf_ns = perf_ns
        self.anchor_unix_ns = now_unix - (now_perf - perf_ns)

    def capture(self, *, end: bool = False) -> None:
        """Read identity/run id from a live process group (and sync clocks when asked). Never raises."""
        dist = _dist()
        if dist is None:
            return
        try:
            self.identity = {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
                             "local_rank": int(os.environ.get("LOCAL_RANK", self.identity.get("local_rank", 0))),
                             "rank_source": "dist"}
            self.backend = str(dist.get_backend())
        except Exception as e:
            self.notes.append(f"rank identity from torch.distributed failed: {e}")
        if self.run_id is None:
            self._agree_run_id(dist)
        if self.sync_clocks and self.identity["world_size"] > 1:
            if not end and self.clock is None:
                self.clock = self._sync(dist)
            elif end:
                self.clock_end = self._sync(dist)

    def _agree_run_id(self, dist: Any) -> None:
        fixed = self._fixed_run_id()
        if fixed is not None:
            self.run_id, self.run_source = fixed
            return
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
            got = store.compare_set(_STORE_KEY, "", local_run_id())
            self.run_id = sanitize_run_id(got.decode() if isinstance(got, bytes) else got)
            self.run_source = "store"
        except Exception as e:
            self.notes.append(f"could not agree the run id through the process group's store: {e}")

    @staticmethod
    def _fixed_run_id() -> Optional[tuple[str, str]]:
        e = os.environ
        if e.get("TENSORSCOPE_RUN_ID"):
            return sanitize_run_id(e["TENSORSCOPE_RUN_ID"]), "env"
        rid = e.get("TORCHELASTIC_RUN_ID")
        if rid and rid.lower() != "none":
            return sanitize_run_id(rid), "torchelastic"
        return None

    def resolve(self) -> dict[str, Any]:
        """Identity, run id and attempt as decided now (at write time)."""
        if self.run_id is None:
            fixed = self._fixed_run_id()
            if fixed is not None:
                self.run_id, self.run_source = fixed
            elif os.environ.get("SLURM_JOB_ID"):
                self.run_id = sanitize_run_id(f"slurm{os.environ['SLURM_JOB_ID']}-{os.environ.get('SLURM_STEP_ID', '0')}")
                self.run_source = "slurm"
            else:
                self.run_id, self.run_source = local_run_id(), "local"
        return {**self.identity, "run_id": self.run_id, "run_source": self.run_source, "attempt": attempt(),
                "host": socket.gethostname(), "pid": os.getpid(), "device": _device(), "backend": self.backend}

    # -- clocks -----------------------------------------------------------------
    def _sync(self, dist: Any) -> Optional[tuple[int, int]]:
        try:
            return ping_pong(dist, timeout_s=self.sync_timeout_s)
        except Exception as e:
            self.notes.append(f"clock sync failed ({type(e).__name__}: {e}); clock_synced=false")
            return None


def _gloo(dist: Any) -> Any:
    """A gloo group for the ping-pong: the default one when it is gloo (no new collective)."""
    global _gloo_group
    if str(dist.get_backend()) == "gloo":
        return None
    if _gloo_group is None:
        _gloo_group = dist.new_group(backend="gloo")
    return _gloo_group


def ping_pong(dist: Any, rounds: int = 16, timeout_s: float = 10.0) -> tuple[int, int]:
    """(offset_ns, error_ns): add offset_ns to this rank's ``time_ns`` to get rank 0's; error is half
    the shortest round trip. Collective: every rank of the default group must call it."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    from .engines import unobserved

    rank, world = dist.get_rank(), dist.get_world_size()
    deadline = time.monotonic() + timeout_s

    # invisible to every Python mode, to the native engine and to a user's torch.profiler: the
    # send/recv run with RecordFunction off on this thread (engines.unobserved)
    def run() -> tuple[int, int]:
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            group = _gloo(dist)
            buf = torch.zeros(2, dtype=torch.int64)

            def wait(w: Any) -> None:
                left = deadline - time.monotonic()
                if left <= 0 or not w.wait(timedelta(seconds=max(left, 0.001))):
                    raise TimeoutError(f"clock ping-pong exceeded {timeout_s:.0f} s")

            if rank == 0:
                for r in range(1, world):
                    best: Optional[tuple[int, int]] = None
                    for _ in range(rounds):
                        t1 = time.time_ns()
                        wait(dist.isend(buf, dst=r, group=group))
                        wait(dist.irecv(buf, src=r, group=group))
                        t2 = time.time_ns()
                        rtt = t2 - t1
                        if best is None or rtt < best[1]:
                            best = ((t1 + t2) // 2 - int(buf[0]), rtt)
                    assert best is not None   # rounds >= 1
                    buf[0], buf[1] = best[0], best[1] // 2 + 1
                    wait(dist.isend(buf, dst=r, group=group))
                return 0, 0
            for _ in range(rounds):
                wait(dist.irecv(buf, src=0, group=group))
                buf[0] = time.time_ns()
                wait(dist.isend(buf, dst=0, group=group))
            wait(dist.irecv(buf, src=0, group=group))
            return int(buf[0]), int(buf[1])

    return unobserved(run)
