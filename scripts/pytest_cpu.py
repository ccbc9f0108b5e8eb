"""CPU seconds per test: the test process and every process it started, measured around each test.

Wall times on the shared 2-core box move with the other jobs' load; the CPU a test and its workers burn
moves much less, so this is the figure to compare before and after a change to the suite's cost.

Run (a pytest plugin; each xdist process appends its own tests' lines)::

    PYTHONPATH=.:scripts SHOAL_TEST_CPU=/tmp/cpu.jsonl .venv/bin/python -m pytest -q -n 2 --dist loadfile -p pytest_cpu
    .venv/bin/python scripts/pytest_cpu.py /tmp/cpu.jsonl [N]     # totals, per xdist process, top N files

A test's CPU is the change, across the test, of the summed user+system time of the pytest process and its
live descendants, each with its reaped children's (Linux /proc): a child that ends is counted in its
parent. Not counted: a process that left the tree before it ended (reparented to init).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from typing import Any, Iterator

import pytest

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu(root: int) -> float:
    """CPU seconds of ``root`` and its descendants so far (their reaped children included)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:   # ended meanwhile
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        children[int(fields[1])].append(int(name))
        ticks[int(name)] = sum(int(x) for x in fields[11:15])   # utime, stime, cutime, cstime
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total / _TICK


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Iterator[None]:
    out = os.environ.get("SHOAL_TEST_CPU")
    if not out:
        yield
        return
    cpu0, wall0 = tree_cpu(os.getpid()), time.monotonic()
    yield
    cpu, wall = tree_cpu(os.getpid()) - cpu0, time.monotonic() - wall0
    with open(out, "a") as f:
        f.write(json.dumps({"id": item.nodeid, "cpu": round(cpu, 3), "wall": round(wall, 3),
                            "worker": os.environ.get("PYTEST_XDIST_WORKER", "-")}) + "\n")



def summary(path: str, top: int = 30) -> str:
    """Totals, per xdist process, and the ``top`` files by CPU (CPU s, summed wall s, tests, file)."""
    rows = [json.loads(line) for line in open(path)]
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        f = files[r["id"].split("::")[0]]
        f[0] += r["cpu"]
        f[1] += r["wall"]
        f[2] += 1
    lines = [f"{len(rows)} tests: {sum(r['cpu'] for r in rows):.0f} s of CPU, "
             f"{sum(r['wall'] for r in rows):.0f} s of wall summed over tests"]
    for w in sorted({r["worker"] for r in rows}):
        mine = [r for r in rows if r["worker"] == w]
        lines.append(f"  {w}: {sum(r['cpu'] for r in mine):.0f} s CPU, {sum(r['wall'] for r in mine):.0f} s wall")
    for name, (cpu, wall, n) in sorted(files.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{cpu:8.1f} {wall:8.1f} {int(n):4d} {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30))
