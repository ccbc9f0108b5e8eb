"""Topology discovery and the two-level mean, on 4 real gloo ranks posing as 2 hosts x 2."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from shoal.codecs import Cast, ErrorFeedback, Hierarchical, Identity, TopK
from shoal.comm import Group, HostGroups, Topology, discover
from shoal.parallel import DistributedDataParallel
from shoal.testing import run_workers

SHAPES = [(40, 30), (30,), (7, 3, 3)]
NAMES = ["w", "b", "conv"]


def _data(rank: int, step: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(s, generator=g) * (rank + 1) for s in SHAPES]


def _feedback_conserves(group: Group) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """sum over steps of decoded means + mean of residuals, and sum of true means."""
    codec = ErrorFeedback(Hierarchical(TopK(0.1)))
    decoded = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    for step in range(6):
        ts = _data(group.rank, step)
        codec.mean(ts, NAMES, group, "ef")
        for a, t in zip(decoded, ts):
            a += t.double()
    res = [codec.residuals[n].clone() for n in NAMES]
    for r in res:
        group.all_reduce(r, op="avg", tag="check").wait()
    true = [sum(_data(r, s)[i].double() for r in range(group.size) for s in range(6)) / group.size
            for i in range(len(SHAPES))]
    return [d + r.double() for d, r in zip(decoded, res)], true


def _ddp_grads(hierarchical: bool | None) -> tuple[list[torch.Tensor], object, str]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)),
                                    hierarchical=hierarchical, bucket_cap_mb=0.0005)
    rank = torch.distributed.get_rank()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()], model.topology, type(model.reducer.codec).__name__


def _work(rank: int, world: int) -> dict:
    os.environ["SHOAL_HOST_ID"] = f"host-{rank // 2}"  # ranks 0,1 on one host, 2,3 on the other
    group = Group()
    out: dict = {"topology": discover(group)}
    flat, hier = _data(rank), _data(rank)
    Identity().mean(flat, NAMES, group, "flat")
    codec = Hierarchical(chunk_mb=0.001)  # 262 floats a chunk: the pipeline runs 5 chunks
    codec.mean(hier, NAMES, group, "hier")
    out["flat"], out["hier"] = flat, hier
    bf16 = _data(rank)
    Hierarchical(Cast(torch.bfloat16)).mean(bf16, NAMES, group, "hier-bf16")
    out["bf16"] = bf16
    uneven = Hierarchical()
    uneven.setup(group, Topology.from_host_ids(["a", "a", "a", "b"], rank))
    out["uneven"] = _data(rank)
    uneven.mean(out["uneven"], NAMES, group, "uneven")
    out["meter"] = {k: v.as_dict() for k, v in group.meter.by_tag().items()}
    out["feedback"] = _feedback_conserves(group)
    out["ddp_auto"] = _ddp_grads(None)
    out["ddp_flat"] = _ddp_grads(False)
    levels = HostGroups.build(group)
    out["levels"] = (levels.local.size, levels.leaders.size if levels.leaders is not None else None)
    return out


@pytest.mark.timeout(150)
def test_two_level_mean_equals_flat_on_two_hosts_of_two() -> None:
    res = run_workers(_work, 4, timeout=140)
    expect = [sum(_data(r)[i] for r in range(4)) / 4 for i in range(len(SHAPES))]
    for rank, out in enumerate(res):
        topo = out["topology"]
        assert topo.hosts == ((0, 1), (2, 3)) and topo.leaders == (0, 2)
        assert (topo.host_index, topo.local_rank, topo.local_size) == (rank // 2, rank % 2, 2)
        assert out["levels"] == (2, 2 if rank in (0, 2) else None)
        for f, h, u, b, e in zip(out["flat"], out["hier"], out["uneven"], out["bf16"], expect):
            torch.testing.assert_close(h, f, rtol=1e-6, atol=1e-6)  # fp32 rounding only
            torch.testing.assert_close(u, e, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(b, e, rtol=2e-2, atol=2e-2)  # bf16 between hosts
        for h, h0 in zip(out["hier"], res[0]["hier"]):
            assert torch.equal(h, h0)  # broadcast inside hosts: every rank holds the same bits
        decoded, true = out["feedback"]
        for d, t in zip(decoded, true):
            torch.testing.assert_close(d, t, rtol=1e-5, atol=1e-5)
        grads_auto, topo_auto, codec_auto = out["ddp_auto"]
        grads_flat, topo_flat, codec_flat = out["ddp_flat"]
        assert codec_auto == "Hierarchical" and codec_flat == "NoneType" and topo_auto.num_hosts == 2
        for a, f in zip(grads_auto, grads_flat):
            torch.testing.assert_close(a, f, rtol=1e-6, atol=1e-6)
    payload = sum(torch.Size(s).numel() for s in SHAPES) * 4
    m0, m1 = res[0]["meter"], res[1]["meter"]
    # Leaders all-reduce among 2: S sent each; a flat ring of 4 sends 1.5 S.
    assert m0["hier/identity"]["bytes_sent"] == payload
    assert m0["flat/identity"]["bytes_sent"] == 3 * payload // 2
    assert "hier/identity" not in m1  # non-leaders never touch the inter-host link
    assert m1["hier/intra"]["bytes_sent"] == payload  # its reduce to the leader
