"""One peer of the collaborative tests as a process (for the tests that SIGKILL and restart peers).

Started by harness.py (``script="collab_worker.py"``) with ``--spec JSON``:
``{"common": {Spec fields}, "ranks": {"2": {Spec fields for rank 2}}}``.
It runs :func:`collab_peer.train` and writes ``<out>/<rank>-<life>.pt``
before leaving the swarm.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from collab_peer import Spec, train
from forked import run_and_end


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--spec", required=True, help='{"common": {...}, "ranks": {"RANK": {...}}}')
    ap.add_argument("--token", default="run-token-123")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if os.environ.get("SHOAL_COLLAB_DEBUG"):
        import logging
        logging.basicConfig(level=logging.DEBUG, format="%(relativeCreated)d %(message)s")
    rank, life = int(os.environ["RANK"]), int(os.environ.get("SHOAL_RESTART", "0"))
    spec_json = json.loads(a.spec)
    spec = Spec(rank=rank, **{**spec_json.get("common", {}), **spec_json.get("ranks", {}).get(str(rank), {})})
    path = os.path.join(a.out, f"{rank}-{life}.pt")

    def save(result: dict) -> None:   # written before the peer lingers and leaves
        torch.save(result, path + ".tmp")
        os.replace(path + ".tmp", path)
    train(spec, os.environ["SHOAL_RUN_ID"], os.environ["SHOAL_COORDINATOR"], a.token, life=life, on_result=save)


if __name__ == "__main__":
    run_and_end(main)   # the interpreter's ending without its finalization (forked.py)
