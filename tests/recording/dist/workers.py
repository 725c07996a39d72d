"""Multi-process workers for tests/recording/test_distributed.py: real processes, gloo, loopback only.

    python tests/recording/dist/workers.py spawn ROOT PORT   # mp.spawn, 2 ranks: DDP step, direct + functional collectives
    python tests/recording/dist/workers.py kill ROOT PORT    # rank 1 is SIGKILLed mid-trace; rank 0 writes its parts
"""
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tensorscope


def _init(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))


def spawn_worker(rank, root, port):
    torch.manual_seed(0)
    # the trace starts before init_process_group and ends after destroy_process_group
    with tensorscope.trace(dataset=root, leaks=False, sync_clocks=True):
        _init(rank, port)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
        model(torch.randn(2, 8)).sum().backward()
        x = torch.full((4,), float(rank + 1))
        dist.all_reduce(x)
        dist.broadcast(x, src=0)
        outs = [torch.zeros(4) for _ in range(2)]
        dist.all_gather(outs, x)
        out = torch.zeros(2)
        dist.reduce_scatter_tensor(out, torch.ones(4))
        dist.barrier()
        from torch.distributed import _functional_collectives as fc

        y = fc.all_reduce(x, "sum", dist.group.WORLD)
        (y + 1).sum()
        if rank == 1:   # a rank whose work differs
            torch.randn(3).exp()
        dist.destroy_process_group()


def kill_worker(rank, root, port):
    with tensorscope.trace(dataset=root, leaks=False):
        _init(rank, port)
        x = torch.ones(4)
        dist.all_reduce(x)
        dist.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)   # dies mid-trace: writes nothing
        for _ in range(20):
            x = x * 2
    # no destroy_process_group: the peer is gone


if __name__ == "__main__":
    mode, root, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "spawn":
        mp.spawn(spawn_worker, args=(root, port), nprocs=2, join=True)
    else:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=kill_worker, args=(r, root, port)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        print("exitcodes", [p.exitcode for p in procs])
        sys.exit(0 if procs[0].exitcode == 0 and procs[1].exitcode == -signal.SIGKILL else 1)
