"""How long threads waited for a CPU (Linux ``schedstat``: the second field, time spent runnable but
not running), read at a trace's start and stop. A busy machine shows there: the recording thread's
wait (``metadata["run_delay_ns"]``) lies in the gaps between ops and in the ops themselves, and so
does a worker's (``metadata["worker_run_delay_ns"]``, the longest wait of any one thread of the
process): an intra-op parallel kernel waits at its barrier for a worker another process pushed off
its core, which the recording thread's own wait does not show. Elsewhere both are None."""
from __future__ import annotations

import os
from typing import Optional


def thread_delay_ns() -> Optional[int]:
    """This thread's wait for a CPU so far (``/proc/thread-self/schedstat``), or None."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


def threads_delay_ns() -> Optional[dict[int, int]]:
    """Every thread of the process: tid -> its wait for a CPU so far (``/proc/self/task/*/schedstat``)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    out = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue   # a thread that ended in between
    return out or None


def longest_wait(before: Optional[dict[int, int]], after: Optional[dict[int, int]]) -> Optional[int]:
    """The longest wait of any one thread between the two readings (a thread born in between: all of its)."""
    if before is None or after is None:
        return None
    return max((max(v - before.get(t, 0), 0) for t, v in after.items()), default=0)
