"""A split backward's bytes (``LayerProfile.weight_pass_grad_bytes``, ``input_pass_freed_bytes``)
against torch's own ``stage_backward_input`` on CPU: what a layer holds from its input pass to its
weight pass beyond what it held after its forward, counted by the runtime's live-tensor counter.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

import autopar
from autopar.models import build
from autopar.runtime.worker import LiveTensorBytes

SHAPES = {
    "llama": dict(layers=2, hidden=128, heads=4, kv_heads=2, vocab=512, seq_len=64),
    "gpt": dict(layers=2, hidden=128, heads=4, vocab=512, seq_len=64),
}
MICRO_BATCH = 2


def _held_after_input_pass(forward, params, x, grad_output: bool) -> int:
    """Live bytes after the input pass less live bytes after the forward (the stage keeps its
    output and inputs, as torch's ``PipelineStage`` does until the weight pass)."""
    mode = LiveTensorBytes()
    with mode:
        x = x.clone().requires_grad_()
        out = forward(x)
        gc.collect()
        after_forward = mode.current_bytes
        grads = [torch.ones_like(out)] if grad_output else None
        _dx, groups = stage_backward_input([out], grads, [x], iter(params))
        del grads, _dx
        x.grad = None
        gc.collect()
        after_input = mode.current_bytes
        stage_backward_weight(iter(params), groups)
    for p in params:
        p.grad = None
    return after_input - after_forward


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_block_keeps_its_weight_ops_output_gradients(kind):
    shape = SHAPES[kind]
    layer = next(lay for lay in autopar.profile(build(kind, **shape), dtype="fp32",
                                            kernels="cpu").layers if lay.kind == "block")
    model = build(kind, device="cpu", seed=0, **shape)
    block = model.layers["0"]
    x = torch.randn(MICRO_BATCH, shape["seq_len"], shape["hidden"])
    measured = _held_after_input_pass(block, list(block.parameters()), x, grad_output=True)
    predicted = MICRO_BATCH * (layer.weight_pass_grad_bytes[0] - layer.input_pass_freed_bytes[0])
    assert layer.input_pass_freed_bytes == (0, 0)  # nothing of a block follows its last linear
    assert predicted > 0.4 * MICRO_BATCH * layer.saved_bytes["none"]
    assert measured == pytest.approx(predicted, rel=0.01)


def test_head_frees_its_loss_and_keeps_the_logits_gradient():
    shape = SHAPES["llama"]
    layer = next(lay for lay in autopar.profile(build("llama", **shape), dtype="fp32",
                                            kernels="cpu").layers if lay.kind == "head")
    model = build("llama", device="cpu", seed=0, **shape)
    target = torch.randint(0, shape["vocab"], (MICRO_BATCH, shape["seq_len"]))

    def head(x):
        logits = model.output(model.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    params = [*model.norm.parameters(), *model.output.parameters()]
    x = torch.randn(MICRO_BATCH, shape["seq_len"], shape["hidden"])
    measured = _held_after_input_pass(head, params, x, grad_output=False)
    logprobs = shape["seq_len"] * shape["vocab"] * 4  # fp32 log-softmax, per sample
    assert layer.input_pass_freed_bytes[0] >= logprobs
    predicted = MICRO_BATCH * (layer.weight_pass_grad_bytes[0] - layer.input_pass_freed_bytes[0])
    assert measured == pytest.approx(predicted, rel=0.02, abs=4096)



@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_weight_pass_reruns_and_holds_a_checkpointed_block(kind):
    """Why autopar recomputes nothing under a schedule that splits backwards
    (``framework_support.split_recompute_refusal``): torch's weight pass makes one autograd call
    per parameter group, each call re-runs a fully checkpointed block's forward (non-reentrant
    ``torch.utils.checkpoint``, autopar's runtime/recompute.py), and the re-runs' tensors stay
    until the weight pass ends: it holds more than the block's un-checkpointed activations."""
    from autopar.runtime.recompute import apply_recompute

    shape = SHAPES[kind]
    layer = next(lay for lay in autopar.profile(build(kind, **shape), dtype="fp32",
                                            kernels="cpu").layers if lay.kind == "block")
    block = build(kind, device="cpu", seed=0, **shape).layers["0"]
    calls = []
    inner = block.forward
    block.forward = lambda h: (calls.append(1), inner(h))[1]
    apply_recompute({"layers.0": block}, {"layers.0": "full"})
    params = list(block.parameters())
    mode = LiveTensorBytes()
    with mode:
        x = torch.randn(MICRO_BATCH, shape["seq_len"], shape["hidden"], requires_grad=True)
        out = block(x)
        _dx, groups = stage_backward_input([out], [torch.ones_like(out)], [x], iter(params))
        del _dx
        gc.collect()
        after_input, mode.peak_bytes = mode.current_bytes, mode.current_bytes
        forwards_after_input = len(calls)
        stage_backward_weight(iter(params), groups)
        weight_pass_bytes = mode.peak_bytes - after_input
    assert forwards_after_input == 2  # the forward, and the input pass's re-run
    assert len(calls) - forwards_after_input == len(groups) >= 8  # one re-run per group
    assert weight_pass_bytes > 2 * MICRO_BATCH * layer.saved_bytes["none"]
