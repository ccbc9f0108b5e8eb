"""Real gloo all-reduce: every rank contributes rank+1; prints the sum and its host id."""
import os

import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
t = torch.full((1000,), float(dist.get_rank() + 1))
dist.all_reduce(t)
print(f"SUM {t[0].item():g} {t[-1].item():g} HOST {os.environ['SHOAL_HOST_ID']}", flush=True)
dist.destroy_process_group()
