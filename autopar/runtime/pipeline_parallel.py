"""Pipeline parallelism: split a model into stage modules along a plan's stage boundaries.

A stage module is a shallow copy of the model's root whose non-owned parts are removed: outer
modules (embeddings before the block container, final norm and head after it) are set to None and
the block container keeps only the owned blocks under their original keys. No parameter is
copied, and FQNs stay those of the full model (``layers.5.attention.wq.weight`` on whichever
stage owns block 5), so gradients, checkpoints and tensor-parallel layouts line up across splits.
The stage's forward is the model's own: it must run whatever parts are present (the zoo's
convention, docs/model-structure.md). Each stage becomes a hand-built
``torch.distributed.pipelining.PipelineStage`` (``LeanPipelineStage``, lean_pipeline.py: receive
buffers for the micro-batches in flight only); the schedule class comes from the plan's
``schedule`` name.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from autopar.errors import AutoparError
from autopar.schedules import get_schedule

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from autopar.plan import Plan, StagePlan

__all__ = [
    "CONTAINER_NAMES",
    "ModelStructure",
    "build_schedule",
    "find_structure",
    "split_stage",
]

# Attribute names recognised as the block container (zoo: "layers"; HF-like: "h", "blocks").
CONTAINER_NAMES: tuple[str, ...] = ("layers", "blocks", "h")



@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStructure:
    """Where a model keeps its parts.

    Attributes:
        container: attribute name of the block container (a ModuleDict or ModuleList).
        block_keys: the container's keys in order ("0", "1", ...).
        before: names of the root's children registered before the container (the
            "embedding" layer), e.g. ("tok_embeddings", "pos_embeddings").
        after: names registered after it (the "head" layer), e.g. ("norm", "output").
        nested: the container sits below the root (``model.layers``, ``transformer.h``):
            ``container`` is its FQN, ``before`` / ``after`` are the FQNs of the outer modules
            with parameters, and stages run the model's forward on stand-ins (nested_stage.py).
    """

    container: str
    block_keys: tuple[str, ...]
    before: tuple[str, ...]
    after: tuple[str, ...]
    nested: bool = False

    def block_fqn(self, key: str) -> str:
        """FQN of a block, e.g. "layers.3"."""
        return f"{self.container}.{key}"

    @property
    def first_block(self) -> str:
        """FQN of the model's first block."""
        return self.block_fqn(self.block_keys[0])


def find_structure(model: nn.Module) -> ModelStructure:
    """Recognise the block container and the outer modules of ``model``.

    A child named one of ``CONTAINER_NAMES`` holding the blocks (the zoo's convention), else the
    profile's block container anywhere below the root when the model is a decoder language model
    (nested_stage.py: a token embedding before the blocks, no other block stack).

    Raises:
        AutoparError: neither; the message says what blocks the split.
    """
    names = list(model._modules)
    for container in CONTAINER_NAMES:
        blocks = model._modules.get(container)
        if isinstance(blocks, (nn.ModuleDict, nn.ModuleList)) and len(blocks) > 0:
            index = names.index(container)
            return ModelStructure(
                container=container,
                block_keys=tuple(blocks._modules),
                before=tuple(names[:index]),
                after=tuple(names[index + 1 :]),
            )
    from autopar.runtime.nested_stage import nested_parts

    container, before, after = nested_parts(model)
    return ModelStructure(
        container=container,
        block_keys=tuple(model.get_submodule(container)._modules),
        before=before,
        after=after,
        nested=True,
    )


def _owned_blocks(stage: StagePlan, structure: ModelStructure) -> list[str]:
    # Profile layer i (1..L) is block i-1; layer 0 is the embedding, L+1 the head.
    first, last = stage.layers
    num_blocks = len(structure.block_keys)
    return [structure.block_keys[i - 1] for i in range(first, last + 1) if 1 <= i <= num_blocks]


def split_stage(
    model: nn.Module, stage: StagePlan, structure: ModelStructure, *, seq_shards: int = 1
) -> nn.Module:
    """The stage module for ``stage``: the model's parts in the stage's layer range.

    Args:
        model: the full model (not modified; its submodules are shared, not copied).
        stage: the stage's plan (layer range over the profile's layers).
        structure: ``find_structure(model)``.
        seq_shards: pieces the sequence is cut into between stages (tp with sequence
            parallelism, else 1); read by nested-container stages, which rebuild the positions.

    Returns:
        A shallow copy of the root with the parts outside the stage removed.
    """
    if structure.nested:
        from autopar.runtime.nested_stage import split_nested_stage

        return split_nested_stage(
            model, stage, structure, _owned_blocks(stage, structure), seq_shards=seq_shards
        )
    num_blocks = len(structure.block_keys)
    first, last = stage.layers
    part = copy.copy(model)
    # Fresh registries: the shallow copy would otherwise share the dicts with ``model``.
    part._modules = dict(model._modules)
    part._parameters = dict(model._parameters)
    part._buffers = dict(model._buffers)
    for name in structure.before:
        if first > 0:
            part._modules[name] = None
    for name in structure.after:
        if last < num_blocks + 1:
            part._modules[name] = None
    source = model._modules[structure.container]
    owned = _owned_blocks(stage, structure)
    blocks = type(source)() if isinstance(source, nn.ModuleList) else nn.ModuleDict()
    # Keep the original keys (also for a ModuleList, whose iteration follows _modules' values).
    blocks._modules = {key: source._modules[key] for key in owned}
    part._modules[structure.container] = blocks
    if model._parameters and first > 0:
        raise AutoparError(
            f"{type(model).__name__} has parameters directly on the root module "
            f"({', '.join(model._parameters)}); pipeline splitting needs them inside submodules"
        )
    return part


def build_stages(
    parts: list[nn.Module],
    stage_plans: tuple[StagePlan, ...],
    num_stages: int,
    device: torch.device,
    pp_group: dist.ProcessGroup,
) -> list[Any]:
    """Hand-built pipeline stages for this rank's stage modules (model order).

    ``LeanPipelineStage`` (lean_pipeline.py): torch's ``PipelineStage`` holding receive buffers only
    for the micro-batches in flight, not one per micro-batch for the whole step.
    """
    from autopar.runtime.lean_pipeline import LeanPipelineStage

    return [
        LeanPipelineStage(part, stage_plan.index, num_stages, device, group=pp_group)
        for part, stage_plan in zip(parts, stage_plans)
    ]


def build_schedule(
    stages: list[Any], plan: Plan, loss_fn: Callable[..., Any]
) -> Any:
    """The torch pipelining schedule of ``plan.config.schedule`` over this rank's stages.

    ``n_microbatches = global_batch / (dp * micro_batch)``; gradients are scaled by
    ``1 / n_microbatches`` (``scale_grads=True``) so the step equals one on the whole batch.
    """
    import torch.distributed.pipelining as pipelining

    from autopar.runtime.lean_pipeline import lean_schedule_class

    cfg = plan.config
    # Action-list schedules (interleaved, zero bubble, ZBV, DualPipeV) release each send once it
    # has provably completed instead of at the step's end (lean_pipeline.py).
    schedule = get_schedule(cfg.schedule)
    cls = lean_schedule_class(getattr(pipelining, schedule.torch_class))
    n_mb = cfg.num_microbatches
    if not schedule.multi_chunk:
        return cls(stages[0], n_microbatches=n_mb, loss_fn=loss_fn, scale_grads=True)
    return cls(stages, n_microbatches=n_mb, loss_fn=loss_fn, scale_grads=True)
