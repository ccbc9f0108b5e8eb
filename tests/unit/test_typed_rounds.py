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


def _flying(log: list[str]) -> Round:
    return Round("exchange", reduce=lambda live: log.append(f"reduce exchange {live}"),
                 land=lambda: log.append("land exchange"), apply=lambda: log.append("apply exchange"),
                 discard=lambda: log.append("discard exchange"), policy=FailurePolicy.DISCARD)


def test_a_round_in_flight_is_launched_then_landed_once(world: None) -> None:
    g = _group([True])
    rounds = Rounds(g, "t", FailurePolicy.DISCARD)
    log: list[str] = []
    r = rounds.add(_flying(log))
    rounds.launch(r)
    assert log == ["reduce exchange True"] and g.calls == ["begin"] and rounds.flying is r
    rounds.launch(r)                     # a second forward in the same step: the same round stays in flight
    assert log == ["reduce exchange True"] and g.calls == ["begin", "begin"]
    assert rounds.land() is True
    assert log == ["reduce exchange True", "land exchange", "apply exchange"]
    assert g.calls == ["begin", "begin", "vote"] and rounds.flying is None and rounds.current == ADOPT
    assert rounds.land() is None and g.calls[-1] == "vote"   # nothing in flight: no vote


def test_a_discarded_round_in_flight_is_dropped_not_retried(world: None) -> None:
    g = _group([False])
    rounds = Rounds(g, "t", max_attempts=3)
    log: list[str] = []
    r = rounds.add(_flying(log))
    rounds.launch(r)
    assert rounds.land() is False
    assert log == ["reduce exchange True", "land exchange", "discard exchange"]
    assert g.calls == ["begin", "vote"] and rounds.skipped == 1 and rounds.commits == 0


def test_begin_steps_hooks_may_land_the_round_in_flight_then_a_new_one_launches(world: None) -> None:
    g = _group([True])
    rounds = Rounds(g, "t")
    log: list[str] = []
    r = rounds.add(_flying(log))
    rounds.launch(r)
    g.heal = rounds.land                 # what the owner's before_begin_step hook does once its work is done
    rounds.launch(r)
    assert log == ["reduce exchange True", "land exchange", "apply exchange", "reduce exchange True"]
    assert rounds.flying is r


def test_another_round_lands_the_one_in_flight_first_only_where_steps_end_at_their_vote(world: None) -> None:
    from shoal.comm.start import ELASTIC

    for traits, landed_first in ((None, False), (ELASTIC, True)):
        g = _group([])
        if traits is not None:
            g.traits = traits            # elastic: nothing outlives a step's vote
        rounds = Rounds(g, "t")
        log: list[str] = []
        flying, params = rounds.add(_flying(log)), rounds.add(_round("params", log))
        rounds.launch(flying)
        assert rounds.run(params, admit=False)
        land = ["land exchange", "apply exchange"] if landed_first else []
        assert log == ["reduce exchange True", *land, "reduce params True", "apply params"], traits
        assert (rounds.flying is None) == landed_first


def test_a_failed_attempt_is_discarded_before_the_retry(world: None) -> None:
    g = _group([False, True])
    rounds = Rounds(g, "t", max_attempts=2)
    log: list[str] = []
    r = rounds.add(Round("params", reduce=lambda live: log.append("reduce"), apply=lambda: log.append("apply"),
                         discard=lambda: log.append("discard")))
    assert rounds.run(r, admit=False)
    assert log == ["reduce", "discard", "reduce", "apply"]


def test_rounds_in_flight_and_their_misuse(world: None) -> None:
    rounds = Rounds(_group([]), "t")
    log: list[str] = []
    flying, params = rounds.add(_flying(log)), rounds.add(_round("params", log))
    with pytest.raises(ConfigError, match="rounds.launch"):
        rounds.run(flying)
    with pytest.raises(ConfigError, match="rounds.run"):
        rounds.launch(params)
    with pytest.raises(ConfigError, match="DISCARD"):
        Round("x", land=lambda: None, policy=FailurePolicy.AVERAGE_SURVIVORS)
    assert flying.in_flight and not params.in_flight and log == []



def test_localsgd_rounds_keep_their_own_scratch_and_a_discard_drops_it(world: None) -> None:
    # Each of LocalSGD's rounds holds its state from reduce to apply in typed fields of its own (no shared
    # tuple): a discarded attempt's scratch is dropped before the retry, whose scratch is applied.
    import torch
    from torch import nn

    import shoal
    from shoal.strategies.localsgd import _Scratch

    g = _group([True, False, True])     # the join's round; the averaging's first attempt fails, its retry commits
    net = nn.Linear(2, 1)
    _, opt = shoal.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), shoal.LocalSGD(period=2),
                        process_group=g)
    rounds = opt.strategy._rounds
    held = {name: [c.cell_contents for c in (r.apply.__closure__ or ()) if isinstance(c.cell_contents, _Scratch)]
            for name, r in rounds.items()}
    assert sorted(held) == ["grad", "local_grad", "params"] and all(len(v) == 1 for v in held.values()), held
    assert len({id(v[0]) for v in held.values()}) == 3           # one state per round
    params = held["params"][0]
    seen: list[bool] = []

    def at_begin() -> None:             # runs inside each attempt's begin_step
        seen.append(params.ready)
        g.heal = at_begin

    g.heal = at_begin
    net(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert seen == [False, False]       # the failed attempt's scratch was dropped before the retry began
    assert g.calls[-4:] == ["begin", "vote", "begin", "vote"] and opt.strategy.rounds.commits == 2
    assert not any(v[0].ready for v in held.values())              # applied: nothing held past the round


def test_the_round_building_blocks_are_public() -> None:
    import shoal
    import shoal.strategies as strategies
    from shoal.strategies import rounds as module

    assert shoal.Round is strategies.Round is module.Round and shoal.Rounds is strategies.Rounds is module.Rounds
    assert strategies.FailurePolicy is module.FailurePolicy and strategies.run_round is module.run_round
    assert {"Round", "Rounds"} <= set(shoal.__all__) and {"Round", "Rounds", "FailurePolicy"} <= set(strategies.__all__)
    for obj in (module.Round, module.Rounds, module.run_round):
        assert "Example" in (obj.__doc__ or ""), obj
