"""Tensor parallelism: a plan's ``tp_layout`` (module FQN -> style name) as torch ParallelStyles.

The layout's style names are torch's (``colwise``, ``rowwise``, ``sequence``, ``replicate``) plus
``colwise_qkv`` (a fused q/k/v projection); this module only decides the input/output placements
around them, Megatron-LM style:

* Linears in a block: ``colwise`` -> ``ColwiseParallel()`` (q/k/v, MLP up/gate: attention heads
  and kv heads are split over tp, every rank runs ``heads / tp`` local heads; their parent module
  makes its input one replicated DTensor, so backward all-reduces the input gradient once per
  attention and once per MLP, as Megatron-LM does), ``rowwise`` ->
  ``RowwiseParallel()`` (wo, MLP down), whose output is all-reduced (or, with sequence
  parallelism, reduce-scattered along the sequence). HF ``Conv1D`` linears (GPT-2) and a fused
  q/k/v (``colwise_qkv``) take ``tp_styles.ShardedProjection`` instead (same communication).
* Embedding ``rowwise`` -> vocab-parallel embedding ``RowwiseParallel(input_layouts=Replicate())``:
  each rank holds ``vocab / tp`` rows, the output is all-reduced.
* Head linear (a ``colwise`` linear outside the block container) -> ``ColwiseParallel``. With
  the default loss (``apply.default_loss``) its logits stay a DTensor sharded over the vocabulary
  (``output_layouts=Shard(-1)``) and the loss runs under torch's ``loss_parallel()``: each rank
  keeps ``V / tp`` of the logits and log-probabilities, and the cross entropy all-reduces three
  ``[b, s]`` tensors (the max, the sum of exponentials, the target's logit) instead of
  all-gathering ``b s V`` logits. A model file's own ``loss_fn`` gets the logits all-gathered
  (``output_layouts=Replicate()``), a plain tensor.
* ``sequence`` (norms) -> ``SequenceParallel()`` when ``config.sequence_parallel``, else the norm
  stays replicated. With sequence parallelism the residual stream between blocks is the local
  sequence shard ``[b, s/tp, h]``; the module that consumes a norm's output inside a block
  (attention, feed_forward) all-gathers it (``PrepareHidden(Shard(1) -> Replicate())``, torch's
  ``PrepareModuleInput`` for a positional or ``hidden_states`` keyword input), and the model's
  first block cuts its full input to the local shard (``PrepareHidden(Replicate() -> Shard(1))``,
  no communication forward, an all-gather backward). The head all-gathers the sequence before
  the vocabulary projection.
* A mixture of experts (the module holding a router and grouped experts:
  ``graph.moe_structure.moe_modules``) keeps its routed experts whole on every tp rank, so under
  sequence parallelism it runs on the whole sequence (``tp_styles.GatherSequence``: its input
  all-gathered, its replicated output cut back to the rank's shard) and the linears inside it
  (shared experts) are split as without sequence parallelism: their parent's input replicated,
  their row-parallel output all-reduced.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch import nn

from autopar.errors import AutoparError
from autopar.graph.tp import is_linear, is_norm, per_head_norms, per_head_params, width_norms
from autopar.tp_layout import TPStyle, layout_of

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["apply_tensor_parallel", "default_tp_layout", "resolve_layout"]


def default_tp_layout(model: nn.Module, container: str | None = None) -> dict[str, str]:
    """The Megatron-LM layout of a model, read from its modules as the profile reads it.

    The rule is the graph's (``graph.tp``: linears by name, colwise / fused q/k/v / rowwise, norms
    sequence; the vocabulary-parallel token embedding and lm head) and the layout the planner's
    (``tp_layout.layout_of``, which ``search.layout`` applies to the profile), so a plan with tp > 1
    and an empty layout (one built from a bare ParallelConfig) gets the layout ``autopar plan``
    would have written. Norms are listed as ``sequence``: they shard only with sequence
    parallelism.

    Args:
        model: the full model (any device, meta included).
        container: unused (the block container is found); kept for callers that pass it.

    Returns:
        A layout such as ``{"layers.*.attention.wq": "colwise", ...}``.
    """
    from autopar.graph.tp import block_tp, embedding_tp, head_tp
    from autopar.runtime.pipeline_parallel import find_structure

    del container
    structure = find_structure(model)
    before = [f for f in structure.before if f]
    vocab = next((m.num_embeddings for f in before for m in model.get_submodule(f).modules()
                  if isinstance(m, nn.Embedding)), 0)
    layers = [("embedding", embedding_tp(model, before, vocab=vocab, seq_len=1, dtype_bytes=1))]
    for key in structure.block_keys:
        fqn = structure.block_fqn(key)
        layers.append(("block", block_tp(model, fqn, heads=0, kv_heads=0, seq_len=1,
                                         dtype_bytes=1)))
    layers.append(("head", head_tp(model, list(structure.after), vocab=vocab)))
    return layout_of(layers, sequence_parallel=True)


def resolve_layout(model: nn.Module, layout: Mapping[str, str]) -> dict[str, str]:
    """Match the layout's FQN patterns (fnmatch) against the modules present in ``model``.

    Args:
        model: a model or a pipeline stage module (its FQNs are the full model's).
        layout: FQN or pattern -> style name; a later exact FQN overrides a pattern.

    Returns:
        Exact FQN -> style name for every module of ``model`` the layout names (replicate dropped).
    """
    resolved: dict[str, str] = {}
    for fqn, module in model.named_modules():
        if not fqn or getattr(module, "autopar_stand_in", False):
            continue  # a pipeline stage's stand-in for a part another stage owns
        style = layout.get(fqn)
        if style is None:
            for pattern, value in layout.items():
                if fnmatch.fnmatchcase(fqn, pattern):
                    style = value
                    break
        if style is not None and style != TPStyle.REPLICATE.value:
            resolved[fqn] = style
    return resolved


def _linear_style(
    module: nn.Module, style: str, *, in_block: bool, sp: bool, loss_parallel: bool = False
) -> ParallelStyle | None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from autopar.runtime.tp_styles import QKV_GROUPS, ShardedProjection

    seq = Shard(1)  # the sequence dimension of [b, s, h] activations
    torch_linear = isinstance(module, nn.Linear)
    if style == TPStyle.COLWISE_QKV.value and in_block:
        return ShardedProjection(rowwise=False, groups=QKV_GROUPS)
    if style == TPStyle.COLWISE.value and in_block:
        return ColwiseParallel() if torch_linear else ShardedProjection(rowwise=False)
    if style == TPStyle.COLWISE.value and torch_linear:  # the head (module docstring)
        return ColwiseParallel(
            input_layouts=seq if sp else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if style == TPStyle.ROWWISE.value and in_block:
        output = seq if sp else Replicate()
        if torch_linear:
            return RowwiseParallel(output_layouts=output)
        return ShardedProjection(rowwise=True, output_layout=output)
    return None


def _style_for(
    fqn: str, module: nn.Module, style: str, *, in_block: bool, sp: bool,
    loss_parallel: bool = False,
) -> ParallelStyle | None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    found: ParallelStyle | None = None
    if isinstance(module, nn.Embedding):
        if style == TPStyle.ROWWISE.value:  # vocab-parallel: all-reduce of the output
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if style == TPStyle.COLWISE.value:  # hidden-parallel: all-gather of the output
            return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    elif is_linear(module):
        found = _linear_style(module, style, in_block=in_block, sp=sp,
                              loss_parallel=loss_parallel)
    elif is_norm(module) and style == TPStyle.SEQUENCE.value:
        # In a block, the local shard out: the next consumer (a module preparing its input, or a
        # residual add after a sandwich norm: Gemma 2 and 3) takes a plain tensor. The final
        # norm's stays a DTensor of the whole sequence: the model may reshape it by the full
        # sequence length before the head (GPT-2's view(-1, s, h)), which a local shard breaks.
        return SequenceParallel(use_local_output=in_block) if sp else None
    if found is not None:
        return found
    raise AutoparError(
        f"tensor parallelism cannot apply style {style!r} to {fqn} ({type(module).__name__}); "
        "autopar shards linears (colwise, colwise_qkv, rowwise) in blocks, a colwise head, a "
        "rowwise/colwise embedding and sequence-parallel norms: fix the plan's tp_layout"
    )


def build_tp_plan(
    module: nn.Module, layout: Mapping[str, str], *, container: str, sp: bool, first_block: str,
    loss_parallel: bool = False,
) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan (exact FQN -> ParallelStyle) for one (stage) module.

    Args:
        module: the model or a pipeline-stage module with the full model's FQNs.
        layout: the plan's tp_layout (patterns allowed).
        container: FQN of the block container ("layers", "model.layers", "transformer.h").
        sp: sequence parallelism on.
        first_block: FQN of the model's first block (it cuts its input to the sequence shard).
        loss_parallel: the head's logits stay sharded over the vocabulary (module docstring).

    Returns:
        FQN -> ParallelStyle for every module to parallelize.
    """
    from torch.distributed.tensor import Replicate, Shard

    from autopar.runtime.tp_styles import GatherSequence, PrepareHidden

    modules = dict(module.named_modules())
    resolved = resolve_layout(module, layout)
    # Under SP a mixture of experts runs on the whole sequence (its routed experts are whole
    # on every tp rank): the modules inside it are split as without SP (module docstring).
    gathering = _moe_holders(module, container) if sp else []
    gathered = functools.partial(_inside, holders=gathering)
    tp_plan: dict[str, ParallelStyle] = {fqn: GatherSequence() for fqn in gathering}
    for fqn, style in resolved.items():
        in_block = fqn.startswith(container + ".")
        parallel_style = _style_for(fqn, modules[fqn], style, in_block=in_block,
                                    sp=sp and not gathered(fqn), loss_parallel=loss_parallel)
        if parallel_style is not None:
            tp_plan[fqn] = parallel_style
    # A per-head norm inside a split attention (Qwen3's q_norm / k_norm: graph.tp.per_head_norms)
    # runs on this rank's heads as it is; its weight is replicated and its gradient, a sum over
    # every row (every head), is partial over tp: SequenceParallel over the leading dimension
    # gives exactly that (rows of the local tensor split over tp, weight Replicate, gradient
    # all-reduced), and hands the local tensor back.
    for parent in _colwise_parents(resolved, container):
        tp_plan.update(_head_norm_styles(parent, modules[parent]))
    # The parent of the colwise linears in a block (attention, feed_forward) turns its input into
    # one replicated DTensor that q/k/v (or w1/w3) share, so backward sums their partial input
    # gradients and all-reduces once (Megatron's "f"); with SP it all-gathers the norm's sequence
    # shards (and reduce-scatters in backward). The input is the parent's first positional
    # tensor or its ``hidden_states`` keyword (HF attention).
    for parent in _colwise_parents(resolved, container):
        tp_plan[parent] = PrepareHidden(
            input_layout=Shard(1) if sp and not gathered(parent) else Replicate(),
            desired_layout=Replicate(),
        )
    if sp and first_block in modules and not getattr(modules[first_block], "autopar_stand_in",
                                                     False):
        tp_plan[first_block] = PrepareHidden(
            input_layout=Replicate(), desired_layout=Shard(1), use_local_output=True
        )
    return tp_plan


def _head_norm_styles(parent: str, module: nn.Module) -> dict[str, ParallelStyle]:
    """Styles of the norms inside a split parent (build_tp_plan's comment): per head
    (Qwen3) or over all heads' features (OLMo 2: ``tp_styles.WidthNorm``)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    from autopar.runtime.tp_styles import WidthNorm

    styles: dict[str, ParallelStyle] = {
        f"{parent}.{name}": SequenceParallel(sequence_dim=0, use_local_output=True)
        for name in per_head_norms(module)}
    styles.update({f"{parent}.{name}": WidthNorm() for name in width_norms(module)})
    return styles


def _moe_holders(module: nn.Module, container: str) -> list[str]:
    """FQNs of the blocks' modules holding a router and its experts (``graph.moe``)."""
    from autopar.graph.moe_structure import moe_modules

    return [fqn for fqn in moe_modules(module) if fqn.startswith(container + ".")]


def _inside(fqn: str, holders: list[str]) -> bool:
    return any(fqn.startswith(holder + ".") for holder in holders)


def _colwise_parents(resolved: Mapping[str, str], container: str) -> list[str]:
    colwise = (TPStyle.COLWISE.value, TPStyle.COLWISE_QKV.value)
    return sorted({
        fqn.rsplit(".", 1)[0]
        for fqn, style in resolved.items()
        if style in colwise and fqn.startswith(container + ".")
    })


def apply_tensor_parallel(
    module: nn.Module,
    tp_mesh: DeviceMesh,
    layout: Mapping[str, str],
    *,
    container: str,
    sequence_parallel: bool,
    first_block: str,
    loss_parallel: bool = False,
) -> None:
    """Shard ``module`` in place over the "tp" mesh axis; a no-op when its size is 1.

    Args:
        module: the model or a pipeline-stage module (full-model FQNs).
        tp_mesh: the 1-D "tp" sub-mesh.
        layout: the plan's tp_layout (FQN patterns -> style names).
        container: attribute name of the block container.
        sequence_parallel: shard norms and the residual stream along the sequence.
        first_block: FQN of the model's first block.
        loss_parallel: keep the head's logits sharded over the vocabulary for a loss run under
            ``loss_parallel()`` (module docstring).
    """
    if tp_mesh.size() == 1:
        return
    from torch.distributed.tensor.parallel import parallelize_module

    from autopar.graph.fused_attention import localize_fused_attention
    from autopar.runtime.tp_styles import shard_head_params

    tp_plan = build_tp_plan(
        module, layout, container=container, sp=sequence_parallel, first_block=first_block,
        loss_parallel=loss_parallel,
    )
    resolved = resolve_layout(module, layout)  # parallelize_module renames nothing
    if tp_plan:
        parallelize_module(module, tp_mesh, tp_plan)
    _copy_shared_expert_outputs(module, resolved, container)
    for parent in _colwise_parents(resolved, container):
        heads = per_head_params(module.get_submodule(parent))
        if heads:  # gpt-oss's attention sinks: one value per head
            shard_head_params(module.get_submodule(parent), heads, tp_mesh)
    for fqn, style in resolved.items():
        if style == TPStyle.COLWISE_QKV.value:
            localize_fused_attention(module.get_submodule(fqn.rsplit(".", 1)[0]), tp_mesh.size())


def _copy_shared_expert_outputs(module: nn.Module, resolved: Mapping[str, str],
                                container: str) -> None:
    """A row-parallel linear inside a mixture of experts (shared experts) hands back a copy of
    its output, not the view DTensor's ``to_local`` returns: Llama 4 adds the routed experts'
    output to it in place, which autograd forbids on a custom Function's view. ``resolved``:
    the layout by exact FQN (``resolve_layout``)."""
    held = _moe_holders(module, container)
    for fqn, style in resolved.items():
        if style == TPStyle.ROWWISE.value and _inside(fqn, held):
            module.get_submodule(fqn).register_forward_hook(lambda _m, _a, out: out.clone())
