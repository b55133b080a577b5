"""Per-block recomputation really recomputes (and only what it should), without a process group."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.models import build, cross_entropy_loss
from autopar.runtime.recompute import apply_recompute

SHAPE = {"layers": 3, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 8}


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _step_ops(kind: str, recompute: dict[str, str]) -> tuple[Counter[str], dict[str, torch.Tensor]]:
    shape = dict(SHAPE, kv_heads=2) if kind == "llama" else SHAPE
    model = build(kind, device="cpu", seed=0, **shape)
    blocks = {f"layers.{i}": model.layers[str(i)] for i in range(shape["layers"])}
    apply_recompute(blocks, recompute)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 8), generator=gen)
    labels = torch.randint(0, 64, (2, 8), generator=gen)
    with _OpCounter() as counter:
        cross_entropy_loss(model(tokens), labels).backward()
    return counter.counts, {n: p.grad for n, p in model.named_parameters()}


def _attention_calls(counts: Counter[str]) -> int:
    return sum(
        c for name, c in counts.items() if "scaled_dot_product" in name and "backward" not in name
    )


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_selective_and_full_recompute_rerun_what_they_should(kind: str) -> None:
    base, base_grads = _step_ops(kind, {})
    mixed, mixed_grads = _step_ops(kind, {"layers.0": "selective", "layers.2": "full"})
    # One attention core per block in forward, plus one per recomputed block in backward.
    assert _attention_calls(base) == 3
    assert _attention_calls(mixed) == 3 + 2
    # Selective keeps the projections' matmul outputs; full re-runs its block's matmuls. The
    # non-reentrant checkpoint stops recomputing after the last saved activation, so the block's
    # final projection (MLP down, w2) is not re-run: q/k/v, wo and the MLP up/gate projections are.
    matmuls_per_block = 6 if kind == "llama" else 5  # wq wk wv wo w1 (+ w3)
    extra = (mixed["mm"] + mixed["addmm"]) - (base["mm"] + base["addmm"])
    assert extra == matmuls_per_block
    for fqn, grad in base_grads.items():
        torch.testing.assert_close(mixed_grads[fqn], grad, rtol=1e-6, atol=1e-8)


def test_selective_recompute_needs_an_attention_child() -> None:
    from autopar.errors import AutoparError

    block = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(AutoparError, match="attention child"):
        apply_recompute({"layers.0": block}, {"layers.0": "selective"})
