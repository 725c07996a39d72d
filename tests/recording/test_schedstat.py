"""The waits for a CPU a trace records (recording/schedstat.py): the recording thread's and the longest
of any one thread of the process (an intra-op worker another process pushed off its core)."""
from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

import tensorscope
from tensorscope.recording.schedstat import longest_wait, thread_delay_ns, threads_delay_ns

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="schedstat is Linux's")


def test_longest_wait_reads_each_thread_once_and_counts_a_thread_born_in_between():
    assert longest_wait({1: 100, 2: 50}, {1: 130, 2: 90, 3: 25}) == 40   # thread 2 waited 40 ns more
    assert longest_wait({1: 100}, {1: 100, 7: 60}) == 60                # a new thread: all of its wait
    assert longest_wait({1: 100, 2: 5}, {1: 90}) == 0                   # ended threads, no negative waits
    assert longest_wait(None, {1: 1}) is None and longest_wait({1: 1}, None) is None


@linux
def test_every_thread_of_the_process_is_read_and_the_trace_records_both_waits():
    stop = threading.Event()
    th = threading.Thread(target=stop.wait)
    th.start()
    try:
        got = threads_delay_ns()
        assert got is not None and threading.get_native_id() in got and th.native_id in got
        assert all(v >= 0 for v in got.values())
        assert thread_delay_ns() is not None
    finally:
        stop.set()
        th.join()
    with tensorscope.trace(leaks=False) as t:
        torch.ones(64, 64) @ torch.ones(64, 64)
        time.sleep(0.001)
    md = t.metadata
    assert isinstance(md.get("run_delay_ns"), int) and isinstance(md.get("worker_run_delay_ns"), int)
    assert md["worker_run_delay_ns"] >= 0 and md["run_delay_ns"] >= 0
