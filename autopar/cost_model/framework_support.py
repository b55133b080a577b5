"""What a training framework can run: ``framework_supports(framework, config)``.

Each answer (``model_support``: what it runs of this model) comes from the
framework's record (``frameworks.py``: its schedules, ZeRO stages,
sequence, expert and the other dimensions' parallelism (``framework_dimensions.py``), each
field sourced) and from the settings its user switched on
(the framework's own argument checks); ``plan(framework=...)`` proposes only what it can run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopar.config import dp_mechanism
from autopar.cost_model import framework_dimensions as dims
from autopar.cost_model.held_counts import splits_backward
from autopar.cost_model.identity_cache import IdentityCache

if TYPE_CHECKING:
    from autopar.cost_model.frameworks import Framework

__all__ = ["cp_runs_on", "ep_blocker", "framework_supports", "fsdp_recuts_tp_shards",
           "model_framework", "model_support", "moe_support", "pp_blocker", "recut_fix",
           "settings_support", "sp_runs_on", "split_recompute_refusal"]


def framework_supports(framework: Framework, config) -> str | None:
    """Why ``framework`` cannot run ``config`` (None when it can)."""
    fw = framework
    if config.pp > 1 and config.schedule not in fw.schedules:
        return (f"{fw.name} runs the pipeline schedules {', '.join(fw.schedules)}, not "
                f"{config.schedule!r}")
    if (config.pp > 1 and config.virtual_stages > 1 and fw.interleaved_groups_of_pp
            and config.num_microbatches % config.pp):
        return (f"{fw.name}'s interleaved schedule runs micro-batches in groups of pp = "
                f"{config.pp} and needs their count per pipeline ({config.num_microbatches}) to "
                f"be a multiple of it; use a global batch that gives a multiple of {config.pp} "
                "micro-batches, or the 1f1b schedule")
    if config.dp > 1 and config.zero not in fw.zero_stages:
        return f"{fw.name} runs ZeRO stages {fw.zero_stages}, not zero={config.zero}"
    if config.pp > 1 and config.dp > 1 and config.zero > fw.zero_with_pipeline:
        return (f"{fw.name} runs ZeRO stage {config.zero} without pipeline parallelism only "
                f"(at most zero={fw.zero_with_pipeline} with pp > 1)")
    if (config.pp > 1 and dp_mechanism(config) == "fsdp" and config.zero == 3
            and splits_backward(config.schedule)):
        return _split_backward_zero3(fw, config)
    reason = split_recompute_refusal(config, (config.recompute,))
    if reason:
        return reason
    if config.sequence_parallel and not fw.sequence_parallel:
        return f"{fw.name} has no sequence parallelism; use sequence_parallel=False"
    if config.ep > 1 and not fw.expert_parallel:
        return (f"{fw.name} does not run expert parallelism ({fw.sources['expert_parallel']}); "
                "use ep=1")
    if config.ep > 1:
        reason = _ep_support(fw, config)
        if reason:
            return reason
    return settings_support(fw, config) or dims.supports_dimensions(fw, config)


def _split_backward_zero3(fw: Framework, config) -> str:
    """torch's ``PipelineStage`` runs a split backward's weight pass on the parameters its
    module holds then, and FSDP2 with zero 3 has swapped them for their shards at the next
    forward (``reshard_after_forward``): the weight passes land on other tensors. Measured with
    autopar's runtime on torch 2.13 (pp 2 x dp 2, zero 3): interleaved zero bubble reduces
    wrong gradients, zbv-zero-bubble and dualpipe-v hang; zero 1 and 2 (parameters kept
    gathered from forward to backward) match one process
    (tests/distributed/test_runtime_equivalence.py). torchtitan composes the same classes."""
    return (f"{fw.name} runs {config.schedule!r} (a backward split into input and weight "
            "passes) with zero 1 or 2 only: under zero 3 torch's pipeline stages run a "
            "weight pass after the next forward has resharded the parameters; use zero=2 "
            "(--zero 2), or the 1f1b or interleaved-1f1b schedule")


def split_recompute_refusal(config, recompute) -> str | None:
    """Why ``config``'s schedule cannot run these recompute modes (None when it can): under a
    schedule that splits backwards torch's weight pass and activation checkpointing do not
    compose (measured with torch 2.13 on CPU, ``python benchmarks/split_recompute.py``;
    tests/unit/test_graph_weight_pass.py):

    - selective checkpointing allows one backward per region and raises "Trying to backward
      an extra time" at the weight pass;
    - full checkpointing re-runs a block's forward once per parameter group in the weight pass
      (9 forwards of a Llama block, the pass 12 times as long on CPU) and keeps every re-run's
      tensors until the stage's weight pass ends (5 times the block's activations without
      recompute): torch's "zero bubble and activation checkpointing" out-of-memory report
      (pytorch/pytorch issue 136766).

    Every schedule that splits backwards is torch's, so this binds autopar's runtime and
    torchtitan alike (AReaL's torchtitan-based engine switches selective checkpointing off
    under V-shaped schedules: areal-project/AReaL pull request 916)."""
    if config.pp <= 1 or not splits_backward(config.schedule):
        return None
    modes = sorted(set(recompute) - {"none"})
    if not modes:
        return None
    return (f"{config.schedule!r} splits backwards into input and weight passes, and torch's "
            f"weight pass cannot run {' or '.join(modes)} activation checkpointing (selective "
            "raises, full re-runs each block's forward once per parameter group and holds the "
            "re-runs); use recompute 'none', or the 1f1b or interleaved-1f1b schedule")


def cp_runs_on(framework: Framework, profile) -> bool:
    """Whether ``framework`` can shard this model's attention over cp at all: its own
    implementation of the model, or the traced attention it runs (``ModelProfile.cp_blocker``
    "")."""
    return not profile.cp_blocker or not framework.runs_traced_modules


def pp_blocker(profile) -> str:
    """Why autopar's runtime cannot pipeline this model (""): ``ModelProfile.pp_blocker``, or,
    for a profile written before it was recorded, its own loss (a model file's ``loss_fn``
    always comes with its own batches)."""
    if profile.pp_blocker or not profile.own_loss:
        return profile.pp_blocker
    from autopar.graph.inputs import pipeline_blocker

    return pipeline_blocker(None, lambda output, batch: output)


def sp_runs_on(framework: Framework, profile) -> bool:
    """Whether ``framework`` can run this model sequence-parallel: its own implementation of
    the model, or traced modules with no ``TPStructure.sp_blocker``."""
    return not framework.runs_traced_modules or not _facts(profile).sp_blocker


def ep_blocker(framework: Framework, profile) -> str:
    """Why ``framework`` cannot shard this model's experts over ep ("" when it can): where it
    runs the traced experts themselves, what stops them (``MoEStructure.ep_blocker``)."""
    return _facts(profile).experts_blocker if framework.runs_traced_modules else ""


def model_framework(framework: Framework, profile) -> Framework:
    """``framework`` as it runs this model: a framework that runs the traced modules gives a
    model's own loss (``ModelProfile.own_loss``) whole logits, not its vocab-parallel loss
    (autopar's runtime/loss.py)."""
    if framework.runs_traced_modules and profile.own_loss and framework.loss_parallel:
        return dataclasses.replace(framework, loss_parallel=False)
    return framework


@dataclass(frozen=True, slots=True)
class _ModelFacts:
    """What ``model_support`` reads of a profile: its first mixture-of-experts structure,
    and the first blocker of ep, of a tp split and the first fused q/k/v projection ("": none),
    whether tp splits any linear of its blocks (``runtime/tp_checks.py`` refuses a layout
    that splits none), and where its blocks sit (" at 'layers'", for messages)."""

    moe: Any
    experts_blocker: str
    split_blocker: str
    fused_qkv: str
    splits_blocks: bool
    blocks_at: str
    sp_blocker: str


def _build_facts(profile) -> _ModelFacts:
    layers = profile.layers
    return _ModelFacts(
        moe=next((x.moe for x in layers if x.moe), None),
        experts_blocker=next((x.moe.ep_blocker for x in layers if x.moe and x.moe.ep_blocker),
                             ""),
        split_blocker=next((x.tp.split_blocker for x in layers if x.tp.split_blocker), ""),
        fused_qkv=next((x.tp.fused_qkv[0] for x in layers if x.tp.fused_qkv), ""),
        splits_blocks=any(x.tp.colwise or x.tp.fused_qkv for x in layers if x.kind == "block"),
        blocks_at=next((f" at {x.name.rpartition('.')[0]!r}" for x in layers
                        if x.kind == "block" and "." in x.name), ""),
        sp_blocker=next((x.tp.sp_blocker for x in layers if x.tp.sp_blocker), ""),
    )


_FACTS: IdentityCache[_ModelFacts] = IdentityCache(16)


def _facts(profile) -> _ModelFacts:
    """``profile``'s facts, read once per profile (a search asks for every candidate)."""
    return _FACTS.get((profile,), None, lambda: _build_facts(profile))


def model_support(framework: Framework, config, profile) -> str | None:
    """Why ``framework`` cannot run ``config`` on this model (None: it can): mixture-of-experts
    blocks under sequence parallelism; and, where the framework runs the profiled modules
    themselves (``runs_traced_modules``), pipelining of a model trained on its own batches
    (``ModelProfile.pp_blocker``), context parallelism of a model that is not a zoo
    transformer, expert parallelism of experts it cannot run one at a time, tensor parallelism
    of blocks with no linear it knows how to split, or with a weight across heads beside their
    split linears, or of a fused q/k/v
    projection under FSDP."""
    facts = _facts(profile)
    reason = moe_support(framework, config, facts.moe, facts.experts_blocker)
    if reason or not framework.runs_traced_modules:
        return reason
    if config.pp > 1 and pp_blocker(profile):
        return (f"{framework.name} pipelines the model it traced, and {pp_blocker(profile)}; "
                f"use pp=1, {_OWN_CODE}")
    if not cp_runs_on(framework, profile) and config.cp > 1:
        return (f"{framework.name} runs context parallelism inside the attention it runs, "
                f"and {profile.cp_blocker}; use cp=1, {_OWN_CODE}")
    if config.tp > 1 and not facts.splits_blocks:
        return (f"{framework.name} splits the model's own linears over tp, and no linear in its "
                f"blocks{facts.blocks_at} has a tensor-parallel style (the graph knows q/k/v/o, "
                f"MLP and fused q/k/v projections by name); use tp=1, {_OWN_CODE}")
    if config.tp > 1 and config.sequence_parallel and facts.sp_blocker:
        return (f"{framework.name} runs sequence parallelism on the model's own modules, and "
                f"{facts.sp_blocker}; use sequence_parallel=False, {_OWN_CODE}")
    blocker = facts.split_blocker
    if config.tp > 1 and blocker:
        return (f"{framework.name} splits the model's own modules over tp, and {blocker}; "
                f"use tp=1, {_OWN_CODE}")
    # runtime/tp_checks.py refuses the same split when it applies a plan (the same predicate).
    fused = facts.fused_qkv
    if fused and fsdp_recuts_tp_shards(config):
        return (f"{framework.name} splits the fused q/k/v projection {fused} over tp keeping "
                "each rank's q, k and v heads together, a strided shard FSDP2 cannot cut again "
                f"over dp (zero {config.zero}); {recut_fix(config)}, or pp with tp, "
                f"{_OWN_CODE}")
    return None


def fsdp_recuts_tp_shards(config) -> bool:
    """FSDP2 shards the tensor-parallel weights again over the data-parallel ranks (tp > 1 and
    the config's mechanism is FSDP: ``config.dp_mechanism``, over dp x cp)."""
    return config.tp > 1 and dp_mechanism(config) == "fsdp"


def recut_fix(config) -> str:
    """What to change so that FSDP2 does not cut the tp shards again: no FSDP with dp x tp, or no
    offload where FSDP2 runs over one rank only to offload."""
    if config.data_ranks == 1:
        return "use offload='none' (--offload none)"
    return "use zero=0 (--zero 0) for dp x tp"


_OWN_CODE = ("or plan for a framework that runs its own implementation of the model "
             "(--framework torchtitan or megatron-lm)")


def moe_support(framework: Framework, config, moe, ep_blocker: str = "") -> str | None:
    """Why ``framework`` cannot run ``config`` on a model whose mixture of experts is ``moe``
    (a ``MoEStructure``; None for a dense model), or None: its blocks under sequence
    parallelism (``moe_sp_blocker``), or expert parallelism of experts it runs itself and
    cannot shard (``ep_blocker``: the first layer's ``MoEStructure.ep_blocker``). What a plan
    records (``Plan.moe``) is enough, so the exporters ask it too."""
    if moe is None:
        return None
    if config.zero not in framework.moe_zero_stages:
        return (f"{framework.name} trains mixture-of-experts models with ZeRO stages "
                f"{', '.join(map(str, framework.moe_zero_stages))} only; use zero "
                f"{max(framework.moe_zero_stages)}")
    if config.sequence_parallel and config.tp > 1:
        reason = moe_sp_blocker(framework, moe)
        if reason:
            return f"{reason}; use sequence_parallel=False"
    elif config.tp > 1 and framework.moe_tp == "rows":
        return (f"{framework.name} trains mixture-of-experts models under tp only with "
                "sequence parallelism (its arguments check and MoE layer refuse it otherwise); "
                "use sequence_parallel=True")
    if config.ep > 1 and ep_blocker and framework.runs_traced_modules:
        return (f"{framework.name} shards over ep only the experts it runs one at a time "
                f"(dropless, each computing what its module computes), and {ep_blocker}; "
                f"use ep=1, "
                f"{_OWN_CODE}")
    return None


def folds_experts(framework: Framework, config) -> bool:
    """Whether ``framework`` runs ``config``'s routed experts folded over tp (whole on each
    rank, each tp rank routing its own tokens: ``Framework.expert_tp_folded``, at ep > 1 only
    where ``fold_needs_ep``; expert_tp.py)."""
    return framework.expert_tp_folded and config.tp > 1 and (
        config.ep > 1 or not framework.fold_needs_ep)


def moe_tp_mode(framework: Framework, config) -> str:
    """How ``framework``'s MoE blocks talk over tp under ``config`` (``Framework.moe_tp``;
    ``collectives.block_tp_calls``): "boundary" holds with ep off only (with ep on each tp
    rank routes its own tokens: "linears"); folded experts gather nothing ("linears")."""
    if (framework.moe_tp == "boundary" and config.ep > 1) or folds_experts(framework, config):
        return "linears"
    return framework.moe_tp


def moe_routes_whole_sequence(framework: Framework, config) -> bool:
    """Every tp rank routes the whole sequence under sequence parallelism (ep's all-to-alls
    carry it whole): ``moe_tp_mode`` "gather"."""
    return moe_tp_mode(framework, config) == "gather"


def moe_sp_blocker(framework: Framework, moe) -> str:
    """Why ``framework`` cannot run the mixture of experts ``moe`` (a ``MoEStructure``) under
    sequence parallelism, or "": it has none for MoE blocks, or it runs the traced modules and
    the profile found no one module holding the router and the experts to gather the sequence
    into (``MoEStructure.module``)."""
    if not framework.moe_sequence_parallel:
        return f"{framework.name} runs mixture-of-experts models without sequence parallelism"
    if framework.runs_traced_modules and not moe.module:
        return (f"{framework.name} gathers the sequence into the module holding the router and "
                "the experts, and no one module of this model holds both")
    return ""


def _ep_support(fw: Framework, config) -> str | None:
    """Why ``fw`` cannot run ``config``'s expert parallelism (ep > 1), or None."""
    if fw.ep_needs_sharded_dp and config.zero == 0:
        return (f"{fw.name} shards experts over its sharded data-parallel ranks only; use "
                "zero >= 1 with ep > 1")
    if not fw.ep_with_tp and config.tp > 1:
        return f"{fw.name} runs expert parallelism with tp=1 only"
    if not fw.ep_with_cp and config.cp > 1:
        return f"{fw.name} runs expert parallelism with cp=1 only"
    return None


def settings_support(fw: Framework, config) -> str | None:
    """What the framework's settings require of a split (Megatron-LM validate_args)."""
    if "tp-comm-overlap" in fw.settings and config.tp > 1 and not config.sequence_parallel:
        return ("megatron-lm's --tp-comm-overlap needs sequence parallelism (validate_args); "
                "use sequence_parallel=True")
    if "overlap-param-gather" in fw.settings and config.dp > 1 and (
            config.zero == 0 or "overlap-grad-reduce" not in fw.settings):
        return ("megatron-lm's --overlap-param-gather needs the distributed optimizer (zero=1) "
                "and --overlap-grad-reduce (validate_args)")
    if "distribute-saved-activations" in fw.settings and (
            config.tp == 1 or config.sequence_parallel):
        return ("megatron-lm's --distribute-saved-activations needs tp > 1 without sequence "
                "parallelism (validate_args, TransformerConfig); use tp > 1 and "
                "sequence_parallel=False")
    if "bf16-adam-moments" in fw.settings and (
            (config.zero != 1 and config.data_ranks > 1) or config.offload != "none"):
        return ("megatron-lm's --use-precision-aware-optimizer runs with the distributed "
                "optimizer only (megatron/core/optimizer); use zero=1, and offload=none "
                "(autopar does not cost bf16 moments in host memory)")
    if "cpu-checkpointing" in fw.settings and "partition-activations" not in fw.settings:
        return ("deepspeed's cpu_checkpointing offloads partitioned activations only; add the "
                "partition-activations setting")
    return None
