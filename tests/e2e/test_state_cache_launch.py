"""``shoal run --elastic --state-cache DIR``: one file per worker slot, the same across its lives, removed at the end.

Each worker's first life writes its file (and a cut-off write's temporary file) and crashes; the launcher restarts it with the same
``SHOAL_STATE_CACHE``, where the second life finds what the first wrote (what a restart's heal takes its
unchanged ranges from, shoal.membership.seed). After the launch no file is left.
"""

from __future__ import annotations

import io
import os
import sys
from typing import Any

import pytest

from shoal.cli.elastic_launch import ElasticLaunch
from shoal.cli.launcher import launch
from shoal.errors import ConfigError

_WORKER = """
import os, sys, time
marks = sys.argv[1]
path, life = os.environ["SHOAL_STATE_CACHE"], int(os.environ.get("SHOAL_RESTART", "0"))
if life == 0:
    open(path, "w").write("life 0 of rank " + os.environ["RANK"])
    open(path + ".4242.tmp", "w").write("a write cut off")   # what a kill mid-write leaves
    sys.exit(3)   # a crash: the launcher restarts this slot
print("RESTART", os.environ["RANK"], path, open(path).read(), flush=True)
# A clean exit ends the run for the launcher, which then restarts no one: wait until every slot is in its second life.
open(os.path.join(marks, os.environ["RANK"]), "w").close()
deadline = time.monotonic() + 60
while len(os.listdir(marks)) < 3 and time.monotonic() < deadline:
    time.sleep(0.05)
"""


@pytest.mark.timeout(120)
def test_each_slot_keeps_one_file_across_its_lives_and_the_launch_removes_them(tmp_path: Any) -> None:
    out = io.StringIO()
    cache, marks = tmp_path / "cache", tmp_path / "marks"
    cache.mkdir()
    marks.mkdir()
    # Two workers and one started by --join at once: each its own file (a joiner is no copy of its template).
    res = launch([sys.executable, "-c", _WORKER, str(marks)], nprocs=2, stdout=out,
                 elastic=ElasticLaunch(max_restarts=1, joins=(0.0,), state_cache=str(cache)))
    text = out.getvalue()
    assert res.returncode == 0, text
    lines = sorted(line.split("RESTART ", 1)[1] for line in text.splitlines() if "RESTART " in line)
    assert len(lines) == 3, text
    paths = set()
    for rank, line in enumerate(lines):
        got_rank, path, rest = line.split(" ", 2)
        assert got_rank == str(rank) and os.path.dirname(path) == str(cache), text
        assert rest == f"life 0 of rank {rank}", text   # the second life reads the first life's file
        paths.add(path)
    assert len(paths) == 3, text   # one file per slot
    assert os.listdir(cache) == [], text   # removed with the launch, and what cut-off writes left


def test_state_cache_must_be_a_folder(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="state_cache must be an existing folder"):
        ElasticLaunch(state_cache=str(tmp_path / "missing"))
