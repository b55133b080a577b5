"""Per-stage counting for the split ILP: layer runs, their cumulative counts and contiguity.

Consecutive layers with identical cost terms form runs g = 0..G-1 (length L_g; in a transformer:
the embedding, the L identical blocks, the head). Layers of one run are interchangeable inside a
stage (assemble only sums them and takes a max), so the ILP counts them:

    Q[g][j]    integer in [0, L_g]: run-g layers in stages 0..j  (Q[g][S-1] = L_g, Q[g][-1] = 0)
    n[g][j][r] integer >= 0: run-g layers of stage j with recompute r
    f[g][j]    binary: run g is complete by the end of stage j (run g+1 may start)

    (count)     sum_r n[g][j][r] = Q[g][j] - Q[g][j-1]            (Q non-decreasing in j)
    (order)     Q[g][j] >= L_g f[g][j];  Q[g+1][j] <= L_{g+1} f[g][j]   (stages are contiguous)
    (nonempty)  sum_g (Q[g][j] - Q[g][j-1]) >= 1

With every run of length 1 this is the per-layer binary assignment z[i][j][r]. A layer i can only
sit in stages max(0, i - (n - S)) .. min(i, S - 1), which fixes most Q outside that window.
``ilp_pattern.py`` counts a section of blocks that repeat a few kinds the same way, one unit of
the order above.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import pulp

from autopar.config import RECOMPUTE
from autopar.cost_model.tables import CostTable, LayerCost

__all__ = ["Unit", "add_nonempty", "add_order", "add_run_counts", "cost_signature", "layer_runs",
           "new_var", "plainest_mode", "runs_between", "stage_window"]

R = range(len(RECOMPUTE))

_SIGNATURE = operator.attrgetter(
    "compute_s", "backward_s", "recompute_s", "tp_comm_s", "ep_comm_s", "dp_microbatch_s",
    "act_bytes", "transient_bytes", "param_bytes", "grad_bytes", "optimizer_bytes", "dp_step_s",
    "optimizer_s", "cp_comm_s", "host_bytes",
)

# One unit of the stage order: its name, its layer count, and Q[j] for j = -1..S-1 (the layers
# of the unit in stages 0..j: an int where fixed, else a pulp expression).
Unit = tuple[str, int, dict[int, Any]]


def cost_signature(layer: LayerCost) -> tuple:
    """Every term assemble's step time and memory read; equal signatures are interchangeable."""
    return _SIGNATURE(layer)


def runs_between(table: CostTable, first: int, last: int) -> tuple[tuple[int, int], ...]:
    """(first, last) layer index of each maximal run of identical layers in first..last (a
    repeated block's positions hold one shared LayerCost: identical without a comparison)."""
    runs: list[tuple[int, int]] = []
    previous, previous_layer = None, None
    for i in range(first, last + 1):
        layer = table.layers[i]
        if runs and layer is previous_layer:
            runs[-1] = (runs[-1][0], i)
            continue
        signature = _SIGNATURE(layer)
        if runs and signature == previous:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
        previous, previous_layer = signature, layer
    return tuple(runs)


def layer_runs(table: CostTable) -> tuple[tuple[int, int], ...]:
    """(first, last) layer index of each maximal run of layers with identical cost terms."""
    return runs_between(table, 0, len(table.layers) - 1)


def stage_window(first: int, last: int, n: int, s: int) -> tuple[int, int]:
    """Stages a run spanning layers first..last can touch (each stage holds >= 1 layer)."""
    return max(0, first - (n - s)), min(s - 1, last)


def new_var(prob: pulp.LpProblem, name: str, lo=None, hi=None, cat: str = "Continuous"):
    """A variable attached to ``prob`` (pulp >= 3.3 API; plain LpVariable before)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lo, hi, cat=cat)
    return pulp.LpVariable(name, lo, hi, cat)


def _const(x: object, value: int) -> bool:
    """Whether a Q entry is the fixed integer ``value`` (not a variable)."""
    return isinstance(x, int) and x == value


def add_run_counts(prob: pulp.LpProblem, table: CostTable, runs, s: int, var: Callable,
                   n: dict, cnt: dict, key0: int = 0) -> list[Unit]:
    """Q and n of each run (keys key0, key0 + 1, ...) and its (count) constraints; fills ``n``
    and ``cnt`` (stage j's layers of the run) and returns the runs as order units."""
    num_layers, units = len(table.layers), []
    for offset, (a, b) in enumerate(runs):
        g, name = key0 + offset, table.names[a]
        size, (lo, hi) = b - a + 1, stage_window(a, b, num_layers, s)
        q: dict[int, Any] = {}
        for j in range(-1, s):
            q[j] = 0 if j < lo else size if j >= hi else var(prob, f"Q[{name}][{j}]", 0, size,
                                                              "Integer")
        for j in range(s):
            cnt[g, j] = q[j] - q[j - 1]
        for j in range(lo, hi + 1):
            for r in R:
                n[g, j, r] = var(prob, f"n[{name}][{j}][{RECOMPUTE[r]}]", 0, size, "Integer")
            # [Constraint] count: a run's layers in stage j, split by recompute mode
            prob += pulp.lpSum(n[g, j, r] for r in R) == cnt[g, j], f"one_stage[{name}][{j}]"
        units.append((name, size, q))
    return units


def add_order(prob: pulp.LpProblem, units: Sequence[Unit], s: int, var: Callable) -> None:
    """(order): unit u+1 starts in a stage only once unit u is complete (contiguity)."""
    for (name, size, q), (_next, size_next, q_next) in itertools.pairwise(units):
        for j in range(s - 1):
            if _const(q_next[j], 0) or _const(q[j], size):
                continue
            f = var(prob, f"f[{name}][{j}]", 0, 1, "Binary")
            prob += q[j] >= size * f, f"done[{name}][{j}]"
            prob += q_next[j] <= size_next * f, f"after[{name}][{j}]"


def add_nonempty(prob: pulp.LpProblem, cnt: dict, s: int) -> None:
    """(nonempty): every stage holds at least one layer."""
    keys = sorted({g for g, _j in cnt})
    for j in range(s):
        prob += pulp.lpSum(cnt[g, j] for g in keys) >= 1, f"nonempty[stage{j}]"


def plainest_mode(layer: LayerCost, r: int) -> int:
    """The first mode (none, selective, full) whose time and memory terms equal mode r's.

    A layer without activations to drop (the embedding) costs the same under every mode; the
    plan then says "none" rather than whichever mode the solver happened to pick.
    """

    def terms(x: int) -> tuple:
        return (layer.time_per_microbatch_s(RECOMPUTE[x]), layer.act_bytes[x],
                layer.transient_bytes[x])  # fmt: skip

    return next(x for x in R if terms(x) == terms(r))
