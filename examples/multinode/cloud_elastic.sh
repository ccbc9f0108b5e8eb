#!/usr/bin/env bash
# Elastic run on cloud or spot machines (docs/multinode.md, "Spot machines that vanish").
# One small on-demand machine runs the coordinator:
#   SHOAL_TOKEN=$(cat token) shoal coordinator --host 0.0.0.0 --port 29400 --initial-workers 2
# Every training machine (they may start late, vanish and come back) runs this script:
#   SHOAL_TOKEN=$(cat token) COORDINATOR=10.0.0.9:29400 NNODES=8 NODE_RANK=3 ./cloud_elastic.sh
# NNODES is the most machines the run will have; NODE_RANK (0..NNODES-1) keeps workers' labels apart.
# RUN_ID: a new one for each run on a coordinator that stays up (it refuses a run id whose workers finished).
set -euo pipefail
: "${SHOAL_TOKEN:?set SHOAL_TOKEN (the token of the coordinator; keep it out of command lines)}"
: "${COORDINATOR:?set COORDINATOR=HOST:PORT of shoal coordinator}" "${NODE_RANK:?set NODE_RANK (labels this machine)}"
exec shoal run --elastic --coordinator "$COORDINATOR" --nnodes "${NNODES:-8}" --node-rank "$NODE_RANK" --run-id "${RUN_ID:-spot-demo}" \
    -n "${PROCS:-1}" --min-workers "${MIN_WORKERS:-1}" --max-restarts 3 \
    examples/train_ddp.py --steps 200 --elastic
