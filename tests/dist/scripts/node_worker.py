"""A worker of a run across machines: DDP one step, then write what it saw (tests/dist/test_multinode.py)."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import shoal

torch.set_num_threads(1)
out = sys.argv[1]
if os.environ.get("FAIL_RANK", "-") == os.environ.get("RANK"):
    sys.exit(3)  # before the first collective: the others' start-up or first all-reduce must not hang
shoal.init(timeout=60)
model = torch.nn.Linear(4, 2)
ddp = shoal.DistributedDataParallel(model)
torch.manual_seed(100 + dist.get_rank())
ddp(torch.randn(3, 4)).sum().backward()
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
        "GLOO_SOCKET_IFNAME", "SHOAL_ADVERTISE_ADDR", "SHOAL_HOST_ID")
rec = {"env": {k: os.environ.get(k) for k in keys}, "rank": dist.get_rank(), "world": dist.get_world_size(),
       "weight0": model.weight.detach().tolist(), "grad": model.weight.grad.tolist()}
with open(os.path.join(out, f"{dist.get_rank()}.json.tmp"), "w") as f:
    json.dump(rec, f)
os.replace(os.path.join(out, f"{dist.get_rank()}.json.tmp"), os.path.join(out, f"{dist.get_rank()}.json"))
time.sleep(float(os.environ.get("SLEEP_AFTER", "0")))  # a test stops the run from outside meanwhile
dist.barrier()
dist.destroy_process_group()
