"""ModelSpec: the shape of a zoo model (kind, sizes, attention implementation), validated.

Every zoo model carries its spec as ``model.autopar_spec``. Sizes are plain counts (layers, hidden
width, heads, vocabulary entries, tokens per sequence); nothing here touches torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ATTENTIONS", "KINDS", "MAX_CAPACITY_FACTOR", "MAX_ROUTER_IMBALANCE", "ModelSpec",
           "llama_default_ffn_hidden", "router_imbalance_valid"]

KINDS = ("gpt", "llama", "mlp")
ATTENTIONS = ("sdpa", "eager")
# The busiest of ep ranks carries at most ep times the average rows (every row on it); no
# cluster has more than this many ranks in an expert-parallel group.
MAX_ROUTER_IMBALANCE = 1024.0
# An expert's capacity factor is below this (0: dropless); a capacity of c * tokens * k / E with
# c >= E / k already holds every token.
MAX_CAPACITY_FACTOR = 1e6


def router_imbalance_valid(value: object) -> bool:
    """Whether ``value`` can be a router imbalance: 0 (unknown) or a number in
    [1, MAX_ROUTER_IMBALANCE] (the busiest ep rank's routed rows over the average)."""
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and (value == 0 or 1 <= value <= MAX_ROUTER_IMBALANCE))

# Llama's default SwiGLU width (Touvron et al. 2023, reference code's FeedForward): start from 4h,
# take 2/3 of it (SwiGLU has three matrices instead of two, so the parameter count stays ~8h^2),
# then round up to a multiple of 256.  h=4096 -> 11008 (Llama 2 7B), h=5120 -> 13824 (13B).
LLAMA_FFN_MULTIPLE_OF = 256


def llama_default_ffn_hidden(hidden: int, multiple_of: int = LLAMA_FFN_MULTIPLE_OF) -> int:
    """Llama's default SwiGLU inner width for a model of width ``hidden``.

    Args:
        hidden: model width h.
        multiple_of: the rounding granule (256 in Llama 1 and 2).

    Returns:
        ``multiple_of * ceil(int(2 * 4h / 3) / multiple_of)``.
    """
    base = int(2 * (4 * hidden) / 3)
    return multiple_of * ((base + multiple_of - 1) // multiple_of)


# The largest sizes a spec may give: far beyond any trained model (hundreds of layers, hidden
# sizes in the tens of thousands, vocabularies of a few hundred thousand, million-token contexts),
# low enough that a typo fails at once instead of building a model for hours.
MAX_SIZES = {"layers": 10_000, "hidden": 1 << 20, "ffn_hidden": 1 << 22, "vocab": 1 << 24,
             "seq_len": 1 << 24, "experts": 1 << 16, "shared_experts": 1 << 16,
             "expert_hidden": 1 << 22}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """The shape of one zoo model.

    Attributes:
        kind: "gpt", "llama" or "mlp".
        layers: number of blocks L.
        hidden: model width h.
        heads: attention heads a (0 for mlp, which has no attention).
        kv_heads: key/value heads (GQA); equals ``heads`` without GQA (0 for mlp).
        ffn_hidden: inner width of the feed-forward (GeLU MLP or SwiGLU).
        vocab: vocabulary size V.
        seq_len: maximum tokens per sequence s (gpt: number of learned positions).
        attention: "sdpa" (fused kernel, default) or "eager" (materialises the s x s scores).
        dropout: dropout probability (gpt only; after softmax, after wo, after w2).
        tie_embeddings: whether the lm head shares the token embedding's weight.
        name: preset name, or the kind for a model built from explicit sizes.
        rope_theta: RoPE base frequency (llama only; 10000 for Llama 2, 500000 for Llama 3).
        experts: routed experts per block (llama only; 0: a dense SwiGLU feed-forward).
        top_k: experts each token is routed to (1 <= top_k <= experts).
        shared_experts: experts every token passes through (DeepSeekMoE), of width
            ``shared_experts * expert_hidden`` together.
        expert_hidden: inner width of one expert (0: ``ffn_hidden``).
        capacity_factor: per-expert token capacity factor (0: dropless), see models/moe.py.
        router_imbalance: under dropless routing, the busiest expert-parallel rank's routed
            rows over the average, as the trained router spreads the training data's tokens
            (0: unknown, the cost model's default ``cost_model.moe.DROPLESS_IMBALANCE``). A
            property of the router and its data the runtime does not use: an input of the
            cost model, set by the presets whose family has a measured value.
    """

    kind: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    seq_len: int
    attention: str = "sdpa"
    dropout: float = 0.0
    tie_embeddings: bool = False
    name: str = ""
    rope_theta: float = 10000.0
    experts: int = 0
    top_k: int = 0
    shared_experts: int = 0
    expert_hidden: int = 0
    capacity_factor: float = 0.0
    router_imbalance: float = 0.0

    def __post_init__(self) -> None:
        """Check the sizes fit together; raise ValueError naming the first that does not."""
        if self.kind not in KINDS:
            raise ValueError(f"model kind {self.kind!r} is not one of {', '.join(KINDS)}")
        for field_name in ("layers", "hidden", "ffn_hidden", "vocab", "seq_len"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field_name} must be a positive integer, got {value!r}")
            if value > MAX_SIZES[field_name]:  # a typo, not a model: building it would not end
                raise ValueError(f"{field_name} must be at most {MAX_SIZES[field_name]:,}, "
                                 f"got {value:,}")
        if self.attention not in ATTENTIONS:
            raise ValueError(
                f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}"
            )
        if (isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float))
                or not 0.0 <= self.dropout < 1.0):
            raise ValueError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"tie_embeddings must be True or False, got {self.tie_embeddings!r}")
        if self.kind == "mlp":
            if self.heads != 0 or self.kv_heads != 0:
                raise ValueError("an mlp model has no attention: heads and kv_heads must be 0")
            return
        self._check_heads()
        self._check_experts()

    def _check_experts(self) -> None:
        for field_name in ("experts", "top_k", "shared_experts", "expert_hidden"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{field_name} must be a non-negative integer, got {value!r}")
            if field_name in MAX_SIZES and value > MAX_SIZES[field_name]:
                raise ValueError(f"{field_name} must be at most {MAX_SIZES[field_name]:,}, "
                                 f"got {value:,}")
        cf = self.capacity_factor
        if (isinstance(cf, bool) or not isinstance(cf, (int, float))
                or not 0 <= cf < MAX_CAPACITY_FACTOR):
            raise ValueError(f"capacity_factor must be >= 0 (0: dropless), got {cf!r}")
        ri = self.router_imbalance
        if not router_imbalance_valid(ri):
            raise ValueError(f"router_imbalance must be 0 (unknown) or between 1 and "
                             f"{MAX_ROUTER_IMBALANCE:g} (the busiest rank's rows over the "
                             f"average), got {ri!r}")
        if not self.experts:
            if self.top_k or self.shared_experts or self.expert_hidden or cf or ri:
                raise ValueError("top_k, shared_experts, expert_hidden, capacity_factor and "
                                 "router_imbalance need experts > 0")
            return
        if self.kind != "llama":
            raise ValueError("experts (mixture of experts) are a llama option")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(
                f"top_k must be between 1 and experts = {self.experts}, got {self.top_k}"
            )

    @property
    def is_moe(self) -> bool:
        """Whether the blocks' feed-forward is a mixture of experts."""
        return self.experts > 0

    def _check_heads(self) -> None:
        for field_name in ("heads", "kv_heads"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field_name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(
                f"heads={self.heads} must divide hidden={self.hidden} "
                f"(head_dim = hidden / heads); pick heads among the divisors of {self.hidden}"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"kv_heads={self.kv_heads} must divide heads={self.heads} (grouped-query attention)"
            )
        if self.kind == "llama" and self.head_dim % 2:
            raise ValueError(
                f"llama needs an even head_dim for RoPE, got hidden/heads = {self.head_dim}"
            )
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < 1e30:
            raise ValueError(f"rope_theta must be a positive finite number, got {theta!r}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head, ``hidden // heads`` (0 for mlp)."""
        return self.hidden // self.heads if self.heads else 0
