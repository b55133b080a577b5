"""apply_plan: turn a Plan into this rank's sharded modules and pipeline schedule.

Order (STYLE.md section 6): CP -> PP split -> TP -> EP -> recompute (AC) -> DP, one
``apply_<axis>`` per mesh axis, each a no-op at degree 1. ``check_plan_runnable`` raises every
error it can before any process group exists, so the launcher calls it first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autopar.config import uses_autocast
from autopar.cost_model.validate import cp_problem, ep_problem, sp_problem, tp_problem
from autopar.errors import AutoparError, PlanMismatchError
from autopar.models.zoo import TORCH_DTYPES
from autopar.runtime.context_parallel import apply_context_parallel
from autopar.runtime.data_parallel import apply_data_parallel
from autopar.runtime.expert_parallel import apply_expert_parallel, ep_groups
from autopar.runtime.loss import default_loss, vocab_parallel_loss
from autopar.runtime.mesh import data_parallel_mesh, mesh_device, random_ops_seed
from autopar.runtime.nested_stage import shard_head_stand_ins
from autopar.runtime.pipeline_parallel import (
    ModelStructure,
    build_schedule,
    build_stages,
    find_structure,
    split_stage,
)
from autopar.runtime.recompute import ATTENTION_NAMES, apply_recompute, find_attention
from autopar.runtime.tensor_parallel import apply_tensor_parallel, default_tp_layout
from autopar.runtime.tied_weights import (
    TiedCopies,
    check_tied_split,
    prepare_tied,
    retie,
    tied_copies,
    tied_fqns,
)
from autopar.runtime.tp_checks import check_tensor_parallel
from autopar.schedules import check_schedule

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from autopar.config import ParallelConfig
    from autopar.models.spec import ModelSpec
    from autopar.plan import Plan, StagePlan

__all__ = ["ParallelizedModel", "apply_plan", "check_plan_runnable", "default_loss"]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class ParallelizedModel:
    """This rank's share of a model under a plan.

    Attributes:
        model_parts: the modules this rank owns (one per pipeline stage it runs, model order; one
            when pp == 1). Give ``[p for m in model_parts for p in m.parameters()]`` to the
            optimizer and ``model_parts`` to ``torch.distributed.checkpoint``. A part may be a
            ``DistributedDataParallel`` wrapper (zero 0, tp == pp == 1): FQNs carry ``module.``.
        schedule: the torch pipelining schedule (pp > 1), else None.
        stages: the ``PipelineStage`` objects (pp > 1), else empty.
        has_first_stage: this rank runs the model's first stage (it takes the tokens).
        has_last_stage: this rank runs the last stage (it takes the labels, computes the loss).
        plan: the plan applied.
        mesh: the ("pp", "dp", "cp", "tp") mesh.
        loss_fn: ``loss_fn(output, labels) -> scalar``: the model's output and the batch's targets
            (mean token cross entropy of the logits by default, or the model's own ``.loss``).
        stage_indices: the stage indices of ``model_parts``.
        autocast_dtype: dtype for ``torch.autocast`` around the forward, or None (fp32, or FSDP2
            mixed precision, which casts by itself).
        tied: the copies of a weight tied between the token embedding and the lm head when the
            pipeline split them (``train_step`` sums their gradients: tied_weights.py), else None.
    """

    model_parts: tuple[nn.Module, ...]
    schedule: Any
    stages: tuple[Any, ...]
    has_first_stage: bool
    has_last_stage: bool
    plan: Plan
    mesh: DeviceMesh
    loss_fn: LossFn
    stage_indices: tuple[int, ...]
    autocast_dtype: torch.dtype | None
    tied: TiedCopies | None = None

    @property
    def loss_parallel(self) -> bool:
        """The head's logits stay sharded over tp and the loss is ``vocab_parallel_loss``, run
        under torch's ``loss_parallel()`` (``train_step`` enters it around forward and
        backward; runtime/tensor_parallel.py)."""
        return self.loss_fn is vocab_parallel_loss

    def parameters(self) -> list[nn.Parameter]:
        """All parameters of ``model_parts`` (for the optimizer)."""
        return [p for part in self.model_parts for p in part.parameters()]



def _spec_of(model_or_spec: nn.Module | ModelSpec) -> ModelSpec | None:
    if isinstance(model_or_spec, nn.Module):
        return getattr(model_or_spec, "autopar_spec", None)
    return model_or_spec


def _check_spec(spec: ModelSpec, plan: Plan) -> None:
    cfg = plan.config
    if plan.num_layers != spec.layers + 2:
        raise PlanMismatchError(
            f"the plan covers {plan.num_layers} layers but the model has {spec.layers} blocks "
            f"(+ embedding and head = {spec.layers + 2}); make the plan for this model"
        )
    problem = (tp_problem(cfg.tp, [("heads", spec.heads), ("kv_heads", spec.kv_heads)])
               or sp_problem(cfg.sequence_parallel, cfg.tp, cfg.cp, spec.seq_len)
               or cp_problem(cfg.cp, spec.seq_len))
    if problem:
        raise AutoparError(problem)


def _check_ep(model_or_spec: nn.Module | ModelSpec, plan: Plan) -> None:
    """Expert parallelism runs dropless experts the runtime can run one at a time (the zoo's,
    and the stacked experts of Hugging Face families: ``graph.moe``). With tp > 1 every tp rank
    of an ep group's member holds the same experts and routes the same (replicated) tokens
    (``expert_parallel.ep_groups``: one ep group per tp index)."""
    cfg = plan.config
    if cfg.ep == 1:
        return
    spec = _spec_of(model_or_spec)
    if spec is not None:
        experts, blocker = spec.experts, (
            "the model's experts drop the tokens over their capacity; build it with "
            "capacity_factor=0" if spec.capacity_factor else "")
    else:
        from autopar.graph.moe import expert_modules, expert_weights, modules_ep_blocker

        found = expert_modules(model_or_spec) if isinstance(model_or_spec, nn.Module) else []
        weights = expert_weights(found[0][1]) if found else None
        experts = weights.experts if weights else 0
        blocker = modules_ep_blocker([m for _n, m in found])
    if not experts:
        raise AutoparError(f"ep={cfg.ep} needs a mixture-of-experts model; use ep=1")
    if blocker:
        raise AutoparError(f"autopar's runtime cannot shard these experts over ep: {blocker}; "
                           "use ep=1, or a framework that runs its own implementation "
                           "(--framework torchtitan or megatron-lm)")
    problem = ep_problem(cfg.ep, [experts])
    if problem:
        raise AutoparError(problem)


def _check_moe_sp(model_or_spec: nn.Module | ModelSpec, plan: Plan) -> None:
    """Under sequence parallelism a mixture of experts runs on the gathered sequence, in the
    module that holds its router and experts (tensor_parallel.py); experts without such a
    module are refused."""
    cfg = plan.config
    if not (cfg.sequence_parallel and cfg.tp > 1) or not isinstance(model_or_spec, nn.Module):
        return
    from autopar.graph.moe import expert_modules
    from autopar.graph.moe_structure import moe_modules

    held = moe_modules(model_or_spec)
    loose = [name for name, _m in expert_modules(model_or_spec)
             if not any(name.startswith(moe + ".") for moe in held)]
    if loose:
        raise AutoparError(f"autopar's runtime gathers the sequence into the module holding a "
                           f"mixture of experts' router and experts, and {loose[0]} has none; "
                           "plan with sequence_parallel off")


def _check_schedule(plan: Plan) -> None:
    cfg = plan.config
    try:
        check_schedule(cfg.schedule, cfg.pp, cfg.virtual_stages, cfg.num_microbatches)
    except ValueError as e:
        raise AutoparError(str(e)) from None


def _structure_or_none(model: nn.Module) -> ModelStructure | None:
    return _structure_or_reason(model)[0]


def _structure_or_reason(model: nn.Module) -> tuple[ModelStructure | None, str]:
    # The block structure tp and pp split along, or why the model has none.
    try:
        return find_structure(model), ""
    except AutoparError as err:
        return None, str(err)


def _any_model_blocks(model: nn.Module) -> tuple[str, tuple[str, ...]]:
    """The repeated blocks of a model the runtime cannot split (the profile's rule)."""
    from autopar.graph.structure import find_blocks

    return find_blocks(model)


def _check_any_model(model: nn.Module, plan: Plan, reason: str) -> None:
    # A model without a top-level block container runs under data parallelism only.
    cfg = plan.config
    if cfg.tp == 1 and cfg.pp == 1:
        _container, blocks = _any_model_blocks(model)
        if any(mode != "none" for stage in plan.stages for mode in stage.recompute) and (
            plan.num_layers != len(blocks) + 2
        ):
            raise AutoparError(
                f"the plan recomputes {plan.num_layers - 2} blocks but {type(model).__name__} "
                f"has {len(blocks)} repeated blocks; use recompute 'none' for this model"
            )
        return
    where = reason or "it has no block container (no nn.ModuleList/ModuleDict of alike blocks)"
    split = " and ".join(f"{name}={getattr(cfg, name)}" for name in ("tp", "pp")
                         if getattr(cfg, name) > 1)
    raise AutoparError(
        f"{type(model).__name__} cannot be split with {split}: {where}; data parallelism runs "
        f"any model: use --dp {cfg.world_size} (with --zero 3 to shard it)"
    )


def _check_context_parallel(model: nn.Module, plan: Plan) -> None:
    from autopar.graph.cp import cp_blocker

    reason = cp_blocker(model) if plan.config.cp > 1 else ""
    if reason:
        raise AutoparError(
            f"{type(model).__name__} cannot run with cp={plan.config.cp}: context parallelism "
            f"shards the sequence inside the attention autopar runs, and {reason}; use cp=1 "
            "(dp, tp and pp run it), or a framework that runs its own implementation "
            "(--framework torchtitan or megatron-lm)"
        )


def _check_model(model: nn.Module, plan: Plan) -> None:
    cfg = plan.config
    _check_context_parallel(model, plan)
    structure, reason = _structure_or_reason(model)
    if structure is None:
        _check_any_model(model, plan, reason)
        return
    if plan.num_layers != len(structure.block_keys) + 2:
        raise PlanMismatchError(
            f"the plan covers {plan.num_layers} layers but the model has "
            f"{len(structure.block_keys)} blocks (+ embedding and head); make the plan for "
            "this model"
        )
    tied = tied_fqns(model)
    if tied and (cfg.pp > 1 or cfg.tp > 1):
        check_tied_split(model, tied, structure.before, structure.after, plan.tp_layout, cfg.tp,
                         cfg.world_size)
    if cfg.tp > 1:
        check_tensor_parallel(model, plan, structure)
    for stage in plan.stages:
        for offset, mode in enumerate(stage.recompute):
            layer = stage.layers[0] + offset
            if mode == "selective" and 1 <= layer <= len(structure.block_keys):
                block = model.get_submodule(
                    structure.block_fqn(structure.block_keys[layer - 1])
                )
                _check_selective(block, layer)


def _check_selective(block: nn.Module, layer: int) -> None:
    # Selective recomputation checkpoints the block's attention child: it must exist.
    if find_attention(block) is None:
        raise AutoparError(
            f"selective recomputation of layer {layer} needs an attention child named one of "
            f"{ATTENTION_NAMES}; use recompute 'full' or 'none' for this model"
        )


def check_plan_runnable(model_or_spec: nn.Module | ModelSpec, plan: Plan) -> None:
    """Raise an AutoparError if the runtime cannot run ``plan`` on this model.

    Call it before starting processes: it needs no process group. With a ModelSpec it checks the
    shape (layers, heads, kv heads, sequence length against tp); with a model (meta device is
    fine) it also checks the block container, tied weights, the tp_layout against the modules,
    and selective recomputation.

    Args:
        model_or_spec: the model (any device) or its ``ModelSpec``.
        plan: the plan.

    Raises:
        AutoparError: with a one-line message saying what is wrong and what to do.
    """
    from autopar.cost_model.framework_names import RUNTIME
    from autopar.cost_model.framework_support import split_recompute_refusal
    from autopar.cost_model.frameworks import framework_supports, get_framework

    # What this runtime runs at all (the "autopar" record: dtypes, schedules, ZeRO stages,
    # offload, ...), whatever framework the plan was made for.
    reason = framework_supports(get_framework(RUNTIME), plan.config) or (
        split_recompute_refusal(plan.config, plan.recompute_per_layer))
    if reason:
        raise AutoparError(f"autopar's runtime cannot run this plan: {reason}; export it for "
                           "the framework it was made for (`autopar export`)")
    spec = _spec_of(model_or_spec)
    if spec is not None:
        _check_spec(spec, plan)
    _check_schedule(plan)
    _check_ep(model_or_spec, plan)
    _check_moe_sp(model_or_spec, plan)
    if isinstance(model_or_spec, nn.Module):
        _check_model(model_or_spec, plan)


def _default_loss() -> LossFn:
    return default_loss


def _owned_block_fqns(stage: StagePlan, structure: ModelStructure) -> dict[str, str]:
    # Block FQN -> recompute choice for the blocks in the stage's profile-layer range.
    choices: dict[str, str] = {}
    num_blocks = len(structure.block_keys)
    for offset, layer in enumerate(range(stage.layers[0], stage.layers[1] + 1)):
        if 1 <= layer <= num_blocks:
            choices[structure.block_fqn(structure.block_keys[layer - 1])] = stage.recompute[offset]
    return choices


def _autocast_dtype(plan: Plan) -> torch.dtype | None:
    cfg = plan.config
    return TORCH_DTYPES[cfg.dtype] if uses_autocast(cfg) else None


def _seeded(pmodel: ParallelizedModel) -> ParallelizedModel:
    """``pmodel``, with torch's generator seeded from rank 0's initial seed as
    ``mesh.random_ops_seed`` mixes it: the training loop's dropout draws the same masks on the
    ranks of a tp group (their replicated parameters would drift apart otherwise)."""
    import torch
    import torch.distributed as dist

    seed = torch.tensor([torch.initial_seed() % 2**63], dtype=torch.int64,
                        device=mesh_device(pmodel.mesh))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    torch.manual_seed(random_ops_seed(pmodel.mesh, int(seed.item())))
    return pmodel


def apply_plan(
    model: nn.Module, plan: Plan, mesh: DeviceMesh, *, loss_fn: LossFn | None = None
) -> ParallelizedModel:
    """Apply ``plan`` to ``model`` on this rank: CP -> PP split -> TP -> EP -> recompute -> DP.

    Args:
        model: the full model with its weights (built from the same seed on every rank). Its
            submodules are reused, not copied: do not use ``model`` itself afterwards.
        plan: the plan (its world size must equal the mesh's).
        mesh: ``build_mesh(plan)``: axes ("pp", "dp", "cp", "tp").
        loss_fn: ``loss_fn(logits, labels) -> scalar`` mean loss; default the zoo's token cross
            entropy.

    Returns:
        The ParallelizedModel of this rank, torch's generator seeded alike on a tp group
        (``_seeded``: dropout draws the same masks on replicated activations).

    Raises:
        AutoparError: the model cannot be run under the plan (see ``check_plan_runnable``).

    Example:
        >>> mesh = build_mesh(plan, "cpu")
        >>> pm = apply_plan(model, plan, mesh)
        >>> opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        >>> loss = train_step(pm, tokens, labels, opt)
    """
    check_plan_runnable(model, plan)
    cfg = plan.config
    structure = _structure_or_none(model)
    if structure is None:
        return _seeded(_apply_any_model(model, plan, mesh, loss_fn or _default_loss()))
    # The default loss runs on logits sharded over the vocabulary (tensor_parallel.py).
    vocab_loss = cfg.tp > 1 and loss_fn is None
    loss = vocab_parallel_loss if vocab_loss else loss_fn or _default_loss()
    # [CP] the zoo attention all-gathers K/V over "cp"; positions are the shard's global ones.
    apply_context_parallel(model, mesh["cp"])
    dp_mesh = data_parallel_mesh(mesh, cfg)
    pp_rank = mesh["pp"].get_local_rank()
    stage_plans = plan.stages_for_rank(pp_rank)
    tied = prepare_tied(model, cfg.pp, cfg.tp)  # a tied embedding and head (tied_weights.py)
    # [PP] one stage module per stage this rank runs (the model itself when pp == 1).
    seq_shards = cfg.tp if cfg.sequence_parallel else 1
    parts = ([split_stage(model, s, structure, seq_shards=seq_shards) for s in stage_plans]
             if cfg.pp > 1 else [model])
    layout = plan.tp_layout or default_tp_layout(model, structure.container)
    experts_groups = ep_groups(cfg, mesh.device_type) if cfg.ep > 1 else None
    wrapped = [_parallelize_part(part, s, structure, layout, mesh, dp_mesh, cfg, experts_groups,
                                 loss_parallel=vocab_loss,
                                 retied=tied if cfg.pp == 1 else None)
               for part, s in zip(parts, stage_plans)]
    indices = tuple(s.index for s in stage_plans)
    stages = tuple(build_stages(wrapped, stage_plans, cfg.num_stages, mesh_device(mesh),
                                mesh["pp"].get_group())) if cfg.pp > 1 else ()
    schedule = build_schedule(list(stages), plan, loss) if cfg.pp > 1 else None
    return _seeded(ParallelizedModel(
        model_parts=tuple(wrapped), schedule=schedule, stages=stages,
        has_first_stage=0 in indices, has_last_stage=cfg.num_stages - 1 in indices, plan=plan,
        mesh=mesh, loss_fn=loss, stage_indices=indices, autocast_dtype=_autocast_dtype(plan),
        tied=tied_copies(tied, mesh, cfg.schedule, cfg.pp, cfg.num_stages),
    ))


def _parallelize_part(part: nn.Module, stage_plan: StagePlan, structure: ModelStructure,
                      layout: dict[str, str], mesh: DeviceMesh, dp_mesh: DeviceMesh,
                      cfg: ParallelConfig, experts_groups: Any, *,
                      loss_parallel: bool = False,
                      retied: tuple[str, str] | None = None) -> nn.Module:
    """TP -> EP -> recompute -> DP on one stage module (the fixed order of ``apply_plan``);
    ``dp_mesh`` is ``mesh.data_parallel_mesh`` (dp, dp x cp, or HSDP's 2-D mesh); ``retied``:
    the FQNs of a weight tied between the embedding and the head, pointed back at one DTensor
    after TP."""
    # [TP] parallelize_module by the plan's layout.
    apply_tensor_parallel(
        part,
        mesh["tp"],
        layout,
        container=structure.container,
        sequence_parallel=cfg.sequence_parallel,
        first_block=structure.first_block,
        loss_parallel=loss_parallel,
    )
    if retied:
        retie(part, retied)
    # [EP] routed experts sharded over the ep ranks (before AC: a recomputed block re-runs
    # the all-to-alls; before DP: the wrappers leave the experts out).
    local_experts = apply_expert_parallel(part, experts_groups, cfg)
    # The hidden states are sequence shards after the model's first block (layer 1).
    if structure.nested and cfg.sequence_parallel and cfg.tp > 1 and stage_plan.layers[1]:
        shard_head_stand_ins(part, structure, mesh["tp"])
    # [AC] per-block recomputation.
    choices = _owned_block_fqns(stage_plan, structure)
    blocks = {fqn: part.get_submodule(fqn) for fqn in choices}
    apply_recompute(blocks, choices)
    # [DP] by ZeRO stage.
    return apply_data_parallel(part, list(blocks.values()), dp_mesh, cfg,
                               ignored_params=local_experts)


def _apply_any_model(
    model: nn.Module, plan: Plan, mesh: DeviceMesh, loss: LossFn
) -> ParallelizedModel:
    """Data parallelism (tp == pp == 1, checked) for a model without a top-level block container.

    The FSDP2 / replicate() units are the profile's repeated blocks (the largest ModuleList or
    ModuleDict of alike children, wherever it sits: ``transformer.h``, ``model.layers``,
    ``encoder.layer``, ``blocks``) plus the root; zero 0 is DDP over the whole model.
    """
    cfg = plan.config
    _container, block_fqns = _any_model_blocks(model)
    blocks = {fqn: model.get_submodule(fqn) for fqn in block_fqns}
    if plan.num_layers == len(block_fqns) + 2:
        # [AC] profile layer i (1..L) is block i-1, as for the zoo's models.
        choices = {}
        for stage in plan.stages:
            for offset, mode in enumerate(stage.recompute):
                layer = stage.layers[0] + offset
                if 1 <= layer <= len(block_fqns):
                    choices[block_fqns[layer - 1]] = mode
        apply_recompute(blocks, choices)
    # [DP] by ZeRO stage.
    wrapped = apply_data_parallel(model, list(blocks.values()), data_parallel_mesh(mesh, cfg),
                                  cfg)
    return ParallelizedModel(
        model_parts=(wrapped,),
        schedule=None,
        stages=(),
        has_first_stage=True,
        has_last_stage=True,
        plan=plan,
        mesh=mesh,
        loss_fn=loss,
        stage_indices=(0,),
        autocast_dtype=_autocast_dtype(plan),
    )
