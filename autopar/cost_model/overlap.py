"""Communication that overlaps compute: what it adds to a step.

One rule, shared by the per-layer terms (layer_costs.py), the step assembly (assemble.py) and the
search's ILP (search/ilp.py), which encodes the same max of linear terms.
"""

from __future__ import annotations

__all__ = ["overlapped_s"]


def overlapped_s(comm_s: float, window_s: float, slowdown: float) -> float:
    """Step time that ``comm_s`` of communication adds when ``window_s`` of compute can hide it.

    What the window cannot hide is exposed; what it hides still slows the compute it overlaps
    by ``slowdown`` per second (NCCL kernels take SMs and memory bandwidth):

        (comm - window)+ + slowdown * min(comm, window) = max(slowdown * comm,
                                                              comm - (1 - slowdown) * window)

    (the right side is a max of linear terms, which the search's ILP encodes exactly).
    """
    if comm_s <= 0:
        return 0.0
    return max(slowdown * comm_s, comm_s - (1.0 - slowdown) * window_s)
