"""What every exporter shares: the ``Export`` document and the plan facts the formats write
(tokens per sequence, a one-sentence header, blocks per stage, the recompute pattern, the stage
split's partition method)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.cost_model.framework_support import split_recompute_refusal
from autopar.cost_model.frameworks import get_framework
from autopar.cost_model.recompute_layers import recompute_pattern, recompute_refusal
from autopar.cost_model.stage_splits import split_method, split_refusal
from autopar.plan import Plan, PlanFormatError

__all__ = ["NOT_BLOCKS", "Export", "block_mode", "blocks_per_stage", "header", "is_block",
           "plan_recompute", "plan_split_method", "recompute_refusal_for", "seq_len",
           "split_refusal_for"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Export:
    """An exported document.

    Attributes:
        text: the document, exactly as it should be written.
        notes: what the target cannot express or what the user must still do (for stderr).
    """

    text: str
    notes: tuple[str, ...] = ()


def seq_len(plan: Plan) -> int:
    """Tokens per sequence: the plan's own ``seq_len``, else tokens/s x step time / global batch
    (the Estimate's own identity), which must then come to a whole number of tokens >= 1."""
    est = plan.estimate
    tokens = est.tokens_per_s * est.step_time_s / plan.config.global_batch
    if plan.seq_len:
        # The two must agree: an edited seq_len would be exported as the run's sequence.
        if est.step_time_s > 0 and abs(tokens - plan.seq_len) > 0.01 * plan.seq_len:
            raise PlanFormatError(
                f"the plan's seq_len {plan.seq_len:,} contradicts its estimate ({tokens:,.0f} "
                "tokens per sequence: tokens_per_s x step_time_s / global_batch); re-create the "
                "plan with `autopar plan`")
        return plan.seq_len
    if not 0.5 <= tokens < math.inf:
        raise PlanFormatError(
            f"the plan records no seq_len and its estimate gives {tokens:g} tokens per sequence "
            "(tokens_per_s x step_time_s / global_batch); re-create the plan with `autopar plan`")
    return round(tokens)


def header(plan: Plan) -> str:
    """One sentence naming the plan; raw text (quote or ``one_line`` it where it is written)."""
    model = plan.model or "model"
    return f"autopar plan for {model}: {plan.config.describe()}"


# The profile's layers that are not blocks (graph/layers.py): the embedding, the head, and the
# single layer of a model without blocks; a block is named by its module (``layers.3`` in the
# zoo, ``model.layers.3`` in a Hugging Face decoder).
NOT_BLOCKS = frozenset({"embedding", "head", "model"})


def is_block(layer_name: str) -> bool:
    """Whether a plan's profile layer is a transformer block."""
    return layer_name not in NOT_BLOCKS


def blocks_per_stage(plan: Plan) -> list[int]:
    """Transformer blocks in each of the plan's stages."""
    return [sum(is_block(n) for n in s.layer_names) for s in plan.stages]


def _plan_layout(plan: Plan) -> tuple[list[tuple[int, int]], list[bool], list[int]]:
    """The plan's stage split, which layers are blocks (``is_block``), each stage's rank."""
    split = [(s.layers[0], s.layers[1]) for s in plan.stages]
    blocks = [is_block(n) for s in plan.stages for n in s.layer_names]
    return split, blocks, [plan.rank_of_stage(s.index) for s in plan.stages]


def plan_recompute(plan: Plan, framework: str) -> tuple[str, int] | None:
    """How ``framework`` sets the plan's per-layer recompute (``recompute_pattern``): ("uniform",
    0), its pattern with a count, or None when it cannot."""
    split, blocks, ranks = _plan_layout(plan)
    return recompute_pattern(get_framework(framework).recompute_layers,
                             plan.recompute_per_layer, split, blocks, ranks)


def recompute_refusal_for(plan: Plan, framework: str) -> str | None:
    """Why ``framework`` cannot set the plan's per-layer recompute (None when it can)."""
    split, blocks, ranks = _plan_layout(plan)
    return recompute_refusal(framework, get_framework(framework).recompute_layers,
                             plan.recompute_per_layer, split, blocks, ranks) or (
        split_recompute_refusal(plan.config, plan.recompute_per_layer))


def plan_split_method(plan: Plan, framework: str) -> str | None:
    """How ``framework`` cuts the plan's stages (``split_method``): "any", its partition method,
    or None when it cannot."""
    split, blocks, _ranks = _plan_layout(plan)
    return split_method(get_framework(framework).stage_splits, split, blocks)


def split_refusal_for(plan: Plan, framework: str) -> str | None:
    """Why ``framework`` cannot cut the plan's stages (None when it can)."""
    split, blocks, _ranks = _plan_layout(plan)
    return split_refusal(framework, get_framework(framework).stage_splits, split, blocks)


def block_mode(plan: Plan) -> str:
    """The recompute mode of the plan's blocks when they share one (else its config's)."""
    modes = {r for s in plan.stages for n, r in zip(s.layer_names, s.recompute, strict=True)
             if is_block(n)}
    return modes.pop() if len(modes) == 1 else plan.config.recompute
