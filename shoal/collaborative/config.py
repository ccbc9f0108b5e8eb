"""CollaborativeConfig: every option of a collaborative run, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shoal.codecs.base import Codec
from shoal.codecs.cast import Cast
from shoal.membership.auth import check_token
from shoal.membership.coordinator import Timeouts
from shoal.errors import ConfigError


def _positive_int(name: str, v: object, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"CollaborativeConfig.{name} must be an integer >= 1{' or None' if allow_none else ''}, got {v!r}")


def _seconds(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"CollaborativeConfig.{name} must be a finite number of seconds > 0, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class CollaborativeConfig:
    """Options of :class:`~shoal.collaborative.CollaborativeOptimizer` (hivemind.Optimizer's, same meanings).

    Attributes:
        run_id: names the run at the coordinator; peers with the same run_id train together.
        target_batch_size: samples the whole swarm accumulates per epoch (one optimizer step).
        batch_size_per_step: samples per ``step()`` call on this peer (``step(batch_size=...)`` overrides).
        coordinator: ``"host:port"`` of the coordinator (None: ``$SHOAL_COORDINATOR``).
        token: run token; with one, peers prove they hold it when they join (HMAC challenge, never sent).
        matchmaking_time: once the target is reached, how long the first ready peer waits for the
            others before averaging with whoever is ready. The window closes early as soon as every
            live peer is ready, so on a healthy swarm it costs nothing; it is paid only when a peer
            is slow or gone (a dead peer is noticed sooner, by its stopped heartbeat).
        averaging_timeout: longest an epoch's averaging (matchmaking, retries after a lost peer,
            collectives) may take before this peer steps with its local gradients.
        load_state_timeout: longest a peer that is behind waits to receive the swarm's state.
        grad_codec: how gradients travel (default: exact fp32, ``Identity``).
        state_averaging_codec: how parameters and optimizer statistics travel when averaged.
        state_loading_codec: ``None`` (exact) or a ``Cast`` codec: floating state sent to a
            peer that loads it travels in that dtype.
        average_state_every: average parameters, ``average_opt_statistics`` and extra tensors every
            this many epochs (0: never). Gradient averaging keeps peers equal; this repairs the drift
            of a peer that stepped alone after a failed round.
        average_opt_statistics: optimizer state keys averaged with the parameters (e.g. ``("exp_avg_sq",)``).
        delay_optimizer_step: run the optimizer step in the background; the result is applied at
            the next ``step()`` (needs ``offload_optimizer``, so the background step never writes
            parameters that a forward is reading).
        delay_grad_averaging: also average gradients in the background (needs ``delay_optimizer_step``);
            the epoch's report then appears in ``rounds`` once applied, and an epoch that reaches
            its target while the previous round runs waits for it.
        offload_optimizer: the optimizer works on a host-memory copy of the parameters.
        reuse_grad_buffers: accumulate in the parameters' ``.grad`` (saves one copy of the model;
            do not call ``zero_grad``: shoal zeroes them after each epoch; every batch counts
            equally; not with ``step(grad_scaler=...)``).
        client_mode: this peer is never chosen to send state to others (see docs/collaborative.md).
        auxiliary: this peer does no compute: it takes part in averaging with weight 0.
        verbose: log one line per epoch.
        max_state_bytes: size bound of a state blob received from a peer.
        heartbeat_timeout: a peer silent this long is dropped from the swarm.

    Example::

        cfg = CollaborativeConfig(run_id="mlp", target_batch_size=4096, batch_size_per_step=64,
                                  coordinator="10.0.0.1:29400", token="s3cret-token")
        CollaborativeConfig(run_id="x", target_batch_size=0)   # ConfigError: target_batch_size
    """

    run_id: str
    target_batch_size: int
    batch_size_per_step: int | None = None
    coordinator: str | None = None
    token: str | None = None
    matchmaking_time: float = 5.0        # only paid when a peer is late; hivemind's 15 s is for the internet
    averaging_timeout: float = 60.0      # a 100 MB model at 20 Mbit/s needs ~40 s per round
    load_state_timeout: float = 120.0    # a full state (params + Adam moments) is ~3x the model
    grad_codec: Codec | None = None
    state_averaging_codec: Codec | None = None
    state_loading_codec: Codec | None = None
    average_state_every: int = 5         # cheap drift repair: one extra parameter round every 5 epochs
    average_opt_statistics: tuple[str, ...] = ()
    delay_optimizer_step: bool = False
    delay_grad_averaging: bool = False
    offload_optimizer: bool = False
    reuse_grad_buffers: bool = False
    client_mode: bool = False
    auxiliary: bool = False
    verbose: bool = False
    max_state_bytes: int = 1 << 34       # 16 GiB: a bound against a peer announcing absurd sizes
    heartbeat_timeout: float = 5.0       # a GC pause must not evict a peer

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id or "/" in self.run_id:
            raise ConfigError(f"CollaborativeConfig.run_id must be a non-empty string without '/', got {self.run_id!r}")
        _positive_int("target_batch_size", self.target_batch_size)
        _positive_int("batch_size_per_step", self.batch_size_per_step, allow_none=True)
        check_token(self.token)
        for name in ("matchmaking_time", "averaging_timeout", "load_state_timeout", "heartbeat_timeout"):
            _seconds(name, getattr(self, name))
        if self.matchmaking_time >= self.averaging_timeout:
            raise ConfigError(f"CollaborativeConfig.matchmaking_time ({self.matchmaking_time} s) must be < "
                              f"averaging_timeout ({self.averaging_timeout} s): matchmaking is part of averaging")
        if isinstance(self.average_state_every, bool) or not isinstance(self.average_state_every, int) \
                or self.average_state_every < 0:
            raise ConfigError(f"CollaborativeConfig.average_state_every must be an integer >= 0 (0: never), "
                              f"got {self.average_state_every!r}")
        if isinstance(self.average_opt_statistics, str) or not all(
                isinstance(k, str) for k in self.average_opt_statistics):
            raise ConfigError("CollaborativeConfig.average_opt_statistics must be a tuple of optimizer state keys "
                              f"such as ('exp_avg_sq',), got {self.average_opt_statistics!r}")
        for name in ("grad_codec", "state_averaging_codec"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, Codec):
                raise ConfigError(f"CollaborativeConfig.{name} must be a shoal Codec or None, got {type(v).__name__}")
        self._check_modes()
        _positive_int("max_state_bytes", self.max_state_bytes)

    def _check_modes(self) -> None:
        if self.state_loading_codec is not None and not isinstance(self.state_loading_codec, Cast):
            raise ConfigError("CollaborativeConfig.state_loading_codec must be None or a shoal.codecs.Cast: state "
                              f"is sent once to one peer, not averaged, got {type(self.state_loading_codec).__name__}")
        if self.delay_grad_averaging and not self.delay_optimizer_step:
            raise ConfigError("CollaborativeConfig.delay_grad_averaging=True needs delay_optimizer_step=True: the "
                              "background averaging hands its result to a background optimizer step")
        if self.delay_optimizer_step and not self.offload_optimizer:
            raise ConfigError("CollaborativeConfig.delay_optimizer_step=True needs offload_optimizer=True, so that "
                              "the background step updates a copy and never parameters a forward is reading")
        if self.auxiliary and self.client_mode:
            raise ConfigError("CollaborativeConfig: an auxiliary peer exists to serve the swarm; "
                              "auxiliary=True with client_mode=True would serve nothing")

    def timeouts(self) -> Timeouts:
        """The membership timeouts derived from this config (one validated hierarchy)."""
        hb = self.heartbeat_timeout
        quorum = max(self.averaging_timeout, self.load_state_timeout, hb) + 10.0
        return Timeouts(op=self.averaging_timeout, heartbeat_interval=min(0.1, hb / 10), probe=min(0.5, hb),
                        heartbeat_timeout=hb, quorum=quorum, join=quorum + self.load_state_timeout)
