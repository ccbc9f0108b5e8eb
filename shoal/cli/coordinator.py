"""`shoal coordinator`: a standalone coordinator for elastic runs.

Workers reach it with ``SHOAL_COORDINATOR=HOST:PORT`` (or
``ElasticGroup(coordinator="HOST:PORT")``, or ``shoal run --elastic
--coordinator HOST:PORT``). One coordinator serves any number of runs, told
apart by their run id. It holds no training state; stop it with Ctrl-C. If it dies, restart it with the
same address and token: the workers re-announce themselves and the run goes on
(docs/elastic.md, "When the coordinator fails").

It admits only workers that prove they hold the run token (an HMAC
challenge; the token never travels): ``--token``, else ``$SHOAL_TOKEN``;
without either it refuses to start (elastic workers require a token). Give
the workers the same token (``SHOAL_TOKEN``, ``shoal run --token``).

Examples::

    SHOAL_TOKEN=s3cret-token shoal coordinator --port 29400
    shoal coordinator --host 0.0.0.0 --port 29400 --initial-workers 4 --token s3cret-token
    shoal coordinator --host 0.0.0.0 --port 29400 --liveness-port 29401   # a firewall with two fixed ports
"""

from __future__ import annotations

import argparse
import os
import sys

from shoal.membership.coordinator import Coordinator
from shoal.membership.recovery import CLAIM_GRACE_S
from shoal.errors import ShoalError


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="shoal coordinator", description="Serve membership and quorums for elastic runs.")
    p.add_argument("--port", type=int, required=True, help="TCP port to listen on (0: any free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--initial-workers", type=int, default=1,
                   help="a run's first quorum waits for this many workers (default 1)")
    p.add_argument("--liveness-port", type=int, default=0,
                   help="TCP port of the workers' liveness links, which tell a dead worker's process at once "
                        "(default 0: any free one; fix it to open a firewall for it, docs/elastic.md)")
    p.add_argument("--token", default=None,
                   help="the run token workers must prove (default $SHOAL_TOKEN; one of them is required); "
                        "visible in `ps`, so prefer $SHOAL_TOKEN on shared machines")
    ns = p.parse_args(argv)
    token = ns.token if ns.token is not None else os.environ.get("SHOAL_TOKEN")
    try:
        if not token:
            raise ShoalError("no run token: pass --token or set $SHOAL_TOKEN (at least 8 characters); "
                             "elastic workers join only a coordinator that authenticates them")
        # A restart at the same address: the members of a run that outlived the last coordinator
        # re-announce themselves within CLAIM_GRACE_S, before a newcomer may start a run's first quorum.
        coord = Coordinator(port=ns.port, host=ns.host, initial_workers=ns.initial_workers, token=token,
                            claim_grace=CLAIM_GRACE_S, liveness_port=ns.liveness_port)
    except ShoalError as e:
        print(f"shoal coordinator: error: {e}", file=sys.stderr)
        return 2
    print(f"shoal coordinator: serving on {coord.address} (liveness links on port {coord.liveness_port})",
          file=sys.stderr, flush=True)
    try:
        coord.serve_forever()
    except KeyboardInterrupt:
        return 0
    return 0
