"""Announces its pid, then sleeps; `--fail RANK CODE` makes RANK exit with CODE at once,
`--exit-after S` makes every rank exit 0 after S seconds (default: sleep 120)."""
import argparse
import os
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--fail", nargs=2, type=int, default=None)
p.add_argument("--exit-after", type=float, default=120.0)
a = p.parse_args()
rank = int(os.environ["RANK"])
print(f"READY pid={os.getpid()}", flush=True)
if a.fail and a.fail[0] == rank:
    time.sleep(0.3)
    sys.exit(a.fail[1])
time.sleep(a.exit_after)
print("DONE", flush=True)
