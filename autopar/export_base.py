"""What every exporter shares: the ``Export`` document and the plan facts the formats write
(tokens per sequence, a one-sentence header, blocks per stage)."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.plan import Plan

__all__ = ["Export", "blocks_per_stage", "header", "seq_len"]


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
    """Tokens per sequence: tokens/s x step time / global batch (the Estimate's own identity)."""
    est = plan.estimate
    return round(est.tokens_per_s * est.step_time_s / plan.config.global_batch)


def header(plan: Plan) -> str:
    """One sentence naming the plan; raw text (quote or ``one_line`` it where it is written)."""
    model = plan.model or "model"
    return f"autopar plan for {model}: {plan.config.describe()}"


def blocks_per_stage(plan: Plan) -> list[int]:
    """Transformer blocks (``layers.<i>``) in each of the plan's stages."""
    return [sum(n.startswith("layers.") for n in s.layer_names) for s in plan.stages]
