"""The elastic launcher reads a worker's run marks under the RANK label the worker wrote them with.

Across machines a worker's RANK is ``i * nnodes + node_rank`` (docs/multinode.md), not its index in this
launcher; reading the index would take another worker's marks (and not restart a crashed worker).
"""

from __future__ import annotations

import io
from typing import Any

from shoal.cli.elastic_launch import ElasticLaunch, ElasticSupervisor, _Spawn
from shoal.cli.supervise import _Output, _Worker


class _Marks:
    """A RunEnd stand-in: which (label, life) finished or trained."""

    def __init__(self, finished: set[tuple[int, int]], trained: set[tuple[int, int]]) -> None:
        self._finished, self._trained = finished, trained

    def finished(self, rank: int, life: int) -> bool:
        return (rank, life) in self._finished

    def trained(self, rank: int, life: int) -> bool:
        return (rank, life) in self._trained

    def any_finished(self) -> bool:
        return bool(self._finished)


def _supervisor(marks: _Marks, node_rank: int, nnodes: int) -> ElasticSupervisor:
    sup = ElasticSupervisor(ElasticLaunch(min_workers=1, max_restarts=1, token="t" * 24), [], 1.0,
                            _Output(io.StringIO(), True), quiet=True)
    sup.label = lambda i: i * nnodes + node_rank
    sup.across_machines = nnodes > 1
    sup.end = marks  # type: ignore[assignment]
    for i in range(2):
        sup.spawns[i] = _Spawn([], {}, 0, i)
    return sup


def _worker(index: int, code: int | None) -> _Worker:
    return _Worker(index, 0, index, proc=None, code=code)  # type: ignore[arg-type]


def test_a_finished_worker_is_found_under_its_label_not_its_index() -> None:
    # Node 1 of 2: its workers 0 and 1 are labelled 1 and 3. Worker 1 (label 3) finished and then crashed;
    # worker 0 (label 1) did not finish. Worker 1's exit needs no restart; worker 0's does.
    sup = _supervisor(_Marks(finished={(3, 0)}, trained={(1, 0), (3, 0)}), node_rank=1, nnodes=2)
    assert sup._ended_for(_worker(1, 1), "exited with code 1") is True
    assert sup._ended_for(_worker(0, 1), "exited with code 1") is False


def test_one_machine_never_declares_a_run_across_machines_over() -> None:
    # Another machine's worker finished; this machine's live worker has not trained yet (it may be a newcomer
    # about to be healed): only the run as a whole could say it is over, so this launcher does not.
    marks: Any = _Marks(finished={(0, 0)}, trained=set())
    sup = _supervisor(marks, node_rank=1, nnodes=2)
    sup.workers = [_worker(0, None)]
    sup.clean_exit = True
    assert sup._run_over() is False
    single = _supervisor(marks, node_rank=0, nnodes=1)
    single.workers = [_worker(1, None)]
    single.clean_exit = True
    assert single._run_over() is True   # one launcher sees every worker: the old rule stands


def test_a_relaunched_machine_never_reads_an_earlier_launchers_marks(monkeypatch: Any) -> None:
    # A machine's launcher started again in the same run (a re-created pod) counts lives from 0 again: the
    # worker's mark carries its launcher's id, and the new launcher reads only marks with its own.
    from shoal.cli.elastic_launch import RunEnd
    from shoal.membership.coordinator import Coordinator
    from shoal.membership.leaving import life_label

    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("SHOAL_RESTART", "0")
    monkeypatch.setenv("SHOAL_LAUNCH_ID", "aaaa1111")
    label = life_label(7)
    assert label == "2-0@aaaa1111"
    coord = Coordinator(port=0).start()
    try:
        first, again = RunEnd(coord.address, "run1", "aaaa1111"), RunEnd(coord.address, "run1", "bbbb2222")
        first.store.set(f"run1/finished/{label}", "1")
        assert first.finished(2, 0) and not again.finished(2, 0)
    finally:
        coord.stop()
    monkeypatch.delenv("RANK")
    assert life_label(7) == "m7"
