"""Per-stage counting of a section of blocks that repeat a few kinds (dense and MoE alternating).

Blocks of a few kinds in a fixed repeating order (Llama 4 Maverick: a dense block, then a
mixture-of-experts one, 24 times; gpt-oss: sliding-window and full attention alternating) break
the blocks into runs of one layer, and the per-stage ILP (``ilp_stages.py``) becomes the
per-layer assignment: tens of binaries per layer, slow to solve, and slower still to prove that a
candidate fits nowhere (a rank can hold one mixture-of-experts block but not two is a
pigeonhole argument, which binary assignment proves by enumeration). The section is counted by
kind instead, exactly: with period P, kinds kappa(o) of offsets o = 0..P-1, N layers,

    A[j]         section layers in stages 0..j = P q[j] + sum_o o w[j][o]
    q[j]         integer in [0, N // P];  w[j][o] binary, sum_o w[j][o] = 1;  A[j] <= N
    C[kappa][j]  kind-kappa layers in stages 0..j = c_kappa q[j] + sum_o pre_kappa(o) w[j][o]
    (monotone)   A[j] >= A[j-1]
    (count)      sum_r n[kappa][j][r] = C[kappa][j] - C[kappa][j-1]

where c_kappa is the kind's count in one period and pre_kappa(o) its count among the offsets
before o: a prefix of the section of length A holds exactly those layers of each kind, and every
A is one (q, w). The section is one unit of ``ilp_stages``' (order) constraints, with A as its Q.
Each kind's counts also get a per-rank cap from memory (count (static + in-flight activations)
<= room), integral where the LP relaxation would spread a kind over ranks fractionally.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pulp

from autopar.config import RECOMPUTE
from autopar.cost_model.held_counts import held_floor
from autopar.cost_model.tables import CostTable
from autopar.search.ilp_stages import (
    Unit,
    add_run_counts,
    cost_signature,
    plainest_mode,
    runs_between,
    stage_window,
)
from autopar.units import GIB

__all__ = ["MAX_PERIOD", "MIN_PERIODS", "Pattern", "add_kind_caps", "add_pattern_counts", "around",
           "find_pattern", "pattern_stages"]

R = range(len(RECOMPUTE))
MAX_PERIOD = 8  # a longer period is not "a few kinds repeating"
MIN_PERIODS = 3  # fewer repeats: per-layer counting is small enough


@dataclass(frozen=True, slots=True)
class Pattern:
    """A section of layers first..last whose kinds repeat with ``period``.

    Attributes:
        first: the section's first layer index.
        last: its last layer index.
        period: P, the smallest period.
        kind: the kind (0..K-1, in order of first appearance) of each offset 0..P-1.
        rep: the first layer of each kind (its cost terms stand for the kind's).
        key0: the ILP key of kind 0 (kinds take keys key0..key0+K-1, after the leading runs).
    """

    first: int
    last: int
    period: int
    kind: tuple[int, ...]
    rep: tuple[int, ...]
    key0: int = 0

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    def per_period(self, kappa: int) -> int:
        return self.kind.count(kappa)

    def before(self, kappa: int, offset: int) -> int:
        """Offsets before ``offset`` of kind ``kappa``."""
        return self.kind[:offset].count(kappa)

    def kind_at(self, position: int) -> int:
        """The kind of the section's layer ``position`` (0-based within the section)."""
        return self.kind[position % self.period]


def _longest_periodic(ids: list[int]) -> tuple[int, int, int] | None:
    """(first, last, period) of the longest section of at least two periods of 2..MAX_PERIOD
    layers (ties: the smaller period), or None."""
    best = None
    for p in range(2, MAX_PERIOD + 1):
        start = 0
        for i in range(len(ids) - p + 1):
            if i < len(ids) - p and ids[i] == ids[i + p]:
                continue
            first, last = start, i + p - 1  # a maximal run of matches start..i-1
            start = i + 1
            if last - first + 1 >= 2 * p and (best is None or last - first > best[1] - best[0]):
                best = (first, last, p)
    return best


def find_pattern(table: CostTable) -> Pattern | None:
    """The repeating section to count by kind, or None where plain runs serve: at least
    ``MIN_PERIODS`` periods of 2..``MAX_PERIOD`` layers of at least 2 kinds, in runs shorter
    than the period (kinds that interleave)."""
    if table.config.num_stages == 1:
        return None
    names: dict[tuple, int] = {}
    ids = [names.setdefault(cost_signature(x), len(names)) for x in table.layers]
    found = _longest_periodic(ids)
    if found is None:
        return None
    first, last, period = found
    period = min(d for d in range(1, period + 1) if period % d == 0 and all(
        ids[i] == ids[i + d] for i in range(first, last - d + 1)))
    kinds: dict[int, int] = {}
    kind = tuple(kinds.setdefault(ids[first + o], len(kinds)) for o in range(period))
    size = last - first + 1
    if len(kinds) < 2 or size < MIN_PERIODS * period:
        return None
    rep = tuple(first + kind.index(k) for k in range(len(kinds)))
    return Pattern(first=first, last=last, period=period, kind=kind, rep=rep)


def _section(prob: pulp.LpProblem, pat: Pattern, lo: int, hi: int, s: int, var: Callable):
    """A[j] and C[kappa][j] for j = -1..s-1 (fixed outside the window lo..hi)."""
    big_n, p = pat.size, pat.period
    kinds = range(len(pat.rep))
    a: dict[int, Any] = {}
    c: dict[int, dict[int, Any]] = {k: {} for k in kinds}
    totals = [sum(1 for i in range(big_n) if pat.kind_at(i) == k) for k in kinds]
    for j in range(-1, s):
        if j < lo or j >= hi:
            a[j] = 0 if j < lo else big_n
            for k in kinds:
                c[k][j] = 0 if j < lo else totals[k]
            continue
        q = var(prob, f"periods[{j}]", 0, big_n // p, "Integer")
        w = [var(prob, f"offset[{j}][{o}]", 0, 1, "Binary") for o in range(p)]
        prob += pulp.lpSum(w) == 1, f"one_offset[{j}]"
        a[j] = p * q + pulp.lpSum(o * w[o] for o in range(p))
        prob += a[j] <= big_n, f"in_section[{j}]"
        for k in kinds:
            c[k][j] = pat.per_period(k) * q + pulp.lpSum(
                pat.before(k, o) * w[o] for o in range(p) if pat.before(k, o))
    for j in range(max(lo, 0), hi + 1):
        # [Constraint] monotone: the section's prefix grows stage by stage
        prob += a[j] >= a[j - 1], f"monotone[{j}]"
    return a, c


def around(table: CostTable, pat: Pattern) -> tuple[tuple, tuple, Pattern]:
    """(the runs before the section, the runs after it, the pattern with its kinds' first key
    after the leading runs)."""
    num_layers = len(table.layers)
    lead = runs_between(table, 0, pat.first - 1) if pat.first > 0 else ()
    trail = runs_between(table, pat.last + 1, num_layers - 1) if pat.last < num_layers - 1 else ()
    return lead, trail, dataclasses.replace(pat, key0=len(lead))


def add_pattern_counts(prob: pulp.LpProblem, table: CostTable, pat: Pattern, s: int,
                       var: Callable, n: dict, cnt: dict) -> tuple[list[Unit], tuple, Pattern]:
    """The leading runs, the section by kind and the trailing runs; fills ``n`` and ``cnt``.

    Returns the order units, the keys' (first, last) layers as the ILP prices them (a kind's
    first layer for each kind) and the pattern with its kinds' first key."""
    lead, trail, pat = around(table, pat)
    units = add_run_counts(prob, table, lead, s, var, n, cnt)
    lo, hi = stage_window(pat.first, pat.last, len(table.layers), s)
    a, c = _section(prob, pat, lo, hi, s, var)
    for k, rep in enumerate(pat.rep):
        g, name = pat.key0 + k, table.names[rep]
        for j in range(s):
            cnt[g, j] = c[k][j] - c[k][j - 1]
        for j in range(lo, hi + 1):
            for r in R:
                n[g, j, r] = var(prob, f"n[{name}*][{j}][{RECOMPUTE[r]}]", 0, pat.size, "Integer")
            # [Constraint] count: a kind's layers in stage j, split by recompute mode
            prob += pulp.lpSum(n[g, j, r] for r in R) == cnt[g, j], f"one_stage[{name}*][{j}]"
    units.append((f"section@{pat.first}", pat.size, a))
    units += add_run_counts(prob, table, trail, s, var, n, cnt, key0=pat.key0 + len(pat.rep))
    keys = (*lead, *((rep, rep) for rep in pat.rep), *trail)
    return units, keys, pat


def add_kind_caps(prob: pulp.LpProblem, table: CostTable, pat: Pattern, n: dict,
                  slot_rank, room_gib: float) -> None:
    """Per rank and kind: count <= floor(room / the kind's least static + in-flight memory)."""
    cfg = table.config
    for k in range(cfg.pp):
        flight = held_floor(cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches, k)
        for kappa, rep in enumerate(pat.rep):
            lay, g = table.layers[rep], pat.key0 + kappa
            least = min(lay.static_bytes + flight * lay.act_bytes[r] for r in R) / GIB
            terms = [v for (gg, j, _r), v in sorted(n.items()) if gg == g and slot_rank[j] == k]
            if least > 0 and terms:
                cap = math.floor(max(room_gib, 0.0) / least)
                # [Constraint] kind_cap: a rank holds at most what fits of one kind alone
                prob += pulp.lpSum(terms) <= cap, f"kind_cap[{table.names[rep]}][rank{k}]"


def pattern_stages(table: CostTable, keys, pat: Pattern, counts: dict,
                   s: int) -> tuple[tuple[tuple[int, int], ...], tuple[str, ...]]:
    """(stage layer ranges, per-layer recompute) of a solution counted by kind: a stage's section
    layers, in their order, take their kind's modes in the order none, selective, full."""
    stages, recompute, start, position = [], [], 0, 0
    kinds = range(pat.key0, pat.key0 + len(pat.rep))
    for j in range(s):
        size = 0
        for g in range(len(keys)):
            if g == pat.key0:
                pools = {kk: [r for r in R for _ in range(counts.get((kk, j, r), 0))]
                         for kk in kinds}
                taken = sum(len(pool) for pool in pools.values())
                for i in range(position, position + taken):
                    kk = pat.key0 + pat.kind_at(i)
                    r = pools[kk].pop(0)
                    recompute.append(RECOMPUTE[plainest_mode(table.layers[pat.first + i], r)])
                position += taken
                size += taken
            elif g not in kinds:
                for r in R:
                    k = counts.get((g, j, r), 0)
                    recompute.extend(
                        [RECOMPUTE[plainest_mode(table.layers[keys[g][0]], r)]] * k)
                    size += k
        stages.append((start, start + size - 1))
        start += size
    return tuple(stages), tuple(recompute)
