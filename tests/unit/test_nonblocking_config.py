"""NonBlocking's layer layout and argument checks (one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shoal.errors import ConfigError
from shoal.strategies import NonBlocking
from shoal.strategies.nonblocking import _fallback_reason, find_layers


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: owned by the module registering it first


def test_a_tied_weight_belongs_to_its_first_module() -> None:
    layers = find_layers(Tied())
    assert [(layer.name, layer.names) for layer in layers] == [
        ("mid", ["mid.weight", "mid.bias"]),
        ("emb", ["emb.weight"]),
    ]
    assert layers[0].buffer.numel() == 20 and layers[0].views[0].shape == (4, 4)


def test_fallback_reasons() -> None:
    m = Tied()
    assert _fallback_reason(m, torch.optim.SGD(m.parameters(), lr=0.1))[1] is not None
    reason, single = _fallback_reason(m, [torch.optim.SGD(m.mid.parameters(), lr=0.1),
                                          torch.optim.SGD(m.emb.parameters(), lr=0.1)])
    assert single is None and "2 optimizers" in reason
    reason, single = _fallback_reason(m, torch.optim.SGD(m.mid.parameters(), lr=0.1))
    assert single is None and "misses 1" in reason
    with pytest.raises(ConfigError, match="torch.optim.Optimizer"):
        _fallback_reason(m, "adam")


def test_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match="codec"):
        NonBlocking(codec="bf16")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="hierarchical"):
        NonBlocking(hierarchical=1)  # type: ignore[arg-type]
