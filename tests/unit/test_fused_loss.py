"""The fused token cross entropy (autopar.models.losses): the same loss and gradient as torch's,
and a profile taken with it keeps what the fused kernel keeps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.config import ParallelConfig
from autopar.models import losses


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 40), vocab=st.integers(2, 50), chunk=st.integers(1, 16),
       seed=st.integers(0, 2**16))
def test_fused_cross_entropy_equals_torch(rows: int, vocab: int, chunk: int, seed: int) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(losses, "CHUNK_ROWS", chunk)
        _check_against_torch(rows, vocab, seed)


def _check_against_torch(rows: int, vocab: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    loss_a = losses.fused_cross_entropy(a, labels)
    loss_b = F.cross_entropy(b, labels)
    loss_a.backward()
    loss_b.backward()
    torch.testing.assert_close(loss_a, loss_b)
    torch.testing.assert_close(a.grad, b.grad)


def test_fused_loss_profile_keeps_logits_not_fp32_logprobs() -> None:
    """Per sample, the head keeps s V bf16 logits and s fp32 log-sum-exps instead of the s V
    fp32 log-probabilities; the estimate's peak falls by the fp32 copies."""
    seq, vocab = 32, 256
    model = autopar.models.build("gpt", layers=2, hidden=64, heads=4, vocab=vocab, seq_len=seq)
    eager = autopar.profile(model)
    fused = autopar.profile(model, loss="fused")
    assert (eager.loss, fused.loss) == ("eager", "fused")
    head_eager, head_fused = eager.layers[-1].saved_bytes, fused.layers[-1].saved_bytes
    assert head_eager["none"] - head_fused["none"] == 4 * seq * vocab - 2 * seq * vocab - 4 * seq
    cluster = autopar.Cluster.preset("cpu", gpus_per_node=1)
    cfg = ParallelConfig(micro_batch=4, global_batch=4)
    assert (autopar.estimate(fused, cluster, cfg).memory_per_gpu_bytes
            < autopar.estimate(eager, cluster, cfg).memory_per_gpu_bytes)
    with pytest.raises(autopar.AutoparError, match="profile loss"):
        autopar.profile(model, loss="chunked")


def test_a_plan_records_its_loss_kernel_and_explain_profiles_with_it(tmp_path) -> None:
    """A plan made from a fused-loss profile says so (JSON key ``loss``, absent for the eager
    loss, so earlier plans read the same) and the CLI re-profiles with it: the fingerprints
    match."""
    from autopar.cli.common import plan_context
    from autopar.plan import Plan, PlanFormatError

    spec = "gpt:layers=2,hidden=64,heads=4,vocab=256,seq_len=32"
    model = autopar.models.build("gpt", layers=2, hidden=64, heads=4, vocab=256, seq_len=32)
    cluster = autopar.Cluster.preset("cpu", gpus_per_node=2)
    fused = autopar.plan(autopar.profile(model, loss="fused"), cluster, global_batch=4,
                         model=spec)
    eager = autopar.plan(autopar.profile(model), cluster, global_batch=4, model=spec)
    assert fused.to_dict()["loss"] == "fused" and "loss" not in eager.to_dict()
    again = Plan.from_json(fused.to_json())
    assert again.loss == "fused" and again.to_json() == fused.to_json()
    profile, _ = plan_context(again, None, None)
    assert profile.loss == "fused"
    with pytest.raises(PlanFormatError, match="loss"):
        Plan.from_dict({**fused.to_dict(), "loss": "chunked"})
