"""Checks and builders that several test modules share (one home each).

Import as ``from tests.helpers import ...`` (the repository root is on ``sys.path`` under pytest).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopar.cost_model.hardware import Cluster


def one_error_line(code: int, out: str, err: str, needle: str = "") -> str:
    """The one ``autopar: error:`` line of a refused command, checked.

    A refusal exits 2, prints nothing on stdout, no traceback, and exactly one line on stderr that
    starts with ``autopar: error: `` and contains ``needle``. Pass ``code`` and the captured
    streams: ``one_error_line(main(argv), *capfd.readouterr(), needle)``, or a subprocess's
    ``returncode, stdout, stderr``.
    """
    assert code == 2, err[-3000:]
    assert out == "" and "Traceback" not in err, err[-3000:]
    lines = err.splitlines()  # a blank line before the error counts: wrappers read line 1
    assert len(lines) == 1 and lines[0].startswith("autopar: error: "), err[-3000:]
    assert needle in lines[0], lines[0]
    return lines[0]


def case_errors(label: str, per_rank: list[dict[str, Any]], every_fqn: set[str]) -> list[str]:
    """What is wrong with one distributed case's per-rank results (none: an empty list).

    Each rank reports ``{"fqns": [...], "losses": [...]}`` (the parameters whose gradients it
    checked against the one-process reference) or ``{"error": traceback}``. Wrong: a rank's
    error; a parameter of ``every_fqn`` that no rank checked; ranks that report different losses.
    """
    errors = [f"[{label}] rank {i}: {r['error']}" for i, r in enumerate(per_rank) if "error" in r]
    if errors:
        return errors
    covered = set().union(*(r["fqns"] for r in per_rank))
    if covered != every_fqn:
        errors.append(f"[{label}] gradients not checked for {sorted(every_fqn - covered)}")
    if len({tuple(r["losses"]) for r in per_rank}) != 1:
        errors.append(f"[{label}] ranks report different losses")
    return errors


def with_link_bandwidth_scaled(cluster: Cluster, scale: float) -> Cluster:
    """``cluster`` with both its links' bandwidths multiplied by ``scale`` (latencies kept)."""
    from autopar.cost_model.hardware import Cluster

    data = cluster.to_dict()
    for link in ("intra_node", "inter_node"):
        data[link]["bandwidth_bytes_per_s"] *= scale
    return Cluster.from_dict(data)


def write_cpu_plan(model: str, path: Path, **config: Any) -> Path:
    """Write the plan of zoo ``model`` at ``config`` (ParallelConfig fields) on a CPU cluster of
    one gloo process per rank (the config's world size) to ``path``; returns ``path``."""
    import autopar
    from autopar.cost_model.hardware import Cluster
    from autopar.runtime.worker import build_model
    from autopar.search.planner import plan_from_config

    profile = autopar.profile(build_model(model, device="meta"))
    parallel = autopar.ParallelConfig(**config)
    cluster = Cluster.preset("cpu", gpus_per_node=parallel.world_size)
    path.write_text(plan_from_config(profile, cluster, parallel, model=model).to_json())
    return path


def with_counts(results: dict[str, Any], counts: Iterable[tuple[str, Callable[[], Any]]],
                ) -> dict[str, Any]:
    """A distributed case's ``results`` with each ``count()`` under ``"count:{name}"`` (its
    traceback instead when it raises), so one launch carries equivalence cases and counts."""
    for name, count in counts:
        try:
            results[f"count:{name}"] = count()
        except Exception:
            results[f"count:{name}"] = {"error": traceback.format_exc(limit=8)}
    return results


def count_mismatches(results: list[dict[str, Any]], name: str, want: Any, what: str) -> list[str]:
    """One line per rank whose measured ``"count:{name}"`` is not ``want`` (``what`` names
    where ``want`` comes from)."""
    return [f"[{name}] rank {rank}: measured {per_rank[f'count:{name}']} != {what} {want}"
            for rank, per_rank in enumerate(results) if per_rank[f"count:{name}"] != want]
