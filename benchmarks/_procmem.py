"""This process's memory from /proc/self/status (Linux), shared by the long-cell benchmarks.

``status()``: VmRSS, RssAnon, RssFile and VmHWM in bytes; ``reset_peak()``: VmHWM back to the
current RSS (``/proc/self/clear_refs``); ``AnonSampler``: the largest RssAnon seen every 2 ms
while it runs (anonymous memory is what a trace costs; VmHWM also counts the file-backed pages of
memory-mapped tables, which the kernel may drop at any time).
"""
from __future__ import annotations

import threading
import time

_KEYS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in _KEYS:
                out[k] = int(v.split()[0]) * 1024
    return out


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class AnonSampler(threading.Thread):
    """The largest RssAnon seen every ``every`` seconds from ``start()`` until ``stop()``."""

    def __init__(self, every: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.every, self.peak, self._done = every, 0, threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, status()["RssAnon"])
            time.sleep(self.every)

    def stop(self) -> int:
        """Stop sampling; the peak in bytes (the current RssAnon included)."""
        self._done.set()
        self.join()
        return max(self.peak, status()["RssAnon"])
