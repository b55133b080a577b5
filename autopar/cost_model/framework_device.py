"""A cluster as a training framework drives it: ``framework_cluster`` (its kernels' efficiency
and traffic, its parameter traffic and overlap, from its ``Framework`` record)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from autopar.cost_model.hardware import Cluster

if TYPE_CHECKING:
    from autopar.cost_model.frameworks import Framework

__all__ = ["framework_cluster"]


def framework_cluster(cluster: Cluster, framework: Framework) -> Cluster:
    """The cluster as ``framework`` drives it: its kernels' efficiency and traffic, its
    parameter traffic and overlap where the record sets them (None keeps the cluster's)."""
    fw = framework
    device = dataclasses.replace(
        cluster.device,
        matmul_efficiency_max=min(1.0, cluster.device.matmul_efficiency_max
                                  * fw.kernel_efficiency),
        elementwise_traffic_factor=cluster.device.elementwise_traffic_factor
        * fw.elementwise_traffic_scale,
    )
    changes: dict[str, object] = {"device": device}
    if fw.param_traffic_factor is not None:
        changes["param_traffic_factor"] = fw.param_traffic_factor
    if fw.dp_overlap_efficiency is not None:
        changes["dp_overlap_efficiency"] = fw.dp_overlap_efficiency
    if device == cluster.device and len(changes) == 1:
        return cluster
    return dataclasses.replace(cluster, **changes)  # type: ignore[arg-type]
