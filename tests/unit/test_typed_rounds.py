"""Typed rounds: the runner begins, votes and retries a :class:`Round`, and dispatches by name after a heal.

The group is a single-process static :class:`Group` whose ``commit`` answers
from a script (what an elastic group's vote would say) and whose
``begin_step`` may play a heal that puts the runner into another round (what
a newcomer receives from its peers).
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Iterator

import pytest
import torch.distributed as dist

from shoal.comm import Group
from shoal.errors import ConfigError
from shoal.strategies.rounds import ADOPT, FailurePolicy, Round, Rounds
from shoal.testing import free_port


class _Scripted(Group):
    """A static group whose verdicts come from a script; ``heal`` runs inside ``begin_step``."""

    verdicts: list[bool]
    heal: Callable[[], None] | None = None

    def begin_step(self) -> None:
        self.calls.append("begin")
        if self.heal is not None:
            heal, self.heal = self.heal, None
            heal()

    def commit(self) -> bool:
        self.calls.append("vote")
        return self.verdicts.pop(0) if self.verdicts else True


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        created = True
    yield
    if created:   # later tests in this process check the no-process-group errors
        dist.destroy_process_group()


def _group(verdicts: list[bool]) -> Any:
    g = _Scripted()
    g.verdicts, g.calls = list(verdicts), []
    return g


def _round(name: str, log: list[str], policy: FailurePolicy | None = None) -> Round:
    return Round(name, reduce=lambda live: log.append(f"reduce {name} {live}"),
                 apply=lambda: log.append(f"apply {name}"), policy=policy)


def test_a_round_is_retried_until_it_commits_and_applied_once(world: None) -> None:
    g = _group([False, False, True])
    rounds = Rounds(g, "t", max_attempts=3)
    log: list[str] = []
    r = rounds.add(_round("params", log))
    assert rounds.run(r, admit=False)
    assert log == ["reduce params True"] * 3 + ["apply params"]
    assert g.calls == ["begin", "vote"] * 3
    assert (rounds.commits, rounds.contributed, rounds.skipped, rounds.current) == (1, 1, 0, ADOPT)


def test_the_rounds_own_policy_and_the_runs_override(world: None) -> None:
    g = _group([False, False, True])
    rounds = Rounds(g, "t", max_attempts=3)
    log: list[str] = []
    grad = rounds.add(_round("grad", log, FailurePolicy.DISCARD))
    assert not rounds.run(grad, admit=False)                  # DISCARD: one attempt, dropped
    assert log == ["reduce grad True"] and rounds.skipped == 1
    log.clear()
    assert rounds.run(grad, FailurePolicy.AVERAGE_SURVIVORS, admit=False)   # this run retries
    assert log == ["reduce grad True", "reduce grad True", "apply grad"]


def test_a_healed_member_runs_its_peers_round_by_name(world: None) -> None:
    g = _group([True])
    rounds = Rounds(g, "t")
    log: list[str] = []
    mine, theirs = rounds.add(_round("fragment:0", log)), rounds.add(_round("fragment:1", log))
    assert theirs.name == "fragment:1"
    g.heal = lambda: rounds._load_round({"kind": "fragment:1"})   # the heal's copy of the peers' round
    assert rounds.run(mine, admit=False)
    assert log == ["reduce fragment:1 True", "apply fragment:1"]
    assert rounds.last_kind == "fragment:1"


def test_join_runs_an_empty_round_then_every_after_join(world: None) -> None:
    g = _group([])
    rounds = Rounds(g, "t")
    log: list[str] = []
    rounds.add(Round("a", after_join=lambda: log.append("after a")))
    rounds.add(Round("b"))
    assert rounds.join(first=lambda: log.append("first")) == ADOPT
    assert log == ["first", "after a"]
    assert g.calls == ["begin", "vote"]


def test_misuse_is_refused_with_what_to_do(world: None) -> None:
    rounds = Rounds(_group([]), "t")
    r = rounds.add(Round("params"))
    with pytest.raises(ConfigError, match="unique"):
        rounds.add(Round("params"))
    adopt = rounds.add(Round(ADOPT, reduce=lambda live: None))   # the empty round's own work (a heal)
    with pytest.raises(ConfigError, match="unique"):
        rounds.add(Round(ADOPT))
    assert rounds._round(ADOPT) is adopt
    with pytest.raises(ConfigError, match="rounds.add"):
        rounds.run(Round("params"))        # a different object of the same name: never added
    with pytest.raises(ConfigError, match="no round named 'other'"):
        rounds.run("other")
    with pytest.raises(ConfigError, match="non-empty name"):
        Round("")
    with pytest.raises(ConfigError, match="FailurePolicy"):
        Round("x", policy="discard")   # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="FailurePolicy"):
        Rounds(_group([]), "u", lambda kind, live: None)   # type: ignore[arg-type]  # the untyped form is gone
    assert rounds.run(r, admit=False)


def test_a_round_of_collectives_refuses_the_background_heal() -> None:
    # A joiner still downloading in the background (SHOAL_HEAL=background) has no state yet: a round that
    # means every member's tensors must make the quorum heal blocking (the vote-only run_round need not).
    from shoal.strategies.rounds import run_round

    class _Group:
        refusals: list[str] = []

        def refuse_background_heal(self, why: str, when: object = None) -> None:
            self.refusals.append(why)

        def begin_step(self) -> None: ...

        def commit(self) -> bool:
            return True

    g = _Group()
    assert run_round(g) and g.refusals == []                      # type: ignore[arg-type]
    assert run_round(g, lambda: None) and len(g.refusals) == 1    # type: ignore[arg-type]


def test_a_static_groups_step_counts_its_commits(world: None) -> None:
    # The step interface's ``step`` on a static group: what ZeRO names a lost shard's step by.
    g = Group()
    assert g.step == 0
    for _ in range(3):
        g.begin_step()
        assert g.commit()
    assert g.step == 3
