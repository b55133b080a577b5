"""Plan: a split of a model over a cluster, as data (JSON round-trip, fingerprints).

A Plan is the ParallelConfig plus what the search decided per layer: the contiguous layer range
of every pipeline stage (model chunk), each layer's recomputation, and the tensor-parallel layout
(module FQN -> torch ParallelStyle name). It records the Estimate that justified it and
fingerprints of the model profile and the cluster it was made for. Exporters to other tools'
formats live in ``autopar/exporters.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import reprlib
from dataclasses import dataclass, field
from typing import Any

from autopar.config import LOSS_KERNELS, MAX_SEQ_LEN, RECOMPUTE, ParallelConfig
from autopar.cost_model.estimate import Estimate
from autopar.cost_model.framework_names import DEFAULT_FRAMEWORK, FRAMEWORKS
from autopar.cost_model.frameworks import get_framework
from autopar.errors import ClusterConfigError, PlanMismatchError
from autopar.graph.types import MoEStructure
from autopar.plan_read import (
    PlanFieldError,
    check_estimate,
    cluster_size,
    estimate_doc,
    estimate_stages_problem,
    layer_names_problem,
    moe_doc,
    search_fields,
    text,
    text_map,
    texts,
    whole,
    whole_pair,
)
from autopar.schedules import rank_of_stage
from autopar.tp_layout import TPStyle

__all__ = ["SCHEMA_VERSION", "Plan", "PlanFormatError", "SearchInfo", "StagePlan", "TPStyle",
           "reject_constant"]

SCHEMA_VERSION = 1


class PlanFormatError(ValueError):
    """A plan document that cannot be read (bad JSON, wrong schema version, inconsistent)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePlan:
    """One pipeline stage (model chunk).

    Attributes:
        index: stage index in model order (0 .. pp * virtual_stages - 1). The stage runs on
            pipeline rank ``index % pp`` (torch's interleaved placement; V-shaped schedules place
            stages ``r`` and ``2*pp-1-r`` on rank ``r``, see ``Plan.rank_of_stage``).
        layers: (first, last) profile-layer index, inclusive.
        layer_names: the profile layer names in the range (e.g. "embedding", "layers.0").
        recompute: per layer in the range: "none" | "selective" | "full".
    """

    index: int
    layers: tuple[int, int]
    layer_names: tuple[str, ...]
    recompute: tuple[str, ...]

    def __post_init__(self) -> None:
        first, last = self.layers
        if first > last or first < 0:
            raise PlanFormatError(f"stage {self.index}: bad layer range {self.layers}")
        n = last - first + 1
        if len(self.recompute) != n or len(self.layer_names) != n:
            raise PlanFormatError(
                f"stage {self.index}: {n} layers but {len(self.recompute)} recompute entries "
                f"and {len(self.layer_names)} names"
            )
        for r in self.recompute:
            if r not in RECOMPUTE:
                raise PlanFormatError(f"stage {self.index}: unknown recompute {r!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "index": self.index,
            "layers": list(self.layers),
            "layer_names": list(self.layer_names),
            "recompute": list(self.recompute),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StagePlan:
        """Inverse of ``to_dict``."""
        where = f"stages[{data.get('index', '?')}]" if isinstance(data, dict) else "stage"
        if not isinstance(data, dict):
            raise PlanFieldError(f"plan {where} must be an object, got {reprlib.repr(data)}")
        _no_unknown_keys(data, _STAGE_KEYS, f"plan {where}")
        return cls(
            index=whole(data["index"], f"{where}.index"),
            layers=whole_pair(data["layers"], f"{where}.layers"),
            layer_names=texts(data["layer_names"], f"{where}.layer_names"),
            recompute=texts(data["recompute"], f"{where}.recompute"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchInfo:
    """How the search found the plan (deterministic fields only; no wall-clock times).

    Attributes:
        candidates_considered: outer candidates (dp, tp, pp, micro-batch, schedule, ...) seen.
        candidates_pruned: discarded by bounds or infeasibility before an ILP.
        ilps_solved: ILPs solved.
        optimal: every ILP that produced this plan was solved to proven optimality (within gap).
        mip_gap: relative gap of the ILP that produced this plan (0 when proven optimal).
        time_limit_hit: a time limit stopped a solve or the search.
    """

    candidates_considered: int = 0
    candidates_pruned: int = 0
    ilps_solved: int = 0
    optimal: bool = True
    mip_gap: float = 0.0
    time_limit_hit: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A complete split of one model over one cluster.

    Attributes:
        config: the ParallelConfig (``config.recompute`` is the most common per-layer choice).
        stages: pp * virtual_stages stages (1 when pp == 1) covering every profile layer in order.
        tp_layout: module FQN (fnmatch patterns allowed, e.g. "layers.*.attention.wq") -> TPStyle
            value; empty when tp == 1.
        estimate: what the cost model predicts for exactly this plan.
        profile_fingerprint: ModelProfile.fingerprint() of the model it was made for.
        cluster_fingerprint: Cluster.fingerprint() of the cluster it was made for.
        model: how to rebuild the model (zoo name, "gpt:layers=...", path); "" if unknown.
        seq_len: tokens per sequence the model was profiled at (0 if unknown).
        cluster: the cluster as a dict (Cluster.to_dict()), so a plan is self-contained.
        search: how the search found the plan.
        framework: the training framework the plan is made for (``FRAMEWORKS``).
        moe: the model's mixture of experts (its first MoE layer's record), None for a dense
            model; the exports need it (experts, top-k). JSON key ``moe``, absent when None.
        loss: the token cross-entropy kernel the model was profiled with (``LOSS_KERNELS``:
            "eager" or "fused"); JSON key ``loss``, absent for "eager".
        schema_version: the plan JSON schema version.
    """

    config: ParallelConfig
    stages: tuple[StagePlan, ...]
    tp_layout: dict[str, str] = field(default_factory=dict)
    estimate: Estimate
    profile_fingerprint: str = ""
    cluster_fingerprint: str = ""
    model: str = ""
    seq_len: int = 0
    cluster: dict[str, Any] = field(default_factory=dict)
    search: SearchInfo = field(default_factory=SearchInfo)
    framework: str = DEFAULT_FRAMEWORK
    schema_version: int = SCHEMA_VERSION
    moe: MoEStructure | None = None
    loss: str = "eager"

    def __post_init__(self) -> None:
        # What a plan file's reader checks, checked when a plan is made too: a plan autopar
        # writes, autopar reads back.
        _check_parts(self)
        # The plan owns its dicts: a caller's later edits of what it passed in do not reach it.
        object.__setattr__(self, "cluster", copy.deepcopy(self.cluster))
        object.__setattr__(self, "tp_layout", dict(self.tp_layout))
        known: str | None = None
        try:
            if isinstance(self.framework, str):
                known = get_framework(self.framework).spec
        except ValueError:
            pass
        if known is None:
            raise PlanFormatError(
                f"plan framework {self.framework!r} is unknown; use one of {', '.join(FRAMEWORKS)}"
                " (with its settings as name+setting+...)"
            )
        object.__setattr__(self, "framework", known)  # its canonical spelling (settings sorted)
        _check_world(self.config, self.cluster)
        expected = self.config.num_stages
        if len(self.stages) != expected:
            raise PlanFormatError(
                f"plan has {len(self.stages)} stages but pp * virtual_stages = {expected}"
            )
        next_layer = 0
        for i, stage in enumerate(self.stages):
            if stage.index != i:
                raise PlanFormatError(f"stage {i} has index {stage.index}; stages must be in order")
            if stage.layers[0] != next_layer:
                raise PlanFormatError(
                    f"stage {i} starts at layer {stage.layers[0]}, expected {next_layer}: every "
                    "layer must be in exactly one stage, in order"
                )
            next_layer = stage.layers[1] + 1
        problem = layer_names_problem([n for stage in self.stages for n in stage.layer_names])
        if problem:
            raise PlanFormatError(f"{problem}; re-create the plan with `autopar plan`")
        valid_styles = {s.value for s in TPStyle}
        for fqn, style in self.tp_layout.items():
            if style not in valid_styles:
                raise PlanFormatError(
                    f"tp_layout[{fqn!r}] = {style!r} is not one of {valid_styles}"
                )

    # ----------------------------------------------------------------------------- queries
    @property
    def num_layers(self) -> int:
        """Profile layers covered by the plan."""
        return self.stages[-1].layers[1] + 1

    @property
    def recompute_per_layer(self) -> tuple[str, ...]:
        """Recompute choice of every profile layer, in order."""
        return tuple(r for s in self.stages for r in s.recompute)

    def rank_of_stage(self, stage_index: int) -> int:
        """Pipeline rank that runs ``stage_index`` (see ``autopar.schedules.rank_of_stage``)."""
        return rank_of_stage(self.config.schedule, self.config.pp, stage_index)

    def stages_for_rank(self, pp_rank: int) -> tuple[StagePlan, ...]:
        """The stages a pipeline rank runs, in model order."""
        return tuple(s for s in self.stages if self.rank_of_stage(s.index) == pp_rank)

    # ----------------------------------------------------------------------------- cluster
    def cluster_mismatch(self, cluster: Any) -> str | None:
        """Why ``cluster`` is not the one the plan was made for (None when it is, or when the
        plan records no cluster fingerprint: a hand-made plan).

        Args:
            cluster: a ``Cluster`` (anything with ``fingerprint()`` and ``to_dict()``).
        """
        if not self.cluster_fingerprint or cluster.fingerprint() == self.cluster_fingerprint:
            return None
        other = cluster.to_dict()
        changed = _changed_fields(self.cluster, other) if self.cluster else []
        shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more"
                                           if len(changed) > 4 else "")
        return (f"the plan was made for cluster {self.cluster.get('name', '?')!s} (fingerprint "
                f"{self.cluster_fingerprint}) but is estimated on cluster "
                f"{other.get('name', '?')!s} (fingerprint {cluster.fingerprint()})"
                + (f", which differs in {shown}" if changed else "")
                + "; re-plan for that cluster with `autopar plan`, or estimate this split there "
                "with plan.for_cluster(cluster)")

    def check_cluster(self, cluster: Any) -> None:
        """Raise ``PlanMismatchError`` (a ValueError) when ``cluster`` is not the plan's own."""
        reason = self.cluster_mismatch(cluster)
        if reason:
            raise PlanMismatchError(reason)

    def check_profile(self, profile: Any, fix: str = "") -> None:
        """Raise ``PlanMismatchError`` (a ValueError) when ``profile`` is not the one the plan was
        made for (its profile fingerprint, a hash of the whole profile: the model, seq_len, dtype
        and loss, and how the profiler counted); a plan that records no fingerprint (made by
        hand) is taken as it is. ``fix``: the advice to end the message with."""
        if not self.profile_matches(profile):
            raise PlanMismatchError(
                f"the plan was made for another model or profile (fingerprint "
                f"{self.profile_fingerprint}; this one's is {profile.fingerprint()}: another "
                "model, seq_len, dtype or loss, or another profiler's count); "
                + (fix or "profile the model it was made for as it was, re-target the plan on "
                   "purpose with plan.for_profile(profile), or re-plan with autopar.plan"))

    def profile_matches(self, profile: Any) -> bool:
        """Whether ``profile`` is the one the plan was made for (``check_profile``'s rule)."""
        return not self.profile_fingerprint or profile.fingerprint() == self.profile_fingerprint

    def for_profile(self, profile: Any) -> Plan:
        """The same split, re-targeted at ``profile`` (its fingerprint recorded), so that
        ``estimate`` predicts it there: the same model profiled otherwise (another profiler
        version, the CPU kernels' saved tensors). ``estimate`` is left as the plan's own."""
        return dataclasses.replace(self, profile_fingerprint=profile.fingerprint())

    def for_cluster(self, cluster: Any) -> Plan:
        """The same split, re-targeted at ``cluster`` (its dict and fingerprint recorded), so
        that ``estimate`` predicts it there; ``estimate`` is left as the plan's own.

        Raises:
            PlanMismatchError: ``cluster`` does not have the plan's dp*cp*tp*pp GPUs.
        """
        from autopar.cost_model.hardware import Cluster
        from autopar.cost_model.validate import world_problem

        if not isinstance(cluster, Cluster):
            raise TypeError(f"for_cluster() takes a Cluster, got {type(cluster).__name__}")
        data = cluster.to_dict()
        world = int(data.get("nodes", 0)) * int(data.get("gpus_per_node", 0))
        problem = world_problem(self.config, world)
        if problem:
            raise PlanMismatchError(f"the plan's {problem} (cluster {data.get('name', '?')!s}); "
                                    "re-plan for it with `autopar plan`")
        return dataclasses.replace(self, cluster=data, cluster_fingerprint=cluster.fingerprint())

    # ----------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict in schema order."""
        data = {
            "schema_version": self.schema_version,
            "model": self.model,
            "framework": self.framework,
            "seq_len": self.seq_len,
            "config": self.config.to_dict(),
            "stages": [s.to_dict() for s in self.stages],
            "tp_layout": dict(sorted(self.tp_layout.items())),
            "estimate": self.estimate.to_dict(),
            "profile_fingerprint": self.profile_fingerprint,
            "cluster_fingerprint": self.cluster_fingerprint,
            "cluster": copy.deepcopy(self.cluster),
            "search": self.search.to_dict(),
        }
        if self.moe is not None:
            data["moe"] = self.moe.to_dict()
        if self.loss != "eager":
            data["loss"] = self.loss
        return data

    def to_json(self) -> str:
        """Canonical JSON text (sorted keys, 2-space indent, trailing newline)."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Build a Plan from ``to_dict()`` output, with clear errors for bad documents."""
        if not isinstance(data, dict) or "schema_version" not in data:
            raise PlanFormatError("not an autopar plan: the document has no schema_version")
        try:
            _no_unknown_keys(data, _PLAN_KEYS, "the plan")
            stages = data["stages"]
            if not isinstance(stages, list):
                raise PlanFieldError(f"plan stages must be a list, got {reprlib.repr(stages)}")
            config = ParallelConfig.from_dict(data["config"])
            plan = cls(
                schema_version=whole(data["schema_version"], "schema_version"),
                model=text(data.get("model", ""), "model", line=True),
                framework=text(data.get("framework", DEFAULT_FRAMEWORK), "framework"),
                seq_len=whole(data.get("seq_len", 0), "seq_len", high=MAX_SEQ_LEN),
                config=config,
                stages=tuple(StagePlan.from_dict(s) for s in stages),
                tp_layout=text_map(data.get("tp_layout", {}), "tp_layout"),
                estimate=Estimate.from_dict(estimate_doc(data["estimate"], config.pp)),
                profile_fingerprint=text(data.get("profile_fingerprint", ""),
                                         "profile_fingerprint"),
                cluster_fingerprint=text(data.get("cluster_fingerprint", ""),
                                         "cluster_fingerprint"),
                cluster=cluster_size(data.get("cluster", {})),
                search=SearchInfo(**search_fields(data.get("search", {}))),
                moe=MoEStructure(**moe_doc(data["moe"])) if data.get("moe") else None,
                loss=_loss_kernel(data.get("loss", "eager")),
            )
            # A document's estimate is of its own stages (Python callers re-stage a plan and
            # estimate it anew: dataclasses.replace keeps the old estimate until then).
            problem = estimate_stages_problem(plan.estimate, plan.stages)
            if problem:
                raise PlanFieldError(problem)
            return plan
        except PlanFieldError as e:
            raise PlanFormatError(f"{e}; re-create the plan with `autopar plan`") from None
        except PlanFormatError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise PlanFormatError(f"plan document is malformed: {type(e).__name__}: {e}") from e

    @classmethod
    def from_json(cls, text: str, where: str = "plan") -> Plan:
        """Parse ``to_json()`` output (``where`` names it in errors: "plan file p.json")."""
        from autopar.json_data import parse_json

        data = parse_json(text, where, "an autopar plan", PlanFormatError,
                          parse_constant=reject_constant)
        return cls.from_dict(data)

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON (first 16 hex digits); compared across ranks."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


def _changed_fields(ours: dict[str, Any], theirs: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the fields whose values differ between two cluster dicts, sorted."""
    out = []
    for key in sorted(set(ours) | set(theirs), key=str):
        a, b = ours.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed_fields(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


def reject_constant(name: str) -> float:
    """``json.loads``'s ``parse_constant`` for plans: NaN and Infinity are refused."""
    raise PlanFormatError(f"plan holds {name}; every number in a plan must be finite")


def _check_parts(plan: Plan) -> None:
    """A plan's parts of their types, and the fields a plan file's reader checks
    (PlanFormatError)."""
    for name, kind in (("config", ParallelConfig), ("estimate", Estimate), ("search", SearchInfo),
                       ("cluster", dict), ("tp_layout", dict), ("stages", tuple)):
        if not isinstance(getattr(plan, name), kind):
            raise PlanFormatError(f"plan {name} must be of type {kind.__name__}, got "
                                  f"{type(getattr(plan, name)).__name__}")
    if not all(isinstance(stage, StagePlan) for stage in plan.stages):
        raise PlanFormatError("plan stages must each be a StagePlan")
    if plan.moe is not None and not isinstance(plan.moe, MoEStructure):
        raise PlanFormatError(f"plan moe must be a MoEStructure or None, got "
                              f"{type(plan.moe).__name__}")
    if plan.schema_version != SCHEMA_VERSION:
        raise PlanFormatError(
            f"plan schema_version {plan.schema_version!r} is not supported (this autopar reads "
            f"version {SCHEMA_VERSION}); re-create the plan with `autopar plan`")
    try:
        text(plan.model, "model", line=True)
        whole(plan.seq_len, "seq_len", high=MAX_SEQ_LEN)
        text(plan.profile_fingerprint, "profile_fingerprint")
        text(plan.cluster_fingerprint, "cluster_fingerprint")
        cluster_size(plan.cluster)
        check_estimate(plan.estimate)
    except PlanFieldError as err:
        raise PlanFormatError(str(err)) from None
    _loss_kernel(plan.loss)


def _check_world(config: ParallelConfig, cluster: dict[str, Any]) -> None:
    """dp * cp * tp * pp must be the GPU count of the plan's recorded cluster, and its device must
    train the plan's dtype (an fp8 plan on a device without fp8 divided the report by zero)."""
    from autopar.cost_model.hardware import Cluster
    from autopar.cost_model.validate import dtype_problem, world_problem

    try:
        recorded = Cluster.from_dict(cluster)
    except (ClusterConfigError, TypeError):
        recorded = None  # a hand-made plan: commands that need the cluster say what is wrong
        device = cluster.get("device")
        # Its names are still shown and exported: one line of printable text each.
        for name, value in (("cluster.name", cluster.get("name", "")),
                            ("cluster.device.name",
                             device.get("name", "") if isinstance(device, dict) else "")):
            try:
                text(value, name, line=True)
            except PlanFieldError as err:
                raise PlanFormatError(str(err)) from None
    problem = dtype_problem(recorded.device, config.dtype) if recorded else None
    if problem:
        raise PlanFormatError(f"the plan's cluster cannot train it: {problem}; re-plan with "
                              "`autopar plan`")
    nodes, per_node = cluster.get("nodes"), cluster.get("gpus_per_node")
    if not (isinstance(nodes, int) and isinstance(per_node, int)):
        return  # no cluster recorded (a hand-made plan): nothing to check against
    problem = world_problem(config, nodes * per_node)
    if problem:
        raise PlanFormatError(f"the plan's {problem} ({nodes} x {per_node}); re-plan with "
                              "`autopar plan`")


# The keys of a plan document and of each of its stages (``to_dict``): any other is a typo
# ("los") that would otherwise fall back to a default without a word.
_PLAN_KEYS = frozenset(("schema_version", "model", "framework", "seq_len", "config", "stages",
                        "tp_layout", "estimate", "profile_fingerprint", "cluster_fingerprint",
                        "cluster", "search", "moe", "loss"))
_STAGE_KEYS = frozenset(("index", "layers", "layer_names", "recompute"))


def _no_unknown_keys(data: dict[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted((k for k in data if k not in known), key=str)
    if unknown:
        raise PlanFieldError(f"{where} has an unknown field {unknown[0]!r}; its fields are "
                             f"{', '.join(sorted(known))}")


def _loss_kernel(value: Any) -> str:
    """A plan document's ``loss`` (PlanFormatError if not one of ``LOSS_KERNELS``)."""
    if value not in LOSS_KERNELS:
        raise PlanFormatError(f"plan field loss must be one of {', '.join(LOSS_KERNELS)}, got "
                              f"{value!r}")
    return str(value)
