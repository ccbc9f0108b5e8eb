"""The guides' launch files (examples/multinode/) really launch what docs/multinode.md says.

Each file runs with fake `shoal`, `srun` and `scontrol` on PATH: the fake `shoal` records its argv, which
then goes through `shoal run`'s own parser and checks (nothing is started).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.cli import run as shoal_run
from shoal.cli.nodes import NodeSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "multinode"


def _fakes(tmp: Path) -> dict[str, str]:
    bin_ = tmp / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "shoal").write_text(f"#!{sys.executable}\nimport json, sys\n"
                                f"open({str(tmp / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    # scontrol: two hosts.
    # srun: drop its own --options, run the rest as the task of node 1 (the batch step itself is node 0).
    (bin_ / "srun").write_text("#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\n"
                               "export SLURM_NODEID=1\nexec \"$@\"\n")
    (bin_ / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'gpu-node-07\\ngpu-node-08\\n'\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}"}


def _parse(argv: list[str]) -> tuple[object, NodeSpec | None, list[str]]:
    assert argv[0] == "run", argv
    own, module, program = shoal_run._split_argv(argv[1:])
    ns = shoal_run._parser().parse_args(own)
    return shoal_run._elastic(ns), shoal_run._nodes(ns), program


def _launch(tmp: Path, argv: list[str], **env: str) -> list[str]:
    subprocess.run(argv, env={**_fakes(tmp), **env}, check=True, timeout=30, cwd=EXAMPLES.parents[1])
    return list(json.loads((tmp / "argv.json").read_text()))


@pytest.mark.parametrize("name", ["cloud_static.sh", "cloud_elastic.sh", "slurm.sbatch"])
def test_scripts_are_valid_bash(name: str) -> None:
    subprocess.run(["bash", "-n", str(EXAMPLES / name)], check=True, timeout=10)


def test_cloud_static_launches_node_rank_against_the_master(tmp_path: Path) -> None:
    argv = _launch(tmp_path, ["bash", str(EXAMPLES / "cloud_static.sh")], NODE_RANK="1", MASTER_ADDR="10.0.0.1",
                   NNODES="4", PROCS="2")
    elastic, nodes, program = _parse(argv)
    assert elastic is None and nodes == NodeSpec(4, 1, "10.0.0.1", 29500, run_id="cloud-demo")
    assert program[0] == "examples/train_ddp.py" and (EXAMPLES.parents[1] / program[0]).exists()


def test_cloud_elastic_needs_the_token_and_names_the_coordinator(tmp_path: Path) -> None:
    env = {"COORDINATOR": "10.0.0.9:29400", "NODE_RANK": "3"}
    missing = subprocess.run(["bash", str(EXAMPLES / "cloud_elastic.sh")], capture_output=True, text=True,
                             env={**_fakes(tmp_path), **env}, timeout=30)
    assert missing.returncode != 0 and "SHOAL_TOKEN" in missing.stderr
    argv = _launch(tmp_path, ["bash", str(EXAMPLES / "cloud_elastic.sh")], SHOAL_TOKEN="t" * 24, **env)
    elastic, nodes, program = _parse(argv)
    assert elastic is not None and elastic.coordinator == "10.0.0.9:29400"  # type: ignore[attr-defined]
    assert nodes is not None and (nodes.nnodes, nodes.node_rank, nodes.run_id) == (8, 3, "spot-demo")
    assert "--token" not in argv  # the token travels in the environment, not on the command line
    assert program[-1] == "--elastic"


def test_slurm_batch_script_runs_one_launcher_per_node(tmp_path: Path) -> None:
    argv = _launch(tmp_path, ["bash", str(EXAMPLES / "slurm.sbatch")], SLURM_JOB_NODELIST="gpu-node-[07-08]",
                   SLURM_JOB_NUM_NODES="2", SLURM_NODEID="0", SLURM_JOB_ID="42", SLURM_GPUS_ON_NODE="4",
                   SLURM_CPUS_PER_TASK="8")
    elastic, nodes, program = _parse(argv)
    # The node rank is the task's own $SLURM_NODEID (expanded inside srun's task, not in the batch step).
    assert elastic is None and nodes == NodeSpec(2, 1, "gpu-node-07", 20042, run_id="slurm-42")
    assert argv[argv.index("-n") + 1] == "4"
    sbatch = (EXAMPLES / "slurm.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1" in sbatch


def test_kubernetes_indexed_job_reaches_the_coordinator_service(tmp_path: Path) -> None:
    text = (EXAMPLES / "k8s_elastic.yaml").read_text()
    assert re.search(r"^\s+completionMode: Indexed$", text, re.M)
    service_port = re.search(r"kind: Service.*?- port: (\d+)", text, re.S)
    assert service_port is not None
    args = re.search(r"args:\n\s+- >-\n((?:\s{14}.*\n)+)", text)
    assert args is not None
    command = " ".join(line.strip() for line in args.group(1).splitlines())
    argv = _launch(tmp_path, ["sh", "-c", command], JOB_COMPLETION_INDEX="2", SHOAL_TOKEN="t" * 24)
    elastic, nodes, _ = _parse(argv)
    assert elastic.coordinator == f"shoal-coordinator:{service_port.group(1)}"  # type: ignore[attr-defined]
    assert nodes is not None and (nodes.nnodes, nodes.node_rank) == (4, 2)
    assert re.search(r"completions: 4\n\s+parallelism: 4", text)   # --nnodes 4 matches the Job's size
    assert "secretKeyRef" in text and "SHOAL_TOKEN" in text
