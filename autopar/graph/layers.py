"""Turn the measurements into LayerProfile records: embedding, one per block, head.

Recompute modes (DESIGN.md), per layer:

- ``none``: everything the layer saves for backward.
- ``selective``: the attention core is recomputed: what only the core saves (scores, softmax,
  dropout mask on the scores; the fused kernel's output and log-sum-exp) is dropped, its inputs
  q, k, v kept; extra FLOPs = the core's forward FLOPs.
- ``full``: only the layer's input is kept (``2 s h`` bytes at 16-bit for a block); extra FLOPs =
  the layer's forward FLOPs.

Parameters are counted once, at the first layer that owns them (a tied lm head is counted in the
embedding); parameters of no called module go to the embedding layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from autopar.graph.facts import ModelFacts
from autopar.graph.measure import Measured, ModelRun
from autopar.graph.moe_structure import block_moe, model_router_imbalance
from autopar.graph.recorder import SavedTotals
from autopar.graph.structure import Structure
from autopar.graph.tp import block_tp, embedding_tp, head_tp
from autopar.graph.types import LayerProfile, MoEStructure, OpSacCounts, TPStructure

__all__ = ["build_layers", "per_sample"]


def per_sample(one: Measured, two: Measured) -> Measured:
    """Counts per sample: the run at batch 2 minus the run at batch 1 (heads from batch 1)."""
    s1, s2 = one.saved, two.saved
    return Measured(
        fwd_flops=two.fwd_flops - one.fwd_flops,
        bwd_flops=two.bwd_flops - one.bwd_flops,
        core_fwd_flops=two.core_fwd_flops - one.core_fwd_flops,
        saved=SavedTotals(**{f.name: getattr(s2, f.name) - getattr(s1, f.name)
                             for f in dataclasses.fields(SavedTotals)}),
        input_bytes=two.input_bytes - one.input_bytes,
        output_bytes=two.output_bytes - one.output_bytes,
        attention=one.attention,
        op_sac_recompute_flops=two.op_sac_recompute_flops - one.op_sac_recompute_flops,
    )


def _params(model: nn.Module, groups: Sequence[Sequence[str]]) -> list[tuple[int, int]]:
    """(num_params, bytes) per group of module FQNs; each parameter counted once, first owner."""
    owner: dict[int, int] = {}
    tensors: dict[int, torch.Tensor] = {}
    for index, fqns in enumerate(groups):
        for fqn in fqns:
            for param in model.get_submodule(fqn).parameters():
                owner.setdefault(id(param), index)
                tensors[id(param)] = param
    for param in model.parameters():  # owned by no called module: the embedding layer (0)
        owner.setdefault(id(param), 0)
        tensors[id(param)] = param
    totals = [[0, 0] for _ in groups]
    for key, index in owner.items():
        totals[index][0] += tensors[key].numel()
        totals[index][1] += tensors[key].numel() * tensors[key].element_size()
    return [(n, b) for n, b in totals]


def _record(
    *,
    name: str,
    kind: str,
    fqns: Sequence[str],
    params: tuple[int, int],
    m: Measured,
    tp: TPStructure,
    repeat_of: str = "",
    moe: MoEStructure | None = None,
) -> LayerProfile:
    saved = m.saved
    return LayerProfile(
        name=name,
        kind=kind,
        module_fqns=tuple(fqns),
        num_params=params[0],
        param_bytes=params[1],
        fwd_flops=float(m.fwd_flops),
        bwd_flops=float(m.bwd_flops),
        recompute_flops={
            "none": 0.0,
            "selective": float(m.core_fwd_flops),
            "full": float(m.fwd_flops),
        },
        saved_bytes={
            "none": saved.total_bytes,
            "selective": saved.total_bytes - saved.core_bytes,
            "full": m.input_bytes,
        },
        saved_bytes_replicated={
            "none": saved.replicated_bytes,
            "selective": saved.replicated_bytes - saved.core_replicated_bytes,
            "full": m.input_bytes,  # the layer input is the residual stream: replicated
        },
        output_bytes=m.output_bytes,
        tp=tp,
        repeat_of=repeat_of,
        op_sac=_op_sac(kind, m),
        moe=moe,
        swiglu_saved_bytes=saved.swiglu_bytes,
        kv_repeat_saved_bytes=saved.kv_repeat_bytes,
        linear_saved_bytes=(saved.linear_bytes, saved.linear_replicated_bytes),
        linear_shared_bytes=(saved.linear_shared_bytes, saved.linear_shared_replicated_bytes),
        norm_saved_bytes=(saved.norm_bytes, saved.norm_replicated_bytes),
        combine_saved_bytes=(saved.combine_bytes, saved.combine_replicated_bytes),
        weight_pass_grad_bytes=(saved.weight_grad_bytes, saved.weight_grad_replicated_bytes,
                                saved.weight_grad_reduced_bytes),
        input_pass_freed_bytes=(saved.input_pass_freed_bytes,
                                saved.input_pass_freed_replicated_bytes),
    )


def _op_sac(kind: str, m: Measured) -> OpSacCounts | None:
    """A block's counts under per-op selective checkpointing (recorder.py); None elsewhere."""
    if kind != "block":
        return None
    return OpSacCounts(saved_bytes=m.input_bytes + m.saved.op_sac_bytes,
                       saved_bytes_replicated=m.input_bytes + m.saved.op_sac_replicated_bytes,
                       recompute_flops=float(m.op_sac_recompute_flops))


def _blocks(
    model: nn.Module,
    structure: Structure,
    facts: ModelFacts,
    params: list[tuple[int, int]],
    representative: dict[str, str],
    measured: dict[str, Measured],
    seq_len: int,
    dtype_bytes: int,
) -> list[LayerProfile]:
    layers = []
    stated_imbalance = model_router_imbalance(model)
    for index, fqn in enumerate(structure.blocks, start=1):
        rep = representative[fqn]
        tp = block_tp(
            model,
            fqn,
            heads=facts.heads,
            kv_heads=facts.kv_heads,
            seq_len=seq_len,
            dtype_bytes=dtype_bytes,
        )
        layers.append(
            _record(
                name=fqn,
                kind="block",
                fqns=(fqn,),
                params=params[index],
                m=measured[rep],
                tp=tp,
                repeat_of="" if rep == fqn else rep,
                moe=block_moe(model.get_submodule(fqn), stated_imbalance),
            )
        )
    return layers


def build_layers(
    model: nn.Module,
    *,
    structure: Structure,
    facts: ModelFacts,
    runs: dict[int, ModelRun],
    representative: dict[str, str],
    measured: dict[str, Measured],
    seq_len: int,
    dtype: torch.dtype,
) -> tuple[LayerProfile, ...]:
    """The profile's layers in execution order.

    Args:
        model: the (meta) model.
        structure: which modules form which layer.
        facts: model-wide sizes.
        runs: the model runs at batch 1 and 2.
        representative: block FQN -> the block whose measurements it shares.
        measured: per-sample counts of each representative block.
        seq_len: tokens per sample.
        dtype: the profile dtype.

    Returns:
        The LayerProfiles.
    """
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    embedding = per_sample(runs[1].embedding, runs[2].embedding)
    if not structure.blocks:
        params = _params(model, [structure.embedding])
        return (_record(name="model", kind="other", fqns=structure.embedding, params=params[0],
                        m=embedding, tp=TPStructure()),)
    groups = [structure.embedding, *[(b,) for b in structure.blocks], structure.head]
    params = _params(model, groups)
    embedding_tp_ = embedding_tp(model, structure.embedding, vocab=facts.vocab, seq_len=seq_len,
                                 dtype_bytes=dtype_bytes)
    first = _record(name="embedding", kind="embedding", fqns=structure.embedding,
                    params=params[0], m=embedding, tp=embedding_tp_)
    blocks = _blocks(model, structure, facts, params, representative, measured, seq_len,
                     dtype_bytes)
    head_one, head_two = runs[1].head, runs[2].head
    assert head_one is not None and head_two is not None  # a run with blocks measures its head
    last = _record(name="head", kind="head", fqns=structure.head, params=params[-1],
                   m=per_sample(head_one, head_two),
                   tp=head_tp(model, structure.head, vocab=facts.vocab))
    return (first, *blocks, last)
