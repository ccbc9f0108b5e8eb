"""Prints the launcher's environment contract as JSON, and one line on stderr."""
import json
import os
import sys

KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
        "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SHOAL_HOST_ID", "GLOO_SOCKET_IFNAME", "EXTRA"]
print("ENV " + json.dumps({k: os.environ.get(k) for k in KEYS} | {"argv": sys.argv[1:]}))
print(f"to-stderr rank={os.environ['RANK']}", file=sys.stderr)
