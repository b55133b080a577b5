"""Text reports of plans and estimates (rich), and the alternatives' deltas in words.

Units shown: bytes as GiB/TiB (binary, as device memory is sold and reported by torch), times in
s/ms/us, parameters and tokens with k/M/B suffixes. The report reads only the records: a Plan, a
ParallelConfig, an Estimate, and ``Alternative`` records computed by the caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.config import ParallelConfig, base_dtype
from autopar.cost_model.comm import tp_spans_nodes
from autopar.cost_model.estimate import Estimate
from autopar.units import format_bytes

__all__ = [
    "TIME_TERMS",
    "Alternative",
    "describe_alternative",
    "format_count",
    "format_time",
    "render_report",
]

# TimeBreakdown field -> words; the order of the report's time table.
TIME_TERMS: tuple[tuple[str, str], ...] = (
    ("compute_s", "compute"),
    ("recompute_s", "recompute"),
    ("tp_comm_s", "TP communication (exposed)"),
    ("cp_comm_s", "CP K/V exchange (exposed)"),
    ("dp_comm_s", "DP communication (exposed)"),
    ("pp_comm_s", "PP communication (exposed)"),
    ("ep_comm_s", "EP all-to-all (exposed)"),
    ("bubble_s", "pipeline bubble"),
    ("optimizer_s", "optimizer step"),
    ("overhead_s", "framework overhead"),
)
MEMORY_KINDS: tuple[tuple[str, str], ...] = (
    ("parameters_bytes", "params"),
    ("gradients_bytes", "grads"),
    ("optimizer_bytes", "optim"),
    ("activations_bytes", "activ"),
    ("buffers_bytes", "buffers"),
    ("pipeline_buffers_bytes", "pipeline buffers"),
)
# The per-rank table's memory columns: each MEMORY_KINDS field in one column, the pipeline's
# receive buffers with the other buffers (the columns add to the rank's total).
TABLE_MEMORY_COLUMNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("params", ("parameters_bytes",)),
    ("grads", ("gradients_bytes",)),
    ("optim", ("optimizer_bytes",)),
    ("activ", ("activations_bytes",)),
    ("buffers", ("buffers_bytes", "pipeline_buffers_bytes")),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Alternative:
    """Another split, compared with the chosen one.

    Attributes:
        label: what differs, in a few words (e.g. "tp=16", "pure DP (dp=64)").
        config: the alternative's config (None when it could not be built).
        estimate: its Estimate (None when it could not be estimated).
        reason: why it has no estimate (e.g. "heads 12 not divisible by tp 8").
    """

    label: str
    config: ParallelConfig | None = None
    estimate: Estimate | None = None
    reason: str = ""


def format_time(seconds: float) -> str:
    """``12.3 s`` / ``45.6 ms`` / ``7.8 us`` (``0`` for nothing)."""
    if seconds == 0:
        return "0"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.1f} us"


def format_count(count: float) -> str:
    """``175.0B`` / ``6.7M`` / ``950`` (decimal suffixes)."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(count) >= scale:
            return f"{count / scale:.1f}{suffix}"
    return f"{count:.0f}"


def config_label(config: ParallelConfig, reference: ParallelConfig) -> str:
    """The fields where ``config`` differs from ``reference``, as ``name=value`` words."""
    ours, theirs = config.to_dict(), reference.to_dict()
    parts = [f"{k}={v}" for k, v in ours.items() if theirs.get(k) != v]
    return " ".join(parts) or "same split"


def describe_alternative(
    alternative: Alternative, best: Estimate, *, gpus_per_node: int | None = None
) -> str:
    """One line saying how an alternative compares with the chosen split.

    Examples: ``"tp=16 dp=4: crosses nodes; step +38%: TP communication 0.21 s -> 0.52 s"``,
    ``"pure DP (dp=64): needs 1.9 TiB per GPU (capacity 76.0 GiB)"``.

    Args:
        alternative: the other split and its estimate.
        best: the chosen split's estimate.
        gpus_per_node: GPUs a node, to say when tensor parallelism crosses nodes.
    """
    label = alternative.label
    est = alternative.estimate
    if est is None:
        return f"{label}: {alternative.reason or 'could not be estimated'}"
    notes = []
    cfg = alternative.config
    if cfg is not None and gpus_per_node and tp_spans_nodes(cfg.tp, gpus_per_node):
        notes.append("crosses nodes")
    if not est.fits:
        notes.append(
            f"needs {format_bytes(est.memory_per_gpu_bytes)} per GPU "
            f"(capacity {format_bytes(est.memory_capacity_bytes)})"
        )
        return f"{label}: " + "; ".join(notes)
    change = est.step_time_s / best.step_time_s - 1 if best.step_time_s > 0 else 0.0
    words = f"step {change * 100:+.0f}%" if abs(change) >= 0.01 else f"step {change * 100:+.1f}%"
    low, high = best.step_time_interval_s
    if low <= est.step_time_s <= high and high > 0:
        words += " (a tie: inside the chosen plan's interval)"
    deltas = [
        (getattr(est.time_breakdown, f) - getattr(best.time_breakdown, f), f, name)
        for f, name in TIME_TERMS
    ]
    grow, field, name = max(deltas) if change >= 0 else min(deltas)
    if abs(grow) > 0.005 * max(best.step_time_s, 1e-12):
        before, after = getattr(best.time_breakdown, field), getattr(est.time_breakdown, field)
        words += f": {name.split(' (')[0]} {format_time(before)} -> {format_time(after)}"
    mem_ratio = est.memory_per_gpu_bytes / max(best.memory_per_gpu_bytes, 1.0)
    if abs(mem_ratio - 1) > 0.1:
        words += (
            f"; memory {format_bytes(best.memory_per_gpu_bytes)} -> "
            f"{format_bytes(est.memory_per_gpu_bytes)}"
        )
    return f"{label}: " + "; ".join([*notes, words])


def recompute_mix(recompute: Sequence[str]) -> str:
    """Per-layer recompute in words: ``full`` when uniform, else ``full on 50 of 98 layers,
    none on 48`` (commonest first)."""
    counts: dict[str, int] = {}
    for mode in recompute:
        counts[mode] = counts.get(mode, 0) + 1
    if len(counts) <= 1:
        return next(iter(counts), "none")
    order = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    (first, n), rest = order[0], order[1:]
    return f"{first} on {n} of {len(recompute)} layers, " + ", ".join(
        f"{mode} on {k}" for mode, k in rest)


def _search_line(plan: Any) -> str | None:
    """How the search went: candidates, pruned, ILPs, and whether the plan is proven optimal."""
    from autopar.cost_model.frameworks import get_framework

    search = getattr(plan, "search", None)
    if search is None or not search.candidates_considered:
        return None
    # `optimal` is per configuration; a time limit can leave a search-wide gap all the same.
    proven = search.optimal and search.mip_gap * 100 < 0.05  # shows as 0.0% anyway
    gap = "optimal" if proven else f"gap {search.mip_gap * 100:.1f}%"
    fw = get_framework(plan.framework)
    own_choices = fw.recompute_layers != "any" or fw.stage_splits != "any"
    if own_choices and not search.optimal and search.mip_gap * 100 < 0.05:  # no ILP ran
        gap = "the framework's recompute choices on balanced splits; uneven ones not searched"
        if fw.stage_splits != "any":
            gap = ("the framework's recompute choices on the splits its partition methods "
                   "cut; others not searched")
    limit = ", time limit hit" if search.time_limit_hit else ""
    return (f"Search: {search.candidates_considered} candidates, {search.candidates_pruned} "
            f"pruned, {search.ilps_solved} ILPs ({gap}{limit})")


def _pattern_words(plan: Any) -> str | None:
    """A framework pattern's recompute in its own terms ("full on the first 3 blocks of each
    stage", Megatron-LM's; "full on every 2nd block of each rank", torchtitan's; the blocks'
    one mode, as every framework recomputes blocks only), else None."""
    from autopar.export_base import is_block, plan_recompute

    framework = getattr(plan, "framework", "")
    pattern = plan_recompute(plan, framework) if framework else None
    if pattern is None or pattern[0] == "any":
        return None
    n = pattern[1]
    if pattern[0] == "uniform":  # blocks only: no framework recomputes the other layers
        modes = {r for s in plan.stages for r, name in zip(s.recompute, s.layer_names,
                                                            strict=True) if is_block(name)}
        return modes.pop() if len(modes) == 1 else None
    if pattern[0] == "first-n":
        return f"full on the first {n} block{'s' * (n > 1)} of each stage, none on the rest"
    return f"full on every {_ordinal(n)} block of each rank, none on the rest"


def _ordinal(n: int) -> str:
    """2nd, 3rd, 11th, 21st, 22nd, ..."""
    if n % 100 in (11, 12, 13):
        return f"{n}th"
    return f"{n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def interval_text(est: Estimate) -> str:
    """``14.1-21.5 s for megatron-lm``: the step-time interval and whose it is."""
    low, high = est.step_time_interval_s
    if high <= 0:
        return ""
    return f" (80%: {format_time(low)}-{format_time(high)} for {est.framework})"


def _tokens_text(plan: Any | None) -> str:
    """`` sequences of 4,096 tokens`` where the plan records its sequence length."""
    seq_len = getattr(plan, "seq_len", 0) or 0
    return f" sequences of {seq_len:,} tokens" if seq_len > 0 else ""


def _summary_lines(config: ParallelConfig, est: Estimate, plan: Any | None = None) -> list[str]:
    mfu = f"{est.mfu * 100:.1f}%"
    if config.dtype == "fp8":  # Estimate.mfu's convention: fp8 runs above the 16-bit peak
        mfu += f" (of the {base_dtype(config.dtype)} peak)"
    split = config.describe()
    per_layer = getattr(plan, "recompute_per_layer", None)
    if per_layer:
        split = split.replace(f"recompute={config.recompute}",
                              f"recompute={_pattern_words(plan) or recompute_mix(per_layer)}")
    return [
        f"[bold]Split[/bold]  {split}",
        f"  global batch {config.global_batch}{_tokens_text(plan)} = dp {config.dp} x micro-batch "
        f"{config.micro_batch} x {config.num_microbatches} micro-batches"
        + (f"; each sequence over cp {config.cp} ranks" if config.cp > 1 else ""),
        *_partition_lines(config, plan),
        f"[bold]Step[/bold] {format_time(est.step_time_s)}{interval_text(est)}   "
        f"[bold]tokens/s[/bold] {format_count(est.tokens_per_s)}   "
        f"[bold]TFLOP/s per GPU[/bold] {est.tflops_per_gpu:.1f} "
        f"(hardware {est.hardware_tflops_per_gpu:.1f})   [bold]MFU[/bold] {mfu}",
        f"[bold]Memory[/bold] {format_bytes(est.memory_per_gpu_bytes)} of "
        f"{format_bytes(est.memory_capacity_bytes)} per GPU "
        f"({'fits' if est.fits else '[red]does not fit[/red]'})",
        *_host_lines(est, config),
        *_experts_lines(config, plan),
        f"[bold]Precision[/bold] {est.precision or config.dtype}",
        f"[bold]Binding[/bold] {est.binding or 'n/a'}",
    ]


def _partition_lines(config: ParallelConfig, plan: Any | None) -> list[str]:
    """How a framework that cuts only some stage splits cuts the plan's (DeepSpeed's
    ``partition_method``, ``stage_splits.py``); nothing for the others."""
    from autopar.cost_model.frameworks import get_framework
    from autopar.export_base import plan_split_method

    framework = getattr(plan, "framework", "")
    if plan is None or config.pp <= 1 or get_framework(framework).stage_splits == "any":
        return []
    method = plan_split_method(plan, framework)
    if method is None:
        return []
    return [f"  stages cut by PipelineModule partition_method='{method}' (one layer per "
            "profile layer)"]


def _host_lines(est: Estimate, config: ParallelConfig) -> list[str]:
    """The host memory of the offloaded state and of checkpoints kept on the host
    (``Framework.checkpoint_offloaded``), when the plan keeps any there."""
    from autopar.cost_model.frameworks import get_framework

    if est.host_memory_per_gpu_bytes <= 0:
        return []
    held = [what for what, on in (
        ("offloaded state", config.offload != "none"),
        ("activation checkpoints", get_framework(est.framework).checkpoint_offloaded)) if on]
    fits = est.host_memory_per_gpu_bytes <= est.host_memory_capacity_bytes
    return [f"[bold]Host memory[/bold] {format_bytes(est.host_memory_per_gpu_bytes)} of "
            f"{format_bytes(est.host_memory_capacity_bytes)} per GPU ({' and '.join(held)}; "
            f"{'fits' if fits else '[red]does not fit[/red]'})"]


def _experts_lines(config: ParallelConfig, plan: Any | None) -> list[str]:
    """How the step was costed for a mixture of experts (the plan's ``moe``): the routing and
    the busiest expert-parallel rank's share of the routed rows, with where that figure comes
    from (cost_model/moe.py ``routed_imbalance``)."""
    moe = getattr(plan, "moe", None)
    if moe is None:
        return []
    from autopar.cost_model.framework_names import DEFAULT_FRAMEWORK
    from autopar.cost_model.framework_support import folds_experts
    from autopar.cost_model.frameworks import get_framework
    from autopar.cost_model.moe import routed_imbalance

    fw = get_framework(getattr(plan, "framework", DEFAULT_FRAMEWORK))
    head = f"[bold]Experts[/bold] {moe.experts} routed, top-{moe.top_k}"
    folded = ("; experts whole on each rank, each tp rank routing its own tokens (folded "
              "over tp: expert-tp-1)" if folds_experts(fw, config) else "")
    if moe.capacity_factor > 0:
        return [f"{head}, capacity factor {moe.capacity_factor:g}: every expert runs its padded "
                f"capacity{folded}"]
    if config.ep <= 1:
        return [f"{head}, dropless; no expert parallelism: each rank runs its own tokens' "
                f"experts, no router imbalance to pay{folded}"]
    why = ("the framework forces the router's balance" if fw.moe_force_balance
           else "the model's router_imbalance" if moe.router_imbalance
           else "the default: the model states no router_imbalance")
    return [f"{head}, dropless: the busiest of ep {config.ep} ranks takes "
            f"{routed_imbalance(moe, fw.moe_force_balance):.2f}x its share of routed rows "
            f"({why}){folded}"]


def _layer_text(ranges: Sequence[Sequence[int]]) -> str:
    """``0-12`` or ``0-5,24-29`` (interleaved chunks), then the layer count."""
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in ranges]
    return f"{','.join(parts)} ({sum(b - a + 1 for a, b in ranges)})"


def _table(title: str) -> Any:
    """A rich Table drawn with ASCII characters (logs, pasted transcripts)."""
    from rich import box
    from rich.table import Table

    return Table(title=title, title_justify="left", box=box.MARKDOWN, show_edge=False)


def stage_table(est: Estimate) -> Any:
    """Per pipeline rank: layers, parameters, memory by kind against capacity, time."""
    table = _table("Per pipeline rank (layers: profile layer indices, count)")
    table.add_column("rank", justify="right")
    table.add_column("layers")
    table.add_column("params", justify="right")
    for head, _ in TABLE_MEMORY_COLUMNS:
        table.add_column(head, justify="right")
    table.add_column("total / capacity", justify="right")
    table.add_column("time/mb", justify="right")
    for stage in est.stages:
        mem = stage.memory
        share = stage.memory_bytes / max(est.memory_capacity_bytes, 1.0)
        total = f"{format_bytes(stage.memory_bytes)} ({share * 100:.0f}%)"
        table.add_row(
            str(stage.rank),
            _layer_text(stage.layers),
            format_count(stage.num_params),
            *(format_bytes(sum(getattr(mem, field) for field in fields))
              for _, fields in TABLE_MEMORY_COLUMNS),
            f"[red]{total}[/red]" if share > 1 else total,
            format_time(stage.time_per_microbatch_s),
        )
    return table


def time_table(est: Estimate) -> Any:
    """The step time by term, with shares."""
    table = _table("Where the step time goes")
    table.add_column("term")
    table.add_column("time", justify="right")
    table.add_column("share", justify="right")
    step = max(est.step_time_s, 1e-30)
    for field, name in TIME_TERMS:
        value = getattr(est.time_breakdown, field)
        if field in ("ep_comm_s", "cp_comm_s") and not value:  # a dense model, ep or cp == 1
            continue
        table.add_row(name, format_time(value), f"{value / step * 100:.1f}%")
    table.add_row("[bold]step[/bold]", format_time(est.step_time_s), "100.0%")
    return table


def render_report(
    console: Any,
    config: ParallelConfig,
    est: Estimate,
    *,
    title: str = "",
    plan: Any | None = None,
    alternatives: Sequence[Alternative] = (),
    gpus_per_node: int | None = None,
) -> None:
    """Print the full report of one split to a rich console.

    Args:
        console: a ``rich.console.Console``.
        config: the split.
        est: its estimate.
        title: a first line (model and cluster).
        plan: the Plan when there is one (adds layer names and how the search went).
        alternatives: other splits to compare, best first.
        gpus_per_node: GPUs a node (to say when tp crosses nodes).
    """
    if title:
        console.print(f"[bold]{title}[/bold]")
    for line in _summary_lines(config, est, plan):
        console.print(line)
    console.print()
    if est.stages:
        console.print(stage_table(est))
        console.print()
    console.print(time_table(est))
    if alternatives:
        console.print()
        console.print("[bold]Alternatives[/bold]")
        for alt in alternatives:
            line = describe_alternative(alt, est, gpus_per_node=gpus_per_node)
            console.print(f"  - {line}", markup=False)
    search_line = _search_line(plan)
    if search_line:
        console.print()
        console.print(search_line)
