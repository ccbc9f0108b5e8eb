"""Joiners that enter between rounds: every member agrees on their weights at each begin_step, across a
quorum change, and a joiner is topped up (and stops being exchanged) only once it weighs 1.

Three members run CatchUp.at_begin in threads over a fake group whose all-reduce runs in lockstep and a
shared dict as the coordinator's store. The joiner's weight per step is scripted (its replayer); the
reference is the script itself: every member must read the same weight and shortfall, the holders must
write the top-up at the step the joiner first weighs 1 and the joiner must load it there, and a member
that joins the quorum between two steps (fresh Pending objects, as CatchUp.adopt makes them) must agree
with the others (the review finding: a joiner topped up at its first weighted round lost its weight in
the next quorum).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import torch

from shoal.comm.stepping import StateEntry
from shoal.membership.catchup import CatchUp, Pending

JOINER, HID = 7, 3


class Store:
    def __init__(self) -> None:
        self.d: dict[str, Any] = {}
        self.lock = threading.Lock()

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.d for k in keys)

    def get(self, k: str) -> Any:
        with self.lock:
            return self.d[k]

    def set(self, k: str, v: Any) -> None:
        with self.lock:
            self.d[k] = v


class World:
    def __init__(self, n: int) -> None:
        self.barrier, self.slots = threading.Barrier(n), [None] * n


class Fake:
    """One member: the parts of an ElasticGroup that CatchUp.at_begin reads."""

    def __init__(self, world: World, rank: int, members: list[int], store: Store, buffers: torch.Tensor) -> None:
        self.world, self.rank, self.size, self.device = world, rank, len(members), torch.device("cpu")
        self.quorum = SimpleNamespace(members=members, rank_of=members.index)
        book = SimpleNamespace(seal=lambda rec: dict(rec), open=lambda rec, **kw: rec)
        self.client = SimpleNamespace(member_id=members[rank], store=store, book=book,
                                      key=lambda k: f"run/{k}", down=threading.Event())
        self.timeouts = SimpleNamespace(heartbeat_timeout=5.0, quorum=3.0)
        self.link = SimpleNamespace(failures=SimpleNamespace(aborted=False))
        self.hooks = SimpleNamespace(states={"buffers": StateEntry(get=lambda: buffers.clone(),
                                                                   load=lambda v: buffers.copy_(v))})
        self.step, self.error, self.newcomers, self.exchanges = 0, None, (), 0

    def on_commit(self, fn: Any) -> None:
        return None

    def _record(self, e: BaseException) -> None:
        self.error = e

    def all_reduce(self, t: torch.Tensor, op: str = "sum", tag: str = "") -> "Fake":
        assert op == "max"
        self.exchanges += 1
        self.world.slots[self.rank] = t.clone()
        self.world.barrier.wait(10)
        t.copy_(torch.stack(list(self.world.slots)).max(0).values)
        self.world.barrier.wait(10)
        return self

    def wait(self) -> None:
        return None


class Scripted:
    """The joiner's replayer: enters between rounds, with the weight the test sets."""

    enters_between_rounds = True

    def __init__(self) -> None:
        self.w = 0.0

    def weight(self) -> float:
        return self.w


def _members(world: World, members: list[int], store: Store, joiner_buffers: torch.Tensor,
             holder_buffers: torch.Tensor, replay: Scripted) -> list[tuple[Fake, CatchUp]]:
    out = []
    for r, m in enumerate(members):
        g = Fake(world, r, members, store, joiner_buffers if m == JOINER else holder_buffers)
        c = CatchUp(g)
        c.register(replay)
        c.pending = {JOINER: Pending(HID)}
        if m == JOINER:
            c.hid = HID   # downloading
        out.append((g, c))
    return out


def _load_between_rounds(c: CatchUp, store: Store, t: int) -> None:
    """What enter_between_rounds leaves on the joiner before step ``t``: loaded, its record written, and on
    its own view (``_catch_up``) "ready from t + 1"."""
    c.loaded = True
    p = c.pending[JOINER]
    p.read, p.keys, p.ready, p.full_at = True, ("buffers",), t + 1, t + 1
    store.set(f"run/heal/{HID}/ready/{JOINER}", {"from": t + 1, "keys": ["buffers"]})


def _begin(members: list[tuple[Fake, CatchUp]], step: int) -> list[tuple[float, tuple[int, ...], int]]:
    """Every member's at_begin at ``step`` (threads); per member (shortfall, newcomers, exchanges so far)."""
    errors: list[BaseException] = []

    def run(g: Fake, c: CatchUp) -> None:
        try:
            g.step, g.error, g.newcomers = step, None, ()
            c.at_begin()
            assert g.error is None, g.error
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=m) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    return [(c.shortfall(), g.newcomers, g.exchanges) for g, c in members]


def test_weights_agreed_across_a_quorum_change_and_the_top_up_waits_for_weight_1() -> None:
    store, replay = Store(), Scripted()
    joiner_buffers, holder_buffers = torch.zeros(3), torch.arange(3.0)
    world = World(3)
    members = _members(world, [1, 2, JOINER], store, joiner_buffers, holder_buffers, replay)
    # Step 10: still downloading (weight 0): counted out everywhere.
    assert {(s, n) for s, n, _ in _begin(members, 10)} == {(0.0, (2,))}
    # Step 11: loaded 8 of 32 inner steps before the round: weight 0.25, shortfall 0.75 on every member.
    _load_between_rounds(members[2][1], store, 11)
    replay.w = 0.25
    assert {(s, n) for s, n, _ in _begin(members, 11)} == {(0.75, ())}
    # Step 12: an empty round right after (an admission's): no inner step since, the same weight.
    assert {(s, n) for s, n, _ in _begin(members, 12)} == {(0.75, ())}
    assert torch.equal(joiner_buffers, torch.zeros(3))     # no top-up yet: it does not weigh 1
    # A quorum change: member 2 is replaced by member 5, whose Pending is fresh (CatchUp.adopt keeps the
    # others'); the joiner stays a downloader in the plan (hid >= 0), so its weight is still agreed.
    world = World(3)
    fresh = _members(world, [1, 5, JOINER], store, joiner_buffers, holder_buffers, replay)
    for (g_old, c_old), (g_new, c_new) in zip([members[0], members[2]], [fresh[0], fresh[2]]):
        c_new.pending, c_new.hid, c_new.loaded = c_old.pending, c_old.hid, c_old.loaded   # kept objects
    replay.w = 0.5
    assert {(s, n) for s, n, _ in _begin(fresh, 13)} == {(0.5, ())}   # the newcomer 5 agrees
    # Step 14: a full period behind it: weight 1, the holder writes the top-up and the joiner loads it.
    replay.w = 1.0
    assert {(s, n) for s, n, _ in _begin(fresh, 14)} == {(0.0, ())}
    assert torch.equal(joiner_buffers, holder_buffers) and fresh[2][1].hid == -1
    # Step 15: every joiner weighs 1: nobody runs the exchange any more (all alike, or they would hang).
    before = [x for _, _, x in _begin(fresh, 14)]   # a retry of step 14 still exchanges (full_at == t)
    after = [x for _, _, x in _begin(fresh, 15)]
    assert after == before


class ScriptedFragments(Scripted):
    """Streaming DiLoCo's joiner: its round's weight, and whether every fragment spans a period (``full``)."""

    def __init__(self) -> None:
        super().__init__()
        self.is_full = False

    def full(self) -> bool:
        return self.is_full


def test_a_round_weighing_1_before_the_joiner_is_full_counts_it_whole_but_tops_up_nothing() -> None:
    # A fragment its load kept spans a period at its own round: that round weighs it 1 (shortfall 0 on every
    # member), yet another fragment spans less, so it is not a full member: no top-up, the exchange goes on.
    store, replay = Store(), ScriptedFragments()
    joiner_buffers, holder_buffers = torch.zeros(3), torch.arange(3.0)
    members = _members(World(3), [1, 2, JOINER], store, joiner_buffers, holder_buffers, replay)
    _load_between_rounds(members[2][1], store, 11)
    replay.w = 1.0
    assert {(s, n) for s, n, _ in _begin(members, 11)} == {(0.0, ())}
    assert torch.equal(joiner_buffers, torch.zeros(3)) and members[2][1].hid == HID   # not topped up
    replay.w = 0.5   # the next fragment's round: it spans half a period
    assert {(s, n) for s, n, _ in _begin(members, 12)} == {(0.5, ())}
    replay.w, replay.is_full = 1.0, True   # every fragment spans a period now
    assert {(s, n) for s, n, _ in _begin(members, 13)} == {(0.0, ())}
    assert torch.equal(joiner_buffers, holder_buffers) and members[2][1].hid == -1
