#!/usr/bin/env bash
# Static data-parallel run on several cloud machines (docs/multinode.md, "Cloud machines").
# Run this same script on every machine, with its own NODE_RANK (0 on the machine at MASTER_ADDR).
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 NNODES=4 ./cloud_static.sh
#   NODE_RANK=1 MASTER_ADDR=10.0.0.1 NNODES=4 ./cloud_static.sh      (and so on)
# Open TCP between the machines: MASTER_PORT on node 0, and ephemeral ports (gloo/NCCL) among all.
set -euo pipefail
: "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}" "${MASTER_ADDR:?set MASTER_ADDR (the private address of node 0)}"
NNODES="${NNODES:-2}"
MASTER_PORT="${MASTER_PORT:-29500}"
PROCS="${PROCS:-1}"   # workers on this machine (GPUs)
exec shoal run --nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" \
    --master-port "$MASTER_PORT" --run-id "${RUN_ID:-cloud-demo}" -n "$PROCS" \
    examples/train_ddp.py --steps 200
