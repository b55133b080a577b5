"""Tensor parallelism: a plan's ``tp_layout`` (module FQN -> style name) as torch ParallelStyles.

The layout's style names are torch's (``colwise``, ``rowwise``, ``sequence``, ``replicate``); this
module only decides the input/output placements around them, Megatron-LM style:

* Linears in a block: ``colwise`` -> ``ColwiseParallel()`` (q/k/v, MLP up/gate: attention heads
  and kv heads are split over tp, every rank runs ``heads / tp`` local heads; their parent module
  makes its input one replicated DTensor, so backward all-reduces the input gradient once per
  attention and once per MLP, as Megatron-LM does), ``rowwise`` ->
  ``RowwiseParallel()`` (wo, MLP down), whose output is all-reduced (or, with sequence
  parallelism, reduce-scattered along the sequence).
* Embedding ``rowwise`` -> vocab-parallel embedding ``RowwiseParallel(input_layouts=Replicate())``:
  each rank holds ``vocab / tp`` rows, the output is all-reduced.
* Head linear (a ``colwise`` linear outside the block container) -> ``ColwiseParallel`` with
  ``output_layouts=Replicate()``: the logits are all-gathered over the vocabulary and the loss is
  the ordinary cross entropy. NOTE: autopar does not use ``loss_parallel`` (which would keep logits
  sharded); all-gathering the logits is simpler, works through pipeline stages, and costs one
  all-gather of ``b*s*V`` elements per micro-batch, which the cost model charges.
* ``sequence`` (norms) -> ``SequenceParallel()`` when ``config.sequence_parallel``, else the norm
  stays replicated. With sequence parallelism the residual stream between blocks is the local
  sequence shard ``[b, s/tp, h]``; the module that consumes a norm's output inside a block
  (attention, feed_forward) all-gathers it (``PrepareModuleInput(Shard(1) -> Replicate())``), and
  the model's first block cuts its full input to the local shard
  (``PrepareModuleInput(Replicate() -> Shard(1))``, no communication forward, an all-gather
  backward). The head all-gathers the sequence before the vocabulary projection.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch import nn

from autopar.errors import AutoparError
from autopar.plan import TPStyle

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["NORM_TYPES", "apply_tensor_parallel", "default_tp_layout", "resolve_layout"]

NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm)


def default_tp_layout(model: nn.Module, container: str = "layers") -> dict[str, str]:
    """The Megatron-LM layout of a zoo-structured model, as FQN patterns -> style names.

    Inside each block: q/k/v and MLP up/gate (w1, w3) colwise, wo and MLP down (w2) rowwise,
    norms sequence. Outside: the token embedding rowwise (vocab-parallel), the final norm
    sequence, the lm head colwise (vocab-parallel). Used when a plan with tp > 1 has an empty
    layout (a plan built from a bare ParallelConfig).

    Args:
        model: the full model (any device, meta included).
        container: attribute name of the block container.

    Returns:
        A layout such as ``{"layers.*.attention.wq": "colwise", ...}``.
    """
    layout: dict[str, str] = {}
    for fqn, module in model.named_modules():
        parts = fqn.split(".")
        if len(parts) >= 2 and parts[0] == container:
            pattern = ".".join([container, "*", *parts[2:]])
            leaf = parts[-1]
            if isinstance(module, NORM_TYPES):
                layout[pattern] = TPStyle.SEQUENCE.value
            elif isinstance(module, nn.Linear) and leaf in ("wq", "wk", "wv", "w1", "w3"):
                layout[pattern] = TPStyle.COLWISE.value
            elif isinstance(module, nn.Linear) and leaf in ("wo", "w2"):
                layout[pattern] = TPStyle.ROWWISE.value
        elif fqn == "tok_embeddings" and isinstance(module, nn.Embedding):
            layout[fqn] = TPStyle.ROWWISE.value
        elif fqn == "norm" and isinstance(module, NORM_TYPES):
            layout[fqn] = TPStyle.SEQUENCE.value
        elif fqn == "output" and isinstance(module, nn.Linear):
            layout[fqn] = TPStyle.COLWISE.value
    return layout


def resolve_layout(model: nn.Module, layout: Mapping[str, str]) -> dict[str, str]:
    """Match the layout's FQN patterns (fnmatch) against the modules present in ``model``.

    Args:
        model: a model or a pipeline stage module (its FQNs are the full model's).
        layout: FQN or pattern -> style name; a later exact FQN overrides a pattern.

    Returns:
        Exact FQN -> style name for every module of ``model`` the layout names (replicate dropped).
    """
    resolved: dict[str, str] = {}
    for fqn, _module in model.named_modules():
        if not fqn:
            continue
        style = layout.get(fqn)
        if style is None:
            for pattern, value in layout.items():
                if fnmatch.fnmatchcase(fqn, pattern):
                    style = value
                    break
        if style is not None and style != TPStyle.REPLICATE.value:
            resolved[fqn] = style
    return resolved


def _style_for(
    fqn: str, module: nn.Module, style: str, *, in_block: bool, sp: bool
) -> ParallelStyle | None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1)  # the sequence dimension of [b, s, h] activations
    if isinstance(module, nn.Embedding):
        if style == TPStyle.ROWWISE.value:  # vocab-parallel: all-reduce of the output
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if style == TPStyle.COLWISE.value:  # hidden-parallel: all-gather of the output
            return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    elif isinstance(module, nn.Linear):
        if style == TPStyle.COLWISE.value and in_block:
            return ColwiseParallel()
        if style == TPStyle.COLWISE.value:  # the head: all-gather the vocabulary shards
            return ColwiseParallel(
                input_layouts=seq if sp else Replicate(), output_layouts=Replicate()
            )
        if style == TPStyle.ROWWISE.value and in_block:
            return RowwiseParallel(output_layouts=seq if sp else Replicate())
    elif isinstance(module, NORM_TYPES) and style == TPStyle.SEQUENCE.value:
        return SequenceParallel() if sp else None
    raise AutoparError(
        f"tensor parallelism cannot apply style {style!r} to {fqn} ({type(module).__name__}); "
        "autopar shards linears (colwise/rowwise) in blocks, a colwise head, a rowwise/colwise "
        "embedding and sequence-parallel norms: fix the plan's tp_layout"
    )


def build_tp_plan(
    module: nn.Module, layout: Mapping[str, str], *, container: str, sp: bool, first_block: str
) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan (exact FQN -> ParallelStyle) for one (stage) module.

    Args:
        module: the model or a pipeline-stage module with the full model's FQNs.
        layout: the plan's tp_layout (patterns allowed).
        container: attribute name of the block container ("layers").
        sp: sequence parallelism on.
        first_block: FQN of the model's first block (it cuts its input to the sequence shard).

    Returns:
        FQN -> ParallelStyle for every module to parallelize.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    modules = dict(module.named_modules())
    resolved = resolve_layout(module, layout)
    tp_plan: dict[str, ParallelStyle] = {}
    for fqn, style in resolved.items():
        in_block = fqn.startswith(container + ".")
        parallel_style = _style_for(fqn, modules[fqn], style, in_block=in_block, sp=sp)
        if parallel_style is not None:
            tp_plan[fqn] = parallel_style
    # The parent of the colwise linears in a block (attention, feed_forward) turns its input into
    # one replicated DTensor that q/k/v (or w1/w3) share, so backward sums their partial input
    # gradients and all-reduces once (Megatron's "f"); with SP it all-gathers the norm's sequence
    # shards (and reduce-scatters in backward).
    parents = {
        fqn.rsplit(".", 1)[0]
        for fqn, style in resolved.items()
        if style == TPStyle.COLWISE.value and fqn.startswith(container + ".")
    }
    for parent in sorted(parents):
        tp_plan[parent] = PrepareModuleInput(
            input_layouts=(Shard(1) if sp else Replicate(),), desired_input_layouts=(Replicate(),)
        )
    if sp and first_block in modules:
        tp_plan[first_block] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
            use_local_output=True,
        )
    return tp_plan


def apply_tensor_parallel(
    module: nn.Module,
    tp_mesh: DeviceMesh,
    layout: Mapping[str, str],
    *,
    container: str,
    sequence_parallel: bool,
    first_block: str,
) -> None:
    """Shard ``module`` in place over the "tp" mesh axis; a no-op when its size is 1.

    Args:
        module: the model or a pipeline-stage module (full-model FQNs).
        tp_mesh: the 1-D "tp" sub-mesh.
        layout: the plan's tp_layout (FQN patterns -> style names).
        container: attribute name of the block container.
        sequence_parallel: shard norms and the residual stream along the sequence.
        first_block: FQN of the model's first block.
    """
    if tp_mesh.size() == 1:
        return
    from torch.distributed.tensor.parallel import parallelize_module

    tp_plan = build_tp_plan(
        module, layout, container=container, sp=sequence_parallel, first_block=first_block
    )
    if tp_plan:
        parallelize_module(module, tp_mesh, tp_plan)
