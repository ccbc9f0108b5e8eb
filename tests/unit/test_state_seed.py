"""This host's copy of the run's state (shoal.membership.seed) and the download it seeds (stateserve.Download).

A seed's ranges are taken where their digest matches what the sources
published, the rest comes over the network, and the result is still checked
against the sources' sha256: a stale, partial or wrong seed costs bytes,
never correctness.
"""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shoal.comm.objects import from_bytes, to_bytes
from shoal.errors import ConfigError
from shoal.membership import seed as seed_mod
from shoal.membership import stateserve
from shoal.membership.seed import StateSeed, keep_own, restore_own
from shoal.membership.stateserve import Download, SnapshotServer, Source, clone_tree, digest_span, range_digests
from shoal.strategies.diloco_heal import OuterReplay

sys.path.insert(0, os.path.dirname(__file__))
from test_stateserve import RUN, TOKEN  # noqa: E402
from test_stateserve import _serve as serve  # noqa: E402


def _tree(shift: float = 0.0, change: int | None = None) -> dict[str, Any]:
    """Four ~40 KB tensors (a global copy and a momentum per fragment); ``change``: only that one differs."""
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(10_000, generator=g) for _ in range(4)]
    if change is not None:
        ts[change] += 1.0 + shift
    return {"k/strategy": {"globals": ts[:2], "momenta": ts[2:], "step": 3}}


def _blob(tree: Any) -> bytes:
    return bytes(to_bytes(tree).numpy().tobytes())


def _serve(tree: Any) -> tuple[SnapshotServer, Source]:
    return serve(clone_tree(tree))   # heal 3, joiner 9 (test_stateserve.py)


def _dropped(server: SnapshotServer) -> bool:
    """Whether the server dropped its snapshot (its connection thread reads the joiner's word a moment later)."""
    deadline = time.monotonic() + 10
    while server.owed() and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.owed() == [] and server.holding() == []


def _download(src: Source, seed: bytes | None) -> Download:
    dl = Download(3, [src], TOKEN, RUN, member=9, chunk=4096)
    dl.seed = seed
    dl.run()
    return dl


def test_digests_cover_the_snapshot_in_spans() -> None:
    data = _blob(_tree())
    span = digest_span(len(data))
    assert span % 4096 == 0 and len(range_digests(data)) == -(-len(data) // span) <= 256
    assert digest_span(26_077_956) == 102_400   # DiLoCo on the bench's lm: 255 digests


@pytest.mark.timeout(60)
def test_a_seed_of_the_same_state_needs_no_byte_from_the_network() -> None:
    tree = _tree()
    server, src = _serve(tree)
    dl = _download(src, _blob(tree))
    assert dl.error is None and dl.blob == _blob(tree)
    assert dl.received == 0 and dl.seeded == src.size and server.served == 0
    assert _dropped(server)   # told it is done once the sha256 matched: dropped


@pytest.mark.timeout(60)
def test_a_seed_one_fragment_behind_fetches_only_that_fragments_ranges() -> None:
    old, new = _tree(), _tree(change=1)   # one of four tensors changed since the seed was written
    server, src = _serve(new)
    dl = _download(src, _blob(old))
    assert dl.error is None and dl.blob == _blob(new)
    assert torch.equal(from_bytes(torch.frombuffer(bytearray(dl.blob), dtype=torch.uint8))["k/strategy"]["globals"][1],
                       new["k/strategy"]["globals"][1])
    assert dl.received + dl.seeded == src.size
    # The changed tensor's 40 KB, its spans' edges, the pickled header and the zip's directory: well under half.
    assert 40_000 <= dl.received < src.size / 2, (dl.received, src.size)
    assert _dropped(server)   # the ranges' connections did not say done (a seed): said after the sha256


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [b"", b"not a snapshot at all" * 100, None])
def test_no_seed_or_a_foreign_one_fetches_everything(seed: bytes | None) -> None:
    tree = _tree()
    _, src = _serve(tree)
    dl = _download(src, seed)
    assert dl.error is None and dl.blob == _blob(tree) and dl.received == src.size and dl.seeded == 0


@pytest.mark.timeout(60)
def test_ranges_whose_digests_collide_are_fetched_again_when_the_whole_does_not_match(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Every range "matches" (a constant digest): the seed is another state, so the assembled bytes fail the
    # sources' sha256, and the download fetches all of it rather than load a state that is not the run's.
    monkeypatch.setattr(stateserve, "range_digest", lambda data: "same")
    new = _tree(change=2)
    _, src = _serve(new)
    assert set(src.digests) == {"same"}
    dl = _download(src, _blob(_tree()))
    assert dl.error is None and dl.blob == _blob(new) and dl.received == src.size and dl.seeded == 0


def test_state_seed_writes_on_a_thread_and_reads_back(tmp_path: Any) -> None:
    path = str(tmp_path / "slot-0.state")
    seed = StateSeed(path)
    assert seed.read() is None   # nothing written yet
    t = _tree()
    live = t["k/strategy"]["globals"][0]
    seed.save(clone_tree(t))
    live.add_(1.0)   # the next step changes the live state after the clone: the file keeps the clone
    assert seed.flush(30) and seed.writes == 1
    assert seed.read() == _blob(_tree())
    seed.save(clone_tree(_tree(change=0)))
    assert seed.flush(30) and seed.read() == _blob(_tree(change=0))
    assert [p for p in os.listdir(tmp_path)] == ["slot-0.state"]   # no temporary file left


def test_a_seed_that_cannot_be_written_switches_itself_off(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    seed = StateSeed(str(tmp_path / "missing-folder" / "slot-0.state"))
    seed.save(clone_tree(_tree()))
    assert seed.flush(30)
    assert seed.broken is not None and "No such file" in seed.broken and seed.writes == 0
    assert "it is off for this worker's life" in caplog.text
    seed.save(clone_tree(_tree()))   # off: nothing more is tried
    assert seed.flush(30) and seed.writes == 0


def test_the_environment_names_one_file(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(seed_mod.ENV, raising=False)
    assert StateSeed.from_env() is None
    monkeypatch.setenv(seed_mod.ENV, str(tmp_path))
    with pytest.raises(ConfigError, match="must name a file"):
        StateSeed.from_env()
    monkeypatch.setenv(seed_mod.ENV, str(tmp_path / "a.state"))
    got = StateSeed.from_env()
    assert got is not None and got.path == str(tmp_path / "a.state")


# --- the slot's own state beside the copy (seed.keep_own / restore_own; DiLoCo's inner optimizer) ---

RUN_TAG = "run-a/own-state"


def _diloco() -> Any:
    """What OuterReplay reads of a one-fragment DiLoCo without overlapped reductions."""
    return SimpleNamespace(config=SimpleNamespace(overlap_steps=0, inner_steps=8), step=0, trained_steps=0,
                           fragments=[SimpleNamespace(offset=0, snapshot=torch.zeros(1), params=[])],
                           _reset_to_global=lambda f: None)


def _inner(seed: int = 0, steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer, OuterReplay]:
    """A small model with an AdamW that stepped ``steps`` times, and the DiLoCo replayer that keeps its state."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for _ in range(steps):
        net(torch.randn(4, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return net, opt, OuterReplay(_diloco(), "k", opt)


def _same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    return sa.keys() == sb.keys() and all(
        sa[i].keys() == sb[i].keys() and all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]) for i in sa)


def test_the_own_state_is_written_beside_the_copy_and_a_next_life_resumes_it(tmp_path: Any) -> None:
    path = str(tmp_path / "slot-0.state")
    seed = StateSeed(path)
    _, old, old_replay = _inner(steps=3)
    assert keep_own([_inner(steps=0)[2]], RUN_TAG) is None   # nothing to keep before the first step
    seed.save(clone_tree(_tree()), keep_own([old_replay], RUN_TAG))
    assert seed.flush(30) and seed.writes == 1
    assert sorted(os.listdir(tmp_path)) == ["slot-0.state", "slot-0.state" + seed_mod.OWN]
    assert seed.read() == _blob(_tree())   # the copy the download compares is unchanged by the own part
    _, new, replay = _inner(seed=1, steps=0)   # the next life: its optimizer empty after the heal's reset
    assert restore_own(seed, [replay], RUN_TAG) and _same_state(new, old)
    new.param_groups[0]["lr"] = 5e-3   # this life's hyperparameters stay (a scheduler's lr)
    assert restore_own(seed, [replay], RUN_TAG) and new.param_groups[0]["lr"] == 5e-3
    kept = seed.read_own()
    net = [p for g in new.param_groups for p in g["params"]]
    for p in net:
        p.grad = torch.ones_like(p)
    new.step()   # it trains on from there; what it loaded was a copy: a later load gets the kept state again
    assert torch.equal(kept["kept"][0]["state"][0]["exp_avg"], seed.read_own()["kept"][0]["state"][0]["exp_avg"])
    assert int(new.state[net[0]]["step"]) == 4


@pytest.mark.parametrize("case", ["other run", "other optimizer", "other shapes", "unreadable", "none", "load fails",
                                  "kept not a list"])
def test_an_own_state_that_is_not_this_runs_or_does_not_fit_is_not_loaded(case: str, tmp_path: Any,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    path = str(tmp_path / "slot-0.state")
    seed = StateSeed(path)
    _, _, old_replay = _inner(steps=2)
    if case == "other optimizer":
        net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
        sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        net(torch.randn(4, 6)).sum().backward()
        sgd.step()
        old_replay = OuterReplay(_diloco(), "k", sgd)
    if case == "other shapes":
        torch.manual_seed(0)
        wide = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Linear(7, 2))
        opt = torch.optim.AdamW(wide.parameters(), lr=1e-2)
        wide(torch.randn(4, 6)).sum().backward()
        opt.step()
        old_replay = OuterReplay(_diloco(), "k", opt)
    if case != "none":
        seed.save(clone_tree(_tree()), keep_own([old_replay], "run-b/own-state" if case == "other run" else RUN_TAG))
        assert seed.flush(30)
    if case == "unreadable":
        with open(path + seed_mod.OWN, "wb") as f:
            f.write(b"not a torch.save")
    if case == "kept not a list":   # loadable with weights_only, this run's tag, but not what keep_own writes
        with open(path + seed_mod.OWN, "wb") as f:
            torch.save({"run": RUN_TAG, "kept": 3}, f)
    _, new, replay = _inner(seed=1, steps=0)
    if case == "load fails":   # anything the checks above miss: logged, and the optimizer left empty

        def half_then_raise(state: Any) -> None:
            new.state[next(iter(new.param_groups[0]["params"]))]["step"] = torch.tensor(9.0)
            raise ValueError("no")
        new.load_state_dict = half_then_raise  # type: ignore[method-assign]
    assert not restore_own(seed, [replay], RUN_TAG)
    assert new.state_dict()["state"] == {}   # left empty: it starts as without a cache
    why = {"other run": "is not this run's", "other optimizer": "another optimizer than this AdamW",
           "other shapes": "has shape (7, 6), the parameter (5, 6)", "unreadable": "could not read", "none": "",
           "load fails": "loading it raised ValueError: no", "kept not a list": "is not this run's"}
    assert why[case] in caplog.text


def test_an_own_part_that_cannot_be_written_leaves_the_copy_written(tmp_path: Any,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Room for the copy but not for the optimizer state beside it: only the own part is switched off."""
    path = str(tmp_path / "slot-0.state")
    seed = StateSeed(path)
    os.mkdir(path + seed_mod.OWN)   # where the own part would go, something it cannot replace
    _, _, replay = _inner(steps=2)
    seed.save(clone_tree(_tree()), keep_own([replay], RUN_TAG))
    assert seed.flush(30)
    assert seed.broken is None and seed.own_broken is not None and seed.writes == 1, (seed.broken, seed.own_broken)
    assert seed.read() == _blob(_tree())
    seed.save(clone_tree(_tree(change=0)), keep_own([replay], RUN_TAG))   # the copy goes on being written
    assert seed.flush(30) and seed.writes == 2 and seed.read() == _blob(_tree(change=0))
    assert "the copy goes on without it" in caplog.text


def test_an_older_lifes_own_part_is_removed_when_it_is_not_written_with_the_copy(tmp_path: Any) -> None:
    """A life that writes a copy without an own part (its optimizer has not stepped), or whose copy cannot be
    written, removes the own file: a later life must not resume an own state older than the copy beside it."""
    path = str(tmp_path / "slot-0.state")
    _, _, replay = _inner(steps=2)
    first = StateSeed(path)
    first.save(clone_tree(_tree()), keep_own([replay], RUN_TAG))
    assert first.flush(30) and os.path.exists(path + seed_mod.OWN)
    second = StateSeed(path)   # the next life: a copy, nothing of its own kept yet
    second.save(clone_tree(_tree(change=0)), keep_own([_inner(steps=0)[2]], RUN_TAG))
    assert second.flush(30) and second.writes == 1 and not os.path.exists(path + seed_mod.OWN)
    assert not restore_own(second, [_inner(seed=1, steps=0)[2]], RUN_TAG)
    third = StateSeed(path)   # a life whose copy cannot be written: its own part is not left behind alone
    os.unlink(path)
    os.mkdir(path)
    third.save(clone_tree(_tree()), keep_own([replay], RUN_TAG))
    assert third.flush(30) and third.broken is not None and not os.path.exists(path + seed_mod.OWN)


def test_what_keep_own_returns_is_a_copy_taken_at_once() -> None:
    """The writer serialises it later, on its own thread: the training steps meanwhile must not change it."""
    net, opt, replay = _inner(steps=2)
    before = {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}
    kept = keep_own([replay], RUN_TAG)
    assert kept is not None and kept["ready"] is None   # on the CPU nothing to wait for
    net(torch.randn(4, 6)).square().sum().backward()
    opt.step()   # the live state moves on
    for i, st in kept["kept"][0]["state"].items():
        assert all(torch.equal(v, before[i][k]) for k, v in st.items())
    assert not torch.equal(opt.state_dict()["state"][0]["exp_avg"], before[0]["exp_avg"])
