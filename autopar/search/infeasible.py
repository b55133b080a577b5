"""What to tell a user whose model fits no split: the least memory any split needs, and where.

For every candidate (best memory bound first) the ILP is solved with the largest rank's memory
as its objective; the search stops once the next candidate's memory bound cannot beat the best
found, so ``min_memory_bytes`` is the smallest per-GPU peak over the whole space (unless a time
budget ended the search first). A candidate whose offloaded state overflows the host whatever its
split is solved only while it could still be the closest host overflow (named when nothing else
is left): an offloading search of a model far too large for its cluster solves a handful of
ILPs, not one per offload variant.
"""

from __future__ import annotations

import dataclasses
import time

from autopar.config import RECOMPUTE
from autopar.cost_model.assemble import assemble
from autopar.errors import InfeasiblePlanError
from autopar.search.ilp import build_ilp, decode, solve_ilp
from autopar.search.options import SearchOptions
from autopar.units import GIB, format_bytes

__all__ = ["closest_split", "infeasible_error", "no_split_error"]



def closest_split(cands, options: SearchOptions, deadline) -> tuple[float, str]:
    """Smallest largest-rank memory any candidate reaches (memory ILPs, best bound first),
    among those whose host memory fits (an offloaded split that overflows the host is named
    only when nothing else is left, with its host memory)."""
    best_mem, best_desc = float("inf"), ""
    host_mem, host_desc = float("inf"), ""
    for cand in sorted(cands, key=lambda c: (c.memory_lb_bytes, c.index)):
        if cand.memory_lb_bytes >= best_mem:
            break
        if deadline is not None and time.monotonic() > deadline and (best_desc or host_desc):
            break
        if cand.memory_lb_bytes >= host_mem and _overflows_host(cand.table):
            continue  # it can only name a host overflow, and cannot beat the one found
        model = build_ilp(cand.table, objective="memory")
        sol = solve_ilp(model, options)
        if not sol.has_solution:
            continue
        split, rec = decode(model, sol)
        est = assemble(cand.table, split, rec)
        mem = est.memory_per_gpu_bytes
        sizes = "/".join(str(b - a + 1) for a, b in split)
        modes = sorted(set(rec), key=RECOMPUTE.index)
        desc = (f"{cand.table.config.describe()} with stages of {sizes} layers and "
                f"recompute {'+'.join(modes)}")
        if est.host_memory_per_gpu_bytes > est.host_memory_capacity_bytes:
            if mem < host_mem:
                host_mem, host_desc = mem, (
                    f"{desc} (and {est.host_memory_per_gpu_bytes / GIB:.1f} GiB of host memory "
                    f"per GPU, {est.host_memory_capacity_bytes / GIB:.1f} GiB there)")
        elif mem < best_mem:
            best_mem, best_desc = mem, desc
    return (best_mem, best_desc) if best_desc else (host_mem, host_desc)


def _overflows_host(table) -> bool:
    """Whether every split of ``table`` overflows the host: some pipeline rank holds at least
    ``1 / pp`` of the offloaded state, and the rank with the largest layer at least that."""
    host = [layer.host_bytes for layer in table.layers]
    return max(sum(host) / table.config.pp, max(host, default=0.0)) > table.host_capacity_bytes


def infeasible_error(
    profile, cluster, cands, options, deadline, global_batch
) -> InfeasiblePlanError:
    """The error for a model no candidate fits: the least memory any split needs, and where."""
    cap = min((c.table.capacity_bytes for c in cands), default=cluster.usable_memory_bytes)
    mem, desc = closest_split(cands, options, deadline)
    return InfeasiblePlanError(
        f"no split of {profile.name or 'the model'} ({profile.num_params / 1e9:.2f}B params) "
        f"fits {format_bytes(cap)} usable per GPU on {cluster.num_gpus} GPUs at global batch "
        f"{global_batch}; the closest, {desc}, needs {format_bytes(mem)} per GPU: use more GPUs, "
        f"GPUs with more memory, or a smaller micro-batch{_cp_hint(profile, options)}",
        min_memory_bytes=mem,
        closest=desc,
    )


def _cp_hint(profile, options: SearchOptions) -> str:
    """Where the framework runs no context parallelism for this model and the sequence is long
    enough for it, say which frameworks would shard each sequence."""
    from autopar.cost_model.framework_support import cp_runs_on
    from autopar.cost_model.frameworks import FRAMEWORKS, get_framework

    def shards(name: str) -> bool:
        fw = get_framework(name)
        return fw.context_parallel and cp_runs_on(fw, profile)

    if shards(options.framework) or profile.seq_len < 2 * options.min_cp_tokens:
        return ""
    runs = [name for name in FRAMEWORKS if shards(name)]
    return (f", or shard each {profile.seq_len}-token sequence with context parallelism "
            f"(--framework {' or '.join(runs)})")


def no_split_error(profile, cluster, global_batch: int, options: SearchOptions,
                   candidates) -> ValueError:
    """Why no candidate exists: the search options that narrowed it (each one whose default
    alone brings candidates back; ``candidates(options)`` lists a space's), else the batch, the
    GPU count, the heads and the layers."""
    whole = SearchOptions(framework=options.framework)
    changed = [f.name for f in dataclasses.fields(options)
               if getattr(options, f.name) != getattr(whole, f.name)]
    if changed and candidates(whole):
        narrowing = [name for name in changed if candidates(
            dataclasses.replace(options, **{name: getattr(whole, name)}))] or changed
        shown = ", ".join(f"{name}={getattr(options, name)!r}" for name in narrowing)
        return ValueError(f"the search options leave no split of {cluster.num_gpus} GPUs at "
                          f"global_batch {global_batch} ({shown}): widen them")
    return ValueError(
        f"no (dp, tp, pp) split of {cluster.num_gpus} GPUs fits global_batch {global_batch} "
        f"and the model's heads ({profile.heads}/{profile.kv_heads} kv) and layers: pick a "
        f"global batch that is a multiple of {cluster.num_gpus} (one replica a GPU), or "
        "another GPU count"
    )
