"""What a cluster description may hold: each field's type and range, checked with one error.

A cluster file is data a user wrote: every field is checked for its type, its range and, where a
value is too large to describe hardware, a plausible maximum (a latency of 1e308 s or a peak of
1e308 FLOP/s is a typo; the cost model's arithmetic would overflow to infinities and NaNs that
the search cannot order). ``Cluster.from_dict`` and ``Cluster.__post_init__`` call ``validate``.
"""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from autopar.cost_model.hardware import MAX_GPUS, MIN_RATE_PER_S, Cluster, DeviceSpec
from autopar.errors import ClusterConfigError

__all__ = ["MIN_FACTOR", "load_yaml", "validate"]

# The smallest efficiency or multiplier a cluster field may hold (module docstring).
MIN_FACTOR = 1e-3
# The longest cluster or device name (it heads every report).
MAX_NAME_CHARS = 100

# ---------------------------------------------------------------------- validation
# field -> (kind, rule); rules: "pos" > 0, "nonneg" >= 0, "frac" in [0, 1), "eff" in (0, 1].
_DEVICE_REQUIRED: dict[str, tuple[str, str]] = {
    "name": ("str", ""),
    "peak_bf16_flops": ("float", "rate"),
    "peak_fp16_flops": ("float", "rate"),
    "peak_tf32_flops": ("float", "rate"),
    "peak_fp32_flops": ("float", "rate"),
    "memory_bytes": ("int", "pos"),
    "hbm_bytes_per_s": ("float", "rate"),
    "matmul_efficiency_max": ("float", "eff"),
    "matmul_half_flops": ("float", "nonneg"),
    "elementwise_traffic_factor": ("float", "nonneg"),
}
# Device fields that older cluster files may lack (framework overheads: none), with their rules;
# their defaults are DeviceSpec's own.
_DEVICE_OPTIONAL_RULES: dict[str, tuple[str, str]] = {
    **{name: ("float", "nonneg")
       for name in ("layer_overhead_s", "edge_layer_overhead_s", "tp_module_overhead_s",
                    "fsdp_layer_overhead_s", "optimizer_layer_overhead_s",
                    "dtensor_optimizer_layer_overhead_s", "recompute_layer_overhead_s",
                    "dispatch_floor_s", "peak_fp8_flops")},
    "shared_compute_processes": ("float", "atleast1"),
    "flash2_attention_ratio": ("float", "eff"),
}
_DEVICE_FIELDS = MappingProxyType({**_DEVICE_REQUIRED, **_DEVICE_OPTIONAL_RULES})
_LINK_FIELDS = MappingProxyType({
    "bandwidth_bytes_per_s": ("float", "rate"),
    "latency_s": ("float", "nonneg"),
})
_CLUSTER_FIELDS = MappingProxyType({
    "name": ("str", ""),
    "nodes": ("int", "pos"),
    "gpus_per_node": ("int", "pos"),
    "memory_headroom_fraction": ("float", "frac"),
    "dp_overlap_efficiency": ("float", "unit"),
    "comm_buffer_bytes_per_group": ("float", "nonneg"),
    "allocator_reserve_bytes": ("float", "nonneg"),
    "param_traffic_factor": ("float", "unit"),
    "all_reduce_time_factor": ("float", "pos"),
    "all_gather_time_factor": ("float", "pos"),
    "reduce_scatter_time_factor": ("float", "pos"),
    "host_memory_bytes_per_gpu": ("float", "nonneg"),
    "pcie_bytes_per_s": ("float", "nonneg"),
})


def _defaults(cls: type, names: Any) -> MappingProxyType[str, Any]:
    """The dataclass defaults of ``names``: the one home of every optional field's value."""
    return MappingProxyType({f.name: f.default for f in dataclasses.fields(cls) if f.name in names})


_DEVICE_OPTIONAL = _defaults(DeviceSpec, _DEVICE_OPTIONAL_RULES)
_OPTIONAL = _defaults(Cluster, [n for n in _CLUSTER_FIELDS if n not in ("name", "nodes",
                                                                          "gpus_per_node")])
_RULE_TEXT = {
    "pos": "must be > 0",
    "nonneg": "must be >= 0",
    "frac": "must be in [0, 1)",
    "eff": "must be in (0, 1]",
    "unit": "must be in [0, 1]",
    "atleast1": "must be >= 1",
    "rate": f"must be a finite rate of at least {MIN_RATE_PER_S:g} per second",
}


def _shown(value: Any) -> str:
    """A bounded repr of a cluster file's value for a message (a YAML alias bomb's nested lists
    share their items: a full repr would expand them without end)."""
    short = reprlib.Repr()  # Python 3.11: limits as attributes
    short.maxlevel, short.maxlist, short.maxdict = 2, 4, 4
    short.maxstring, short.maxother, short.maxlong = 60, 60, 40
    return short.repr(value)


def _check_value(path: str, value: Any, kind: str, rule: str) -> Any:
    if kind == "str":
        if not isinstance(value, str):
            raise ClusterConfigError(f"cluster field {path} must be a string, got {_shown(value)}")
        # A name is printed in every report: one line of printable text, no terminal controls.
        if not 0 < len(value) <= MAX_NAME_CHARS or not value.isprintable():
            raise ClusterConfigError(
                f"cluster field {path} must be one line of 1 to {MAX_NAME_CHARS} printable "
                f"characters, got {_shown(value)}")
        return value
    if isinstance(value, str):  # YAML 1.1 reads "312e12" as a string; accept numeric text
        try:
            value = float(value)
        except ValueError:
            raise ClusterConfigError(
                f"cluster field {path} must be a number, got {_shown(value)}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ClusterConfigError(f"cluster field {path} must be a number, got {_shown(value)}")
    if value in (float("inf"), float("-inf")):
        raise ClusterConfigError(f"cluster field {path} must be finite, got {_shown(value)}")
    if kind == "int":
        if abs(value) > 2**62:
            raise ClusterConfigError(f"cluster field {path} is far too large: {_shown(value)}")
        if float(value) != int(value):
            raise ClusterConfigError(
                f"cluster field {path} must be an integer, got {_shown(value)}")
        value = int(value)
    else:
        try:
            value = float(value)
        except OverflowError:  # an integer of hundreds of digits: no float holds it
            raise ClusterConfigError(
                f"cluster field {path} is far too large: {_shown(value)}") from None
    ok = {
        "pos": value > 0,
        "nonneg": value >= 0,
        "frac": 0 <= value < 1,
        "eff": 0 < value <= 1,
        "unit": 0 <= value <= 1,
        "atleast1": value >= 1,
        "rate": value >= MIN_RATE_PER_S,
    }[rule]
    if not ok or value in (float("inf"), float("-inf")):
        raise ClusterConfigError(f"cluster field {path} {_RULE_TEXT[rule]}, got {value!r}")
    name = path.rsplit(".", 1)[-1]
    if kind == "float" and rule in ("eff", "pos") and value < MIN_FACTOR:
        # An efficiency or time multiplier of 5e-324 divides the cost model by zero.
        raise ClusterConfigError(
            f"cluster field {path} is {value:g}, below any hardware (at least {MIN_FACTOR:g}); "
            "fix the cluster file")
    if kind == "float" or "bytes" in name:
        most, unit = _maximum(name)
        if value > most:
            raise ClusterConfigError(
                f"cluster field {path} is {value:g}, beyond any hardware (at most {most:g}"
                f"{unit}); fix the cluster file")
    return value


def _maximum(name: str) -> tuple[float, str]:
    """The plausible maximum of a field by what it measures (module docstring): rates (FLOP/s,
    bytes/s) 1e18 per second, sizes 2**50 bytes (1 PiB), FLOP counts 1e18, durations 60 s,
    multipliers 1,000 (fractions and efficiencies are bounded by their rules)."""
    if name.endswith("_per_s") or name.startswith("peak_"):
        return 1e18, " per second"
    if "bytes" in name:
        return 2.0**50, " bytes"
    if name.endswith("_flops"):
        return 1e18, " FLOPs"
    if name.endswith("_s"):
        return 60.0, " s"
    return 1e3, ""


def _check_section(
    prefix: str, data: Any, fields: Mapping[str, tuple[str, str]], optional: Mapping[str, Any]
) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ClusterConfigError(f"cluster field {prefix.rstrip('.') or 'root'} must be a "
                                 "mapping")
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise ClusterConfigError(
            f"unknown cluster field {prefix}{unknown[0]}; known fields: {', '.join(fields)}"
        )
    out: dict[str, Any] = {}
    for key, (kind, rule) in fields.items():
        if key not in data:
            if key in optional:
                out[key] = optional[key]
                continue
            raise ClusterConfigError(f"cluster field {prefix}{key} is missing")
        out[key] = _check_value(prefix + key, data[key], kind, rule)
    return out


def validate(data: Any) -> dict[str, Any]:
    """Check a cluster dict; return it with numbers normalised (ints, floats)."""
    nested = {"device": _DEVICE_FIELDS, "intra_node": _LINK_FIELDS, "inter_node": _LINK_FIELDS}
    top_fields = {**_CLUSTER_FIELDS, **{k: ("dict", "") for k in nested}}
    if not isinstance(data, dict):
        raise ClusterConfigError("a cluster description must be a mapping of fields")
    unknown = sorted(set(data) - set(top_fields), key=str)
    if unknown:
        raise ClusterConfigError(
            f"unknown cluster field {unknown[0]}; known fields: {', '.join(top_fields)}"
        )
    out = _check_section("", {k: v for k, v in data.items() if k not in nested},
                         _CLUSTER_FIELDS, _OPTIONAL)
    for key, fields in nested.items():
        if key not in data:
            raise ClusterConfigError(f"cluster field {key} is missing")
        optional: Mapping[str, Any] = _DEVICE_OPTIONAL if key == "device" else {}
        out[key] = _check_section(f"{key}.", data[key], fields, optional)
    if out["nodes"] * out["gpus_per_node"] > MAX_GPUS:
        raise ClusterConfigError(
            f"a cluster of {out['nodes']} x {out['gpus_per_node']} GPUs is larger than autopar "
            f"plans for ({MAX_GPUS} GPUs); check nodes and gpus_per_node"
        )
    return out


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` of a cluster file, stricter where YAML 1.1 reads a typo as data: a
    key given twice (PyYAML keeps the last), a sexagesimal number (``1:00`` reads as 60) and a
    leading zero (``010`` reads as octal 8) are ``yaml.YAMLError``s naming the line."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: list[Any] = []
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # "<<: *anchor" inherits keys the mapping may then override
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} is given twice", key_node.start_mark)
                seen.append(key)
            return super().construct_mapping(node, deep)

    def number(loader: Any, node: Any) -> Any:
        if ":" in str(node.value):
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value!r} is a base-60 number in YAML 1.1; quote it or "
                "write the number", node.start_mark)
        digits = str(node.value).lstrip("+-").replace("_", "")
        if node.tag.endswith(":int") and len(digits) > 1 and digits[0] == "0" and digits.isdigit():
            value = yaml.SafeLoader.construct_yaml_int(loader, node)
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value!r} is octal ({value}) in YAML 1.1; write it without "
                "the leading zero", node.start_mark)
        return (yaml.SafeLoader.construct_yaml_int if node.tag.endswith(":int")
                else yaml.SafeLoader.construct_yaml_float)(loader, node)

    StrictLoader.add_constructor("tag:yaml.org,2002:int", number)
    StrictLoader.add_constructor("tag:yaml.org,2002:float", number)
    return yaml.load(text, Loader=StrictLoader)  # a SafeLoader subclass: no object tags
