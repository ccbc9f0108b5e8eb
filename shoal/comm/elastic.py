"""ElasticGroup: a :class:`~shoal.comm.Group` rebuilt for each quorum of a run.

Workers come and go; an ElasticGroup stays the same Python object while the
gloo group under it is replaced for every quorum (a fresh store prefix, a
fresh ``ProcessGroupGloo`` built directly, never the default group). A step
on an elastic group has three parts::

    group.start_step()      # adopt the latest quorum: rebuild, heal newcomers
    ...collectives...       # failures are recorded, never raised, never waited out
    group.should_commit()   # the same True/False on every member of the quorum

Collective failures (a peer's socket closed, the op timeout passed, another
member reporting a failure) are recorded as :class:`~shoal.errors.PeerLostError`
or :class:`~shoal.errors.CommTimeoutError` in :attr:`ElasticGroup.error`; from
then on this step's collectives return at once with unreduced data, so the
step finishes quickly and the vote discards it. A failed gloo group is
abandoned: never waited on, never destroyed in the training thread (its
destructor would wait for its stuck operations).

The commit vote goes through the coordinator's store: each member that saw no
failure adds one to ``<prefix>ok/<step>``; the member whose add completes the
count writes ``commit`` to ``<prefix>d/<step>`` with compare-and-set; a member
that failed, or sees the run's abort flag, or waits past ``Timeouts.quorum``,
writes ``discard`` the same way. The first write wins, so every member reads
one decision. Decisions are signed by their writer (:mod:`shoal.comm.records`);
one that does not verify reads as ``discard`` everywhere.

Healing: in each new group the members exchange (committed step, fresh); if
anyone is behind or new, the lowest-ranked up-to-date member sends every
registered state (model, optimizer, codec, counters) as one serialised blob,
point to point and in chunks, to those members only. A receiver checks it
against its own state before loading any of it (:mod:`shoal.comm.received`:
shapes, dtypes, NaN/Inf); state that fails is refused and never loaded: the
receiver logs why, leaves the run and raises :class:`~shoal.errors.ShoalError`.

Authentication: every member proves it holds the run token when it joins
(:mod:`shoal.comm.auth`); the token is ``ElasticGroup(token=...)``, else
``$SHOAL_TOKEN`` (set by ``shoal run --elastic``), and a group without either
refuses to start (ConfigError). A wrong token gets
:class:`~shoal.errors.AuthError` at the first :meth:`ElasticGroup.start_step`,
and its holder is never admitted into a quorum.

Example::

    group = ElasticGroup("run1", coordinator="127.0.0.1:29400", token="s3cret-token")
    group.register_state("model", model.state_dict, model.load_state_dict)
    while training:
        group.start_step()
        group.all_reduce(grad, op="avg", tag="grad").wait()
        if group.should_commit():
            opt.step()
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from shoal.comm.auth import check_token
from shoal.comm.group import _REDUCE_OPS, Group, Handle, _nbytes, check_all_to_all, check_reduce_op
from shoal.comm.membership import MemberClient, Quorum, Timeouts, Trace
from shoal.comm.meter import Meter
from shoal.comm.objects import all_gather_object, from_bytes, to_bytes
from shoal.comm.received import check_received
from shoal.comm.rules import Partition
from shoal.comm.topology import host_identity
from shoal.errors import CommTimeoutError, ConfigError, PeerLostError, ShoalError

CONTROL_TAG = "elastic/control"
_SLICE = datetime.timedelta(milliseconds=10)   # _await checks the abort flag and deadline this often
HEAL_TAG = "elastic/heal"
HEAL_CHUNK = 4 << 20  # bytes per point-to-point heal message (1.7 s at 20 mbit)
log = logging.getLogger("shoal.elastic")


@dataclass(frozen=True)
class BackendSpec:
    """What a backend factory gets to build one quorum's process group.

    ``step`` returns the group's committed step when called (fault plans use it).
    """

    store: dist.Store
    rank: int
    size: int
    timeout: float
    step: Callable[[], int]


BackendFactory = Callable[[BackendSpec], Any]


def gloo_backend(spec: BackendSpec) -> Any:
    """The default factory: a gloo group on the quorum's own store prefix."""
    return dist.ProcessGroupGloo(spec.store, spec.rank, spec.size, datetime.timedelta(seconds=spec.timeout))


@dataclass
class ElasticStats:
    """Counters of one worker's elastic life (all since construction)."""

    commits: int = 0
    discards: int = 0
    quorums: int = 0             # groups built (the first one included)
    heals_received: int = 0
    heal_bytes: int = 0          # size of the last state blob sent or received
    heal_s: float = 0.0          # seconds the last heal took (exchange + broadcast + load)
    reconfigure_s: float = 0.0   # seconds the last start_step spent adopting a quorum


@dataclass
class _State:
    get: Callable[[], Any]
    load: Callable[[Any], Any]
    rollback: bool
    heal_load: Callable[[Any], Any] | None = None
    snapshot: Callable[[], Any] | None = None


class _ElasticHandle(Handle):
    """A collective on an elastic group: its wait records failures instead of raising."""

    def __init__(self, group: "ElasticGroup", work: Any, result: Any, tag: str,
                 post: Callable[[Any], Any] | None, whole: bool = False) -> None:
        super().__init__(work, result, group.meter, tag, group.timeout, post)
        self._group = group
        self._whole = whole

    def wait(self, timeout: float | None = None) -> Any:
        if self._done:
            return self._result
        t0 = time.perf_counter()
        ok = self._group._await(self._work, self._timeout if timeout is None else timeout, self._tag, self._whole)
        self._meter.add_wait(self._tag, time.perf_counter() - t0)
        self._done = True
        if ok and self._post is not None:
            self._result = self._post(self._result)
        return self._result

    def future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.wait())
        return fut

    def is_completed(self) -> bool:
        return self._done or self._group.error is not None or bool(self._work.is_completed())


def _env(name: str, value: str | None, what: str) -> str:
    if value is not None:
        return value
    found = os.environ.get(name)
    if not found:
        raise ConfigError(f"{what} not given and {name} is not set; `shoal run --elastic` sets it, "
                          f"or pass it explicitly")
    return found


def run_token(token: str | None) -> str:
    """The elastic run's token: ``token`` if given (it wins over the environment), else ``$SHOAL_TOKEN``."""
    if token is not None:
        return str(check_token(token))
    found = os.environ.get("SHOAL_TOKEN")
    if not found:
        raise ConfigError("an elastic group needs the run token, so that only workers holding it join the "
                          "run: pass ElasticGroup(token=...) or set $SHOAL_TOKEN (`shoal run --elastic` sets "
                          "it for its workers; with `--coordinator` or `shoal coordinator` give them the same "
                          "--token)")
    return str(check_token(found))


class ElasticGroup(Group):
    """A Group whose members follow the run's quorums; see the module docstring.

    Args:
        run_id: names the run at the coordinator (default: ``$SHOAL_RUN_ID``).
        coordinator: ``"host:port"`` of the coordinator (default: ``$SHOAL_COORDINATOR``).
        timeouts: the run's :class:`~shoal.comm.membership.Timeouts`; ``op`` is
            this group's per-collective timeout.
        min_workers: no quorum forms with fewer live workers (default:
            ``$SHOAL_MIN_WORKERS``, set by ``shoal run --min-workers``, else 1).
        meter: where bytes are counted (kept across quorums).
        backend_factory: builds a quorum's process group from a
            :class:`BackendSpec` (default :func:`gloo_backend`; tests wrap it
            to inject faults, see :mod:`shoal.testing.faults`).
        host_id: this worker's host identity, published with its join
            record so that per-quorum subgroups (:mod:`shoal.comm.elastic_sub`)
            know who shares a host (default: ``$SHOAL_HOST_ID``, else the hostname).
        token: the run token (at least 8 characters), proved to the
            coordinator at the join without being sent (default:
            ``$SHOAL_TOKEN``, which ``shoal run --elastic`` sets; an argument
            wins over it). Required: without either, ConfigError. A wrong one
            raises :class:`~shoal.errors.AuthError` at the first
            :meth:`start_step`.

    Example::

        group = ElasticGroup()                 # under `shoal run --elastic`
        model = shoal.DistributedDataParallel(net, process_group=group)
    """

    elastic = True

    def __init__(self, run_id: str | None = None, *, coordinator: str | None = None,
                 timeouts: Timeouts | None = None, min_workers: int | None = None, meter: Meter | None = None,
                 backend_factory: BackendFactory | None = None, client: MemberClient | None = None,
                 host_id: str | None = None, token: str | None = None) -> None:
        # Group.__init__ wants the default process group; an elastic group has none.
        if timeouts is not None and not isinstance(timeouts, Timeouts):
            raise ConfigError(f"timeouts must be a shoal Timeouts, got {type(timeouts).__name__}")
        self.timeouts = timeouts if timeouts is not None else Timeouts()
        self.timeout: float | None = self.timeouts.op
        self.meter = meter if meter is not None else Meter()
        self.backend = "gloo"
        self.pg: Any = None
        self.rank, self.size = 0, 1
        self._global_ranks = [0]
        self.step = 0
        self.quorum: Quorum | None = None
        self.stats = ElasticStats()
        self.error: BaseException | None = None
        self._factory = backend_factory if backend_factory is not None else gloo_backend
        self._states: dict[str, _State] = {}
        self._snapshots: dict[str, Any] = {}
        self._on_commit: list[Callable[[], None]] = []
        self._before_start: list[Callable[[], None]] = []
        self._abandoned: list[tuple[float, Any]] = []
        self._lock = threading.Lock()
        self._in_step = False
        self._after = 0              # adopt a quorum newer than this one at the next start_step
        self._fresh = True           # holds no state received from the run yet
        self.heal_chunk = HEAL_CHUNK  # bytes per heal message; each must arrive within Timeouts.op
        self.newcomers: tuple[int, ...] = ()  # ranks healed at this step's start_step
        self._on_abandon: list[Callable[[], None]] = []  # subgroups drop their groups with this one's
        if min_workers is None:
            min_workers = int(os.environ.get("SHOAL_MIN_WORKERS", "1"))
        info = {"rank": os.environ.get("RANK", "?"), "pid": os.getpid(), "host": host_identity(host_id)}
        # ``client``: a subclass that joins with its own MemberClient (a token, a role) passes it, so
        # that no second store connection is opened for nothing.
        self.client = client or MemberClient(_env("SHOAL_COORDINATOR", coordinator, "coordinator"),
                                             _env("SHOAL_RUN_ID", run_id, "run_id"), self.timeouts, min_workers, info,
                                             token=run_token(token))
        self._abort_store = self.client.store.clone()  # type: ignore[attr-defined]
        self.trace = Trace()
        self._discard_reasons: list[str] = []  # why each step since the last commit was discarded
        self.register_state("elastic/discards", lambda: list(self._discard_reasons), self._load_discards)
        # Joining waits for the first start_step: a newcomer that announced itself
        # while still building its model would keep the others waiting for it.

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    # --- state --------------------------------------------------------------
    def register_state(self, key: str, get: Callable[[], Any], load: Callable[[Any], Any],
                       rollback: bool = False, heal_load: Callable[[Any], Any] | None = None,
                       snapshot: Callable[[], Any] | None = None) -> None:
        """Add state that newcomers receive when they heal.

        ``get()`` returns something ``torch.save`` can write; ``load(x)``
        restores it. With ``rollback=True`` it is also snapshotted at each
        step start and restored when the step is discarded (e.g. a codec's
        error feedback, which a failed step may have half-updated); then
        ``get()`` must return a copy, not views of live tensors (codecs'
        ``state_dict()`` do), because it is called every step and copying
        it again would double the cost.
        ``heal_load(x)``, if given, replaces ``load`` when the state comes
        from a peer rather than from a rollback snapshot: state that is the
        peer's own and must not be copied (an error-feedback residual, see
        :meth:`shoal.codecs.Codec.newcomer_state`) is dropped there.
        ``snapshot()``, if given, replaces ``get`` for the per-step rollback
        snapshot: something cheaper that ``load`` accepts and that stays valid
        through one step (a codec's :meth:`~shoal.codecs.Codec.rollback_state`
        holds its tensors by reference and never overwrites them in place).
        Every member must register the same keys.
        """
        if key in self._states:
            raise ConfigError(f"state {key!r} is already registered on this group")
        self._states[key] = _State(get, load, rollback, heal_load, snapshot)

    def _load_discards(self, reasons: list[str]) -> None:
        self._discard_reasons = [str(r) for r in reasons]

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` after every committed step (e.g. to advance a data cursor)."""
        self._on_commit.append(fn)

    def before_start_step(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` at the top of every :meth:`start_step`, before it checks for an open step.

        For a strategy whose step ends lazily (NonBlocking votes an exchange
        when it waits for it, in the next forward): ``fn`` ends the open step
        (``should_commit()``), so that whatever starts the next one (a
        sampler's ``next_batch``, a forward) starts it after the verdict.
        """
        self._before_start.append(fn)

    @property
    def quorum_pending(self) -> bool:
        """Whether the next :meth:`start_step` adopts a new quorum (the same answer on every member).

        Strategies that vote only every few steps (local SGD, DiLoCo) run an
        extra, empty round when it is True so that a newcomer waiting to be
        admitted does not wait for another period.
        """
        return self.quorum is None or self._after >= self.quorum.qid

    # --- the step ------------------------------------------------------------
    def start_step(self) -> None:
        """Begin a step: adopt a newer quorum if one is due (rebuild + heal). Idempotent per step.

        Afterwards :attr:`newcomers` lists the ranks that received the run's
        state in this call (empty when no quorum was adopted): they bring no
        progress of their own to this step.
        """
        for fn in self._before_start:
            fn()
        if self._in_step:
            return
        self.newcomers = ()
        self._release_abandoned()
        if self.client.member_id == 0:
            self.client.join()
        if self.quorum is None or self._after >= self.quorum.qid:
            t0 = time.monotonic()
            self._reconfigure()
            self.stats.reconfigure_s = time.monotonic() - t0
        self._snapshots = {k: (s.snapshot or s.get)() for k, s in self._states.items() if s.rollback}
        self.error = None
        self._in_step = True

    def begin_step(self) -> None:
        """The step interface's name for :meth:`start_step` (see :mod:`shoal.comm.stepping`)."""
        self.start_step()

    def commit(self) -> bool:
        """The step interface's name for :meth:`should_commit` (see :mod:`shoal.comm.stepping`)."""
        return self.should_commit()

    def before_begin_step(self, fn: Callable[[], None]) -> None:
        """The step interface's name for :meth:`before_start_step`."""
        self.before_start_step(fn)

    def subgroup(self, rule: Partition, name: str) -> Any:
        """This worker's subgroup under ``rule``, re-applied to every quorum (an ElasticSubgroup)."""
        from shoal.comm.elastic_sub import ElasticSubgroup  # the subgroup module builds on this one
        return ElasticSubgroup(self, self.unique_name(name), rule)

    def host_groups(self, name: str) -> Any:
        """The two levels of a host-aware mean, recomputed for each quorum (an ElasticHostGroups)."""
        from shoal.comm.elastic_sub import ElasticHostGroups  # the subgroup module builds on this one
        return ElasticHostGroups(self, name)

    def should_commit(self) -> bool:
        """End the step: the same verdict on every member (True: apply it; False: drop it).

        On False, rollback state is restored and the next :meth:`start_step`
        moves to a new quorum without the failed peer.
        """
        if not self._in_step or self.quorum is None:
            raise ShoalError("should_commit() called outside a step: call start_step() first "
                             "(shoal's DistributedDataParallel does so in forward)")
        self._in_step = False
        q = self.quorum
        verdict = self._vote(q)
        self.trace("vote", verdict=verdict, qid=q.qid, step=self.step, member=self.client.member_id)
        commit, latest = verdict.startswith("commit"), int(verdict.partition(":")[2] or 0)
        if commit:
            self.step += 1
            self.stats.commits += 1
            self._discard_reasons = []
            for fn in self._on_commit:
                fn()
            if latest > q.qid:
                self._after = q.qid
            return True
        self.stats.discards += 1
        for k, snap in self._snapshots.items():
            self._states[k].load(snap)
        self._abandon()
        self.client.request_quorum(q.qid)
        self._after = q.qid
        self._count_discard()
        return False

    def _count_discard(self) -> None:
        """Raise PeerLostError once ``Timeouts.max_consecutive_discards`` steps in a row were discarded.

        Every member of a quorum reads the same verdicts, and the count is
        healed into newcomers, so all members raise at the same step. Retrying
        cannot cure a failure that repeats at every step (a deterministic
        error, a NaN reported every step): without a limit the run would loop
        forever without training.
        """
        if self.error is not None:
            why = f"{type(self.error).__name__}: {self.error}"
        elif self.client.remote_abort.is_set():
            why = "another member reported a failure"
        else:
            why = "another member voted to discard (or the vote outlasted Timeouts.quorum)"
        self._discard_reasons.append(why[:300])
        limit = self.timeouts.max_consecutive_discards
        if len(self._discard_reasons) < limit:
            return
        seen = Counter(self._discard_reasons).most_common(3)
        raise PeerLostError(
            f"{len(self._discard_reasons)} steps in a row were discarded (Timeouts.max_consecutive_discards="
            f"{limit}): the failure repeats at every step, so retrying cannot help; fix its cause (or raise the "
            "limit if peers are lost that often). Reasons seen by this member: "
            + "; ".join(f"{why} (x{n})" for why, n in seen))

    def _vote(self, q: Quorum) -> str:
        st, key = self.client.store, f"{q.prefix}d/{self.step}"
        if self.error is None and self.size == 1:
            return f"commit:{self.client.latest()}"
        if self.error is not None:
            return self._decide(key, "discard")
        if st.add(f"{q.prefix}ok/{self.step}", 1) == self.size:
            return self._decide(key, f"commit:{self.client.latest()}")
        start = time.monotonic()
        deadline, pause, beats = start + self.timeouts.quorum, 5e-5, self._beats(q)
        next_probe = start + self.timeouts.probe
        while not st.check([key]):
            now = time.monotonic()
            if now > next_probe:
                # A peer that died after its last collective never votes; its
                # heartbeat stops too. Judge it here rather than wait for the
                # coordinator's heartbeat_timeout.
                latest, next_probe = self._beats(q), now + self.timeouts.probe
                if any(a == b for a, b in zip(beats, latest)):
                    self._record(PeerLostError("a member stopped heartbeating before voting"))
                beats = latest
            if self.error is not None or self.client.remote_abort.is_set() or now > deadline:
                return self._decide(key, "discard")
            time.sleep(pause)
            pause = min(2 * pause, 0.001)   # the decision is read at most ~1 ms late (a store RTT is ~15 us)
        return self._decision(st.get(key))

    def _decide(self, key: str, verdict: str) -> str:
        """Write ``verdict`` as the step's decision unless one is there; return the one that stands.

        Signed by this member (:mod:`shoal.comm.records`): a decision written by someone without the
        run token (say a forged ``commit`` for a step that failed) reads as ``discard`` on every member.
        """
        return self._decision(self.client.store.compare_set(key, "", self.client.book.seal({"d": verdict})))

    def _decision(self, raw: Any) -> str:
        rec = self.client.book.open(raw, kind="vote")
        d = rec.get("d") if rec is not None else None
        return d if isinstance(d, str) and (d == "discard" or d.startswith("commit:")) else "discard"

    def _beats(self, q: Quorum) -> list[bytes]:
        return list(self.client.store.multi_get([self.client.key(f"hb/{m}") for m in q.members]))

    # --- quorums ---------------------------------------------------------------
    def _reconfigure(self) -> None:
        limit = self.timeouts.join if self._fresh else self.timeouts.quorum
        deadline = time.monotonic() + limit
        while True:
            q = self.client.wait_quorum(self._after, max(deadline - time.monotonic(), 0.0))
            self.trace("quorum", qid=q.qid, size=len(q.members))
            if self._enter(q, deadline):
                return
            self._after = q.qid
            if time.monotonic() > deadline:
                raise ShoalError(f"could not form a working group within {limit} s "
                                 f"(last error: {self.error}); see docs/elastic.md on timeouts")

    def _enter(self, q: Quorum, deadline: float) -> bool:
        """Rendezvous, build the group, heal; False if superseded or failed (then try the next)."""
        self._abandon()
        st = self.client.store
        st.add(q.prefix + "arrive", 1)
        # A store-level barrier first: unlike the gloo constructor it can give up
        # as soon as a newer quorum supersedes this one.
        while st.add(q.prefix + "arrive", 0) < len(q.members):
            if self.client.latest() > q.qid or time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        self.trace("barrier", qid=q.qid)
        self.client.remote_abort.clear()
        self.client.watched_prefix = q.prefix
        self.quorum, self.rank, self.size = q, q.rank_of(self.client.member_id), len(q.members)
        self._global_ranks = list(range(self.size))
        self.error = None
        try:
            pg_store = dist.PrefixStore(q.prefix + "pg/", st.clone())  # type: ignore[attr-defined]
            spec = BackendSpec(pg_store, self.rank, self.size, self.timeouts.op, lambda: self.step)
            self.pg = self._factory(spec) if self.size > 1 else None
        except Exception as e:  # noqa: BLE001 - a peer did not connect: next quorum
            self._record(PeerLostError(f"building the group of quorum {q.qid} failed: {e}"))
        self.stats.quorums += 1
        self.trace("built", qid=q.qid, ok=self.error is None)
        if self.error is None:
            self._heal(q)
            self.trace("healed", qid=q.qid, ok=self.error is None)
        if self.error is not None:
            self._abandon()
            self.client.request_quorum(q.qid)
            return False
        return True

    def _heal(self, q: Quorum) -> None:
        t0 = time.monotonic()
        mine = torch.tensor([self.step, int(self._fresh)], dtype=torch.int64, device=self.device)
        table = torch.empty(2 * self.size, dtype=torch.int64, device=self.device)
        self.all_gather_into(table, mine, tag=CONTROL_TAG).wait()
        if self.error is not None:
            return
        steps, fresh = table[0::2].tolist(), table[1::2].tolist()
        top = max(steps)
        ready = [r for r in range(self.size) if steps[r] == top and not fresh[r]]
        src = min(ready or [r for r in range(self.size) if steps[r] == top])
        needy = [r for r in range(self.size) if r != src and (steps[r] < top or fresh[r])]
        self.quorum = replace(q, max_step=top)
        if needy:
            blob = self._blob() if self.rank == src else torch.empty(0, dtype=torch.uint8, device=self.device)
            n = torch.tensor([blob.numel()], dtype=torch.int64, device=self.device)
            self.broadcast(n, src=src, tag=HEAL_TAG).wait()
            if self.rank != src:
                blob = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
            if self.rank == src or self.rank in needy:
                self._send_state(blob, src, needy)
            self._healed_barrier(q)
            if self.error is not None:
                return
            self.stats.heal_bytes = blob.numel()
            self.newcomers = tuple(needy)
            if self.rank in needy:
                self._load_blob(blob, src)
                self.step = top
                self.stats.heals_received += 1
            self.stats.heal_s = time.monotonic() - t0
        self._fresh = False

    def _send_state(self, blob: torch.Tensor, src: int, needy: list[int]) -> None:
        """Copy ``src``'s blob into the ``needy`` members' ``blob``, point to point, in chunks.

        Only the members that need the state receive it (a broadcast would
        push it through every member's link), and every chunk is one
        operation bounded by ``Timeouts.op``; with :meth:`_healed_barrier`
        (bounded by ``Timeouts.quorum``) a state that takes longer than
        ``op`` to cross a slow link still heals.
        """
        step = self.heal_chunk
        for i, start in enumerate(range(0, blob.numel(), step)):
            chunk = blob[start:start + step]
            if self.rank == src:
                handles = [self._p2p("send", chunk, dst, i) for dst in needy]
            else:
                handles = [self._p2p("recv", chunk, src, i)]
            for h in handles:
                h.wait()
            if self.error is not None:
                return

    def _healed_barrier(self, q: Quorum) -> None:
        """Wait in the store until every member is past the heal (``Timeouts.quorum``), or a failure.

        Members not involved in the heal would otherwise wait for the others
        in their next collective, i.e. only ``Timeouts.op``.
        """
        st, key = self.client.store, q.prefix + "healed"
        st.add(key, 1)
        deadline = time.monotonic() + self.timeouts.quorum
        while st.add(key, 0) < self.size:
            if self.error is not None:
                return
            if self.client.remote_abort.is_set():
                self._record(PeerLostError("a member failed while the run's state was healed"))
                return
            if time.monotonic() > deadline:
                self._record(CommTimeoutError(f"healing did not finish within {self.timeouts.quorum} s "
                                              "(Timeouts.quorum)"))
                return
            time.sleep(0.002)

    def _p2p(self, op: str, chunk: torch.Tensor, peer: int, slot: int) -> Handle:
        self.meter.record(HEAL_TAG, op, _nbytes(chunk), self.size, self.rank)
        if op == "send":
            return self._issue(HEAL_TAG, chunk, lambda: self.pg.send([chunk], peer, slot), whole=True)
        return self._issue(HEAL_TAG, chunk, lambda: self.pg.recv([chunk], peer, slot), whole=True)

    def _blob(self) -> torch.Tensor:
        return to_bytes({k: s.get() for k, s in self._states.items()})

    def _load_blob(self, blob: torch.Tensor, src: int) -> None:
        """Load the healing peer's state, all of it or (refused: leave the run and raise) none of it."""
        why: str | None = None
        try:
            states = from_bytes(blob)
        except Exception as e:  # noqa: BLE001 - whatever a malformed blob makes torch.load raise
            states, why = None, f"it is not a state blob ({type(e).__name__}: {e})"
        if why is None and (not isinstance(states, dict) or set(states) != set(self._states)):
            why = (f"it holds state {sorted(map(str, states)) if isinstance(states, dict) else '?'} but this "
                   f"worker registered {sorted(self._states)}: every worker must run the same program")
        if why is None and isinstance(states, dict):
            why = check_received(states, {k: s.get() for k, s in self._states.items()})
        if why is not None or not isinstance(states, dict):
            member = self.quorum.members[src] if self.quorum is not None else "?"
            log.error("refusing the state healed from rank %d (member %s): %s; nothing of it was loaded, "
                      "this worker leaves the run", src, member, why)
            self.leave()   # the others drop it at once (the coordinator aborts their quorum)
            raise ShoalError(f"refused the run's state healed from rank {src} (member {member}): {why}; "
                             "nothing of it was loaded")
        for k, s in self._states.items():
            (s.heal_load or s.load)(states[k])

    def _abandon(self) -> None:
        if self.pg is not None:
            self._abandoned.append((time.monotonic(), self.pg))
        self.pg = None
        for drop in self._on_abandon:
            drop()

    def _release_abandoned(self) -> None:
        # Past the op timeout gloo has failed their stuck operations: dropping them is quick now.
        horizon = time.monotonic() - self.timeouts.op - 1.0
        self._abandoned = [(t, pg) for t, pg in self._abandoned if t > horizon]

    def leave(self) -> None:
        """Leave the run: the others go on without this worker (at most one step is discarded)."""
        self.client.leave()
        self._abandon()

    # --- failures --------------------------------------------------------------
    def _record(self, err: BaseException) -> None:
        with self._lock:
            first = self.error is None
            if first:
                self.error = err
        if first:
            self.trace("error", what=str(err)[:200])
        if first and self.quorum is not None:
            try:
                with self._lock:
                    self._abort_store.set(self.quorum.prefix + "abort", type(err).__name__)
            except Exception:  # noqa: BLE001 - coordinator unreachable: peers time out instead
                pass

    def report_error(self, err: BaseException) -> None:
        """Make this step fail on every member (e.g. a NaN found outside shoal)."""
        self._record(err)

    def _await(self, work: Any, limit: float | None, tag: str, whole: bool = False) -> bool:
        """Wait for ``work``; on any failure record it and return False, never raise.

        Waits in slices of ``work.wait(timeout)`` in this thread: no Python
        callback is attached to the work's future, because gloo runs those in
        its own threads, where a garbage collection could destroy a process
        group whose peer just closed its sockets, and an exception there
        aborts the process (an uncaught gloo::IoException).
        ``whole``: one wait for the whole limit instead (point-to-point work:
        a timed wait on a gloo send or recv that runs out closes every
        connection of the group, so it must not be sliced).
        """
        if self.error is not None:
            return False
        deadline = time.monotonic() + (limit if limit is not None else self.timeouts.op)
        if whole:
            try:
                work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                return True
            except RuntimeError as e:
                late = time.monotonic() >= deadline
                self._record(CommTimeoutError(f"{tag!r} did not finish within {limit} s (Timeouts.op)") if late
                             else PeerLostError(f"{tag!r} failed: {e}"))
                return False
        while True:
            try:
                work.wait(_SLICE)
                return True
            except RuntimeError as e:
                if work.is_completed():      # a failure, not the end of a slice
                    return self._finish(work, tag, e)
            if self.error is not None:
                return False
            if self.client.remote_abort.is_set():
                self._record(PeerLostError(f"collective {tag!r} abandoned: another member reported a failure"))
                return False
            if time.monotonic() > deadline:
                self._record(CommTimeoutError(f"collective {tag!r} did not finish within {limit} s "
                                              "(Timeouts.op); a peer is slow, hung or gone"))
                return False

    def _finish(self, work: Any, tag: str, e: RuntimeError) -> bool:
        try:
            work.wait()                      # completed: returns at once, or raises its own error
        except RuntimeError as err:
            e = err
        else:
            return True                      # it completed just after the slice ran out
        self._record(PeerLostError(f"collective {tag!r} failed: {e}"))
        return False

    # --- collectives ---------------------------------------------------------------
    def _issue(self, tag: str, result: Any, launch: Callable[[], Any],
               post: Callable[[Any], Any] | None = None, whole: bool = False) -> Handle:
        if self.quorum is None:
            raise ShoalError("collective on an elastic group before its first step: call start_step() "
                             "first (shoal's DistributedDataParallel does so in forward)")
        if self.size == 1:
            return Handle(None, result, self.meter, tag, self.timeout, post)
        if self.error is not None or self.pg is None:
            return Handle(None, result, self.meter, tag, self.timeout)   # the step is lost anyway
        try:
            work = launch()
        except Exception as e:  # noqa: BLE001 - e.g. the connection died before the op started
            self._record(PeerLostError(f"collective {tag!r} could not start: {e}"))
            return Handle(None, result, self.meter, tag, self.timeout)
        return _ElasticHandle(self, work, result, tag, post, whole)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", tag: str = "misc") -> Handle:
        check_reduce_op(op)
        self.meter.record(tag, "all_reduce", _nbytes(tensor), self.size, self.rank)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _REDUCE_OPS["sum" if op == "avg" else op]  # type: ignore[assignment]
        size = self.size  # averages divide by the live contributors of this quorum
        post = (lambda t: t.div_(size)) if op == "avg" else None  # noqa: E731
        return self._issue(tag, tensor, lambda: self.pg.allreduce([tensor], opts), post)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, tag: str = "misc") -> Handle:
        self._check_rank(src, "src")
        self.meter.record(tag, "broadcast", _nbytes(tensor), self.size, self.rank, src)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        return self._issue(tag, tensor, lambda: self.pg.broadcast([tensor], opts))

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: str = "sum", tag: str = "misc") -> Handle:
        """Reduce into rank ``dst``'s ``tensor`` (e.g. the intra-host stage of a two-level mean)."""
        self._check_rank(dst, "dst")
        if op not in _REDUCE_OPS:
            raise ConfigError(f"reduce supports {sorted(_REDUCE_OPS)}, got {op!r}")
        self.meter.record(tag, "reduce", _nbytes(tensor), self.size, self.rank, dst)
        opts = dist.ReduceOptions()
        opts.reduceOp, opts.rootRank, opts.rootTensor = _REDUCE_OPS[op], dst, 0  # type: ignore[assignment]
        return self._issue(tag, tensor, lambda: self.pg.reduce([tensor], opts))

    def all_gather(self, tensor: torch.Tensor, tag: str = "misc") -> Handle:
        self.meter.record(tag, "all_gather", _nbytes(tensor), self.size, self.rank)
        out = [tensor] if self.size == 1 else [torch.empty_like(tensor) for _ in range(self.size)]
        return self._issue(tag, out, lambda: self.pg.allgather([out], [tensor.contiguous()]))

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, tag: str = "misc") -> Handle:
        if output.numel() != self.size * tensor.numel():
            raise ValueError(f"output has {output.numel()} elements, expected {self.size} x {tensor.numel()}")
        self.meter.record(tag, "all_gather", _nbytes(tensor), self.size, self.rank)
        if self.size == 1:
            output.view(-1).copy_(tensor.view(-1))
        return self._issue(tag, output, lambda: self.pg._allgather_base(output, tensor.contiguous()))

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, tag: str = "misc") -> Handle:
        check_all_to_all(output, tensor, self.size)
        self.meter.record(tag, "all_to_all", _nbytes(tensor), self.size, self.rank)
        if self.size == 1:
            output.view(-1).copy_(tensor.view(-1))
        src = tensor.contiguous()
        return self._issue(tag, output, lambda: self.pg.alltoall_base(output, src, [], [], dist.AllToAllOptions()))

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, op: str = "sum", tag: str = "misc") -> Handle:
        if tensor.numel() != self.size * output.numel():
            raise ValueError(f"input has {tensor.numel()} elements, expected {self.size} x {output.numel()}")
        if op not in ("sum", "avg"):
            raise ConfigError(f"reduce_scatter supports sum and avg, got {op!r}")
        buf = tensor.clone()
        chunk = buf.view(-1).narrow(0, self.rank * output.numel(), output.numel())
        inner = self.all_reduce(buf, op=op, tag=tag)   # gloo has no reduce_scatter

        def take(_: Any) -> torch.Tensor:
            inner.wait()
            return output.view(-1).copy_(chunk).view_as(output)

        return Handle(None, output, self.meter, tag, self.timeout, take)

    def barrier(self, tag: str = "control") -> None:
        self.all_reduce(torch.zeros(1, device=self.device), tag=tag).wait()

    def all_gather_object(self, obj: Any, tag: str = "control") -> list[Any]:
        """Gather objects (see :func:`shoal.comm.objects.all_gather_object`); after a failure, ``[obj] * size``."""
        return all_gather_object(self, obj, tag)

    def split(self, ranks_per_subgroup: Sequence[Sequence[int]]) -> "Group | None":
        raise ShoalError("an elastic group cannot be split: its members change from one quorum to the "
                         "next; use shoal.comm.elastic_sub.ElasticSubgroup (a rule applied to each quorum)")

    def __repr__(self) -> str:
        qid = self.quorum.qid if self.quorum else None
        return f"ElasticGroup(member={self.client.member_id}, quorum={qid}, rank={self.rank}, size={self.size}, step={self.step})"


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
