"""CollaborativeConfig validation, header judgement, auth refusal and state_dict, in one process."""

from __future__ import annotations

import copy
import uuid

import pytest
import torch
from torch import nn

import shoal
from shoal.codecs import Cast, Int8Blockwise
from shoal.collaborative.validate import (FLAG_CLIENT, FLAG_FRESH, check_state, encode_header, judge_headers,
                                          layout_digest)
from shoal.membership.coordinator import Coordinator
from shoal.errors import AuthError, ConfigError

TOKEN = "unit-token-123"


@pytest.mark.parametrize("kw, word", [
    ({"target_batch_size": 0}, "target_batch_size"),
    ({"batch_size_per_step": -1}, "batch_size_per_step"),
    ({"run_id": "a/b"}, "run_id"),
    ({"matchmaking_time": 0}, "matchmaking_time"),
    ({"matchmaking_time": 70.0}, "matchmaking_time"),
    ({"average_state_every": -1}, "average_state_every"),
    ({"average_opt_statistics": "exp_avg"}, "average_opt_statistics"),
    ({"delay_grad_averaging": True}, "delay_optimizer_step"),
    ({"delay_optimizer_step": True}, "offload_optimizer"),
    ({"auxiliary": True, "client_mode": True}, "auxiliary"),
    ({"token": "short"}, "token"),
    ({"state_loading_codec": Int8Blockwise()}, "state_loading_codec"),
    ({"grad_codec": "fp16"}, "grad_codec"),
])
def test_config_errors_name_the_value(kw: dict, word: str) -> None:
    base = {"run_id": "r", "target_batch_size": 64}
    with pytest.raises(ConfigError, match=word):
        shoal.CollaborativeConfig(**{**base, **kw})


def test_config_timeouts_form_a_valid_hierarchy() -> None:
    cfg = shoal.CollaborativeConfig(run_id="r", target_batch_size=64, averaging_timeout=30, load_state_timeout=90,
                                    state_loading_codec=Cast(torch.float16))
    t = cfg.timeouts()
    assert t.op == 30 and t.quorum > 90 and t.join > t.quorum


def _h(member: int, epoch: int = 3, weight: int = 32, finite: bool = True, numel: int = 6, flags: int = 0,
       digest: int | None = None) -> torch.Tensor:
    d = layout_digest(["w"], [torch.zeros(numel)]) if digest is None else digest
    return encode_header(member, epoch, weight, finite, d, numel, flags)


def test_headers_majority_layout_and_bounds() -> None:
    v = judge_headers([_h(1), _h(2), _h(3, numel=7)], [1, 2, 3], max_weight=256, round_epoch=3)
    assert v.violators == [2] and "layout" in v.reasons[2]
    v = judge_headers([_h(1), _h(2, weight=10_000)], [1, 2], max_weight=256, round_epoch=3)
    assert v.violators == [1] and "weight" in v.reasons[1]
    v = judge_headers([_h(1), _h(5)], [1, 2], max_weight=256, round_epoch=3)
    assert v.violators == [1] and "member id" in v.reasons[1]
    v = judge_headers([_h(1), _h(2, finite=False)], [1, 2], max_weight=256, round_epoch=3)
    assert v.violators == [1]
    v = judge_headers([_h(1), _h(2, finite=False, weight=0)], [1, 2], max_weight=256, round_epoch=3)
    assert v.violators == [] and v.weights == [32, 0]


def test_headers_behind_peers_get_weight_zero_and_a_non_client_source() -> None:
    v = judge_headers([_h(1, flags=FLAG_CLIENT), _h(2), _h(3, epoch=1)], [1, 2, 3], max_weight=256, round_epoch=3)
    assert v.epoch == 3 and v.behind == [2] and v.source == 1 and v.weights == [32, 32, 0]
    # only a client is up to date: nobody serves
    v = judge_headers([_h(1, flags=FLAG_CLIENT), _h(2, epoch=1)], [1, 2], max_weight=256, round_epoch=3)
    assert v.source is None and v.behind == []
    # all fresh at the start: the lowest non-client rank sends its parameters, everyone keeps its weight
    v = judge_headers([_h(1, flags=FLAG_FRESH | FLAG_CLIENT), _h(2, flags=FLAG_FRESH), _h(3, flags=FLAG_FRESH)],
                      [1, 2, 3], max_weight=256, round_epoch=3)
    assert v.source == 1 and v.behind == [0, 2] and v.weights == [32, 32, 32]


def test_headers_an_epoch_ahead_of_the_round_is_a_violation_and_never_the_source() -> None:
    # Without the rule, rank 2's claim would make it the round's epoch and its only up-to-date
    # member: the source every other member loads state from.
    v = judge_headers([_h(1), _h(2), _h(3, epoch=10**6)], [1, 2, 3], max_weight=256, round_epoch=3)
    assert v.violators == [2] and "ahead of the round" in v.reasons[2]
    assert v.epoch == 3 and v.source == 0 and v.behind == []
    v = judge_headers([_h(1), _h(2, epoch=4)], [1, 2], max_weight=256, round_epoch=3)
    assert v.violators == [1], "even one epoch ahead of the round is a lie"
    # a member behind the round's epoch is legitimate: it loads state
    v = judge_headers([_h(1), _h(2, epoch=1)], [1, 2], max_weight=256, round_epoch=3)
    assert v.violators == [] and v.behind == [1] and v.source == 0


def test_verdict_without_a_caught_source_picks_the_next_candidate() -> None:
    v = judge_headers([_h(1, flags=FLAG_FRESH), _h(2, flags=FLAG_FRESH), _h(3, epoch=1)], [1, 2, 3],
                      max_weight=256, round_epoch=3)
    assert v.source == 0 and v.behind == [1, 2]
    w = v.without([0])
    assert w.source == 1 and w.behind == [0, 2]
    assert v.without([0, 1]).source is None and v.without([0, 1]).behind == []
    assert v.without([2]) is v, "a bad member that is not the source changes nothing"


def test_check_state_rejects_shape_dtype_and_nan() -> None:
    local = {"a": torch.zeros(2, 3)}
    assert check_state({"a": torch.zeros(2, 3)}, local) is None
    assert "shape" in str(check_state({"a": torch.zeros(3, 2)}, local))
    assert "NaN" in str(check_state({"a": torch.full((2, 3), float("nan"))}, local))
    assert "dtype" in str(check_state({"a": torch.zeros(2, 3, dtype=torch.int64)}, local))


def _opt(address: str, token: str | None, run: str) -> shoal.CollaborativeOptimizer:
    net = nn.Linear(4, 2)
    cfg = shoal.CollaborativeConfig(run_id=run, target_batch_size=8, batch_size_per_step=4, coordinator=address,
                                    token=token, matchmaking_time=0.5, averaging_timeout=10)
    return shoal.CollaborativeOptimizer(lambda ps: torch.optim.Adam(ps, lr=0.1), net.named_parameters(), config=cfg)


@pytest.mark.timeout(60)
def test_wrong_token_is_refused_and_state_dict_round_trips() -> None:
    torch.set_num_threads(1)
    coord = Coordinator(port=0, token=TOKEN).start()
    try:
        with pytest.raises(AuthError, match="refused"):
            _opt(coord.address, "not-the-token", "r" + uuid.uuid4().hex[:6])
        opt = _opt(coord.address, TOKEN, "r" + uuid.uuid4().hex[:6])
        params = opt.params
        for _ in range(4):          # alone: 2 steps of 4 samples make an epoch of 8
            (params[0].sum() + params[1].sum()).backward()
            opt.step()
            opt.zero_grad()
        assert opt.local_epoch == 2 and opt.last_round is not None and opt.last_round.samples == 8
        sd = opt.state_dict()
        assert sd["local_epoch"] == 2
        frozen = copy.deepcopy(sd)
        other = _opt(coord.address, TOKEN, "r" + uuid.uuid4().hex[:6])
        other.load_state_dict(sd)
        assert other.local_epoch == 2
        assert torch.equal(other.optimizer.state_dict()["state"][0]["exp_avg"], sd["optimizer"]["state"][0]["exp_avg"])
        assert sd.keys() == frozen.keys() and sd["local_epoch"] == frozen["local_epoch"]
        assert torch.equal(sd["optimizer"]["state"][0]["exp_avg"], frozen["optimizer"]["state"][0]["exp_avg"])
        with pytest.raises(ConfigError, match="local_epoch"):
            other.load_state_dict({"optimizer": {}})
        opt.shutdown()
        other.shutdown()
    finally:
        coord.stop()


def test_record_book_drops_forged_moved_and_altered_records() -> None:
    import json

    from shoal.collaborative.records import RecordBook
    from shoal.membership import auth

    store = torch.distributed.HashStore()
    for m in (1, 2):
        store.set(f"run/auth/{m}/nonce", auth.new_nonce())
    one, two = RecordBook(store, "run", 1, TOKEN), RecordBook(store, "run", 2, TOKEN)
    sealed = one.seal({"epoch": 4})
    assert two.open(sealed, writer=1) == {"epoch": 4, "by": 1}
    outsider = RecordBook(store, "run", 1, "not-the-run-token")    # reads the nonce, lacks the token
    assert two.open(outsider.seal({"epoch": 10**6}), writer=1) is None
    assert two.open(sealed, writer=2) is None, "member 1's record under member 2's key"
    outer = json.loads(sealed)
    outer["body"] = outer["body"].replace('"epoch": 4', '"epoch": 5')
    assert two.open(json.dumps(outer), writer=1) is None, "altered body"
    assert two.open(json.dumps({"epoch": 4, "by": 1}), writer=1) is None, "unsigned JSON"
    assert two.open(b"\xff not json", writer=1) is None
    store.set("run/auth/1/nonce", auth.new_nonce())     # someone rewrites the nonce after the join
    assert two.open(sealed, writer=1) is not None, "the key was fixed at first use"
    assert two.dropped == 5
    plain = RecordBook(store, "run", 1, None)           # no token: plain JSON, trusted
    assert RecordBook(store, "run", 2, None).open(plain.seal({"epoch": 1}), writer=1) == {"epoch": 1, "by": 1}
