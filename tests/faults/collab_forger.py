"""A process that reaches the coordinator's store but lacks the run token, forging progress records.

For ``--seconds`` it rewrites ``<run>/progress/<id>`` for ids 1..``--ids`` with
a record claiming epoch 10**6, a settled peer and 10**9 samples/s: once signed
the way a member would sign it but with ``--token`` (a wrong token: it can read
every join nonce, not the run token), once as the unsigned JSON a reader
without MAC checks would take. Prints ``ready`` once connected, and at the
end how many records it wrote.

    python collab_forger.py --coordinator 127.0.0.1:29400 --run RUN --token wrong-token-1
"""

from __future__ import annotations

import argparse
import json
import time

from shoal.collaborative.records import RecordBook
from shoal.membership.coordinator import connect
from forked import run_and_end

LIE = {"epoch": 10**6, "settled": True, "samples": 0, "sps": 1e9, "role": "peer"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--ids", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=10.0)
    a = ap.parse_args()
    store = connect(a.coordinator, timeout=10.0)
    print("ready", flush=True)
    written, t_end = 0, time.monotonic() + a.seconds
    while time.monotonic() < t_end:
        for m in range(1, a.ids + 1):
            if not store.check([f"{a.run}/auth/{m}/nonce"]):
                continue
            rec = {**LIE, "t": time.time()}
            signed = RecordBook(store, a.run, m, a.token).seal(rec)
            store.set(f"{a.run}/progress/{m}", signed if written % 2 == 0 else json.dumps({**rec, "by": m}))
            written += 1
        time.sleep(0.02)
    print(f"forged {written} records", flush=True)


if __name__ == "__main__":
    run_and_end(main)   # the interpreter's ending without its finalization (forked.py)
