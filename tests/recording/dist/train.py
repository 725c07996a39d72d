"""A DDP training script for ``torchrun ... -m tensorscope run --out DIR tests/recording/dist/train.py``.

On the first attempt (TORCHELASTIC_RESTART_COUNT=0) with ``--fail-once``, rank 1 exits
with status 3 after its step, so torchrun restarts the group: attempt 1 must write new
parts next to attempt 0's, never over them.
"""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=120))   # a lost peer fails, never hangs
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
opt.zero_grad()
model(torch.randn(4, 8)).sum().backward()
opt.step()
dist.barrier()
dist.destroy_process_group()
if "--fail-once" in sys.argv and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and rank == 1:
    time.sleep(2)   # let rank 0 finish writing before the agent tears the group down
    sys.exit(3)
