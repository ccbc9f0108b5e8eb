"""DASO's schedule for a scripted loss sequence: which steps sync globally, when results land."""

from __future__ import annotations

import pytest
import torch

from shoal.errors import ConfigError
from shoal.strategies.daso import DASOConfig, DASOSchedule


def test_skips_grow_on_plateaus_reset_when_the_loss_moves_and_results_land_later() -> None:
    losses = [5.0, 4.0, 3.9, 3.85, 3.84, 2.0, 1.99, 1.98]
    s = DASOSchedule(DASOConfig(total_epochs=8, steps_per_epoch=8, warmup_epochs=1, cooldown_epochs=1,
                                max_global_skips=8, stability_level=0.05))
    skips = []
    for loss in losses:
        skips.append(s.global_skips)
        s.record_loss(loss)
        for _ in range(8):
            s.after_step()
    # epoch 0 warm-up; 1 first cycling epoch (starts at 1); 4.0 vs 5.0 moved -> 1; 3.9 vs 4.0 within 5% -> 2;
    # then 4, 8; 2.0 moved -> 1; epoch 7 is the cool-down.
    assert skips == [1, 1, 1, 2, 4, 8, 1, 1]
    by_epoch = {e: [(t, kind) for t, kind, _ in s.events if t // 8 == e] for e in range(8)}
    every_step = [(t, k) for t in range(8) for k in ("launch", "land")]
    assert by_epoch[0] == every_step  # warm-up: blocking global sync every step
    assert by_epoch[7] == [(t + 56, k) for t, k in every_step]  # cool-down likewise
    assert by_epoch[3] == [(24, "launch"), (24, "land"), (26, "launch"), (26, "land"),
                           (28, "launch"), (28, "land"), (30, "launch"), (30, "land")]  # skips 2: 2 // 4 = 0 steps to wait
    assert by_epoch[4] == [(32, "launch"), (33, "land"), (36, "launch"), (37, "land")]  # skips 4: lands 1 step later
    assert by_epoch[5] == [(40, "launch"), (42, "land")]  # skips 8: lands 8 // 4 = 2 steps later


def test_a_late_landing_is_pulled_back_to_the_epoch_end() -> None:
    s = DASOSchedule(DASOConfig(total_epochs=5, steps_per_epoch=2, warmup_epochs=0, cooldown_epochs=0,
                                max_global_skips=16, stability_level=0.5))
    for _ in range(4):  # no previous loss, then plateaus: 1 -> 1 -> 2 -> 4 -> 8
        s.record_loss(1.0)
        for _ in range(2):
            s.after_step()
    assert s.global_skips == 8 and s.batches_to_wait == 2
    s.record_loss(1.0)
    # launched at the epoch's step 0, due 2 steps later, but epochs end with nothing in flight
    assert [s.after_step() for _ in range(2)] == [(True, False), (False, True)]


def test_no_loss_reported_keeps_syncing_every_step_and_state_round_trips() -> None:
    cfg = DASOConfig(total_epochs=4, steps_per_epoch=3, warmup_epochs=0, cooldown_epochs=0)
    s = DASOSchedule(cfg)
    assert all(s.after_step() == (True, True) for _ in range(9))
    s2 = DASOSchedule(cfg)
    s2.load_state_dict(s.state_dict())
    assert s2.step == 9 and s2.global_skips == 1


@pytest.mark.parametrize("kwargs, match", [
    ({"total_epochs": 0, "steps_per_epoch": 1}, "total_epochs"),
    ({"total_epochs": 3, "steps_per_epoch": 1, "warmup_epochs": -1}, "warmup_epochs"),
    ({"total_epochs": 3, "steps_per_epoch": 1, "stability_level": 1.5}, "stability_level"),
    ({"total_epochs": 3, "steps_per_epoch": 1, "downcast_type": torch.int8}, "downcast_type"),
    ({"total_epochs": 3, "steps_per_epoch": 1, "max_global_skips": 0}, "max_global_skips"),
])
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DASOConfig(**kwargs)
