"""Context parallelism: every sequence sharded over the cp ranks, attention over all-gathered K/V.

torch's ``torch.distributed.tensor.experimental.context_parallel`` (ring attention over SDPA) does
not run on a CPU build of torch 2.13: it has no sharding rule for the CPU SDPA kernel
(``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not
have a sharding strategy registered``). autopar therefore runs the all-gather-KV variant of
context parallelism (Llama 3, Dubey et al. 2024, section 3.3.2; Megatron-Core's
``cp_comm_type="all_gather"``) in the zoo's own attention, on every device:

* Load-balanced sharding: the sequence is cut into ``2 * cp`` equal chunks and cp rank ``i`` holds
  chunks ``i`` and ``2 * cp - 1 - i`` (so every rank has the same causal work). Tokens and labels
  are cut this way by ``shard_sequence``; each rank's loss is the mean over its own tokens.
* Each attention keeps its query shard and all-gathers K and V (one ``all_gather_into_tensor`` of
  K and V stacked, over the "cp" axis, torch's functional collective); backward reduce-scatters
  their gradient (one ``reduce_scatter_tensor``, the collective's own autograd rule). The causal
  mask compares the global positions of queries and keys.
* Positions (GPT's learned position embedding, Llama's RoPE) are the global positions of the
  rank's chunks (``ContextParallel.positions``).

Parameters are replicated over cp; data parallelism reduces their gradients over dp x cp
(``mesh.data_parallel_mesh``), so the step equals the one-process step on the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

__all__ = [
    "HF_ATTENTION", "ContextParallel", "apply_context_parallel", "hf_attention", "shard_sequence",
]


def _chunk_order(cp_rank: int, cp: int) -> tuple[int, int]:
    # The two sequence chunks (of 2 * cp) a cp rank holds: load-balanced for causal attention.
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_sequence(tensor: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's load-balanced share of ``tensor`` along ``dim``: chunks i and 2cp-1-i.

    Args:
        tensor: e.g. tokens or labels ``[b, s]``; ``s`` divisible by ``2 * cp``.
        cp_rank: the rank's coordinate on the "cp" axis.
        cp: the cp degree.
        dim: the sequence dimension.

    Returns:
        ``[b, s / cp]`` (a new tensor); ``tensor`` itself when cp == 1.
    """
    if cp == 1:
        return tensor
    chunks = tensor.chunk(2 * cp, dim=dim)
    first, second = _chunk_order(cp_rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


@dataclass(frozen=True, eq=False)
class ContextParallel:
    """One rank's place in the cp group; the zoo's attention and positions consult it.

    Attributes:
        rank: the coordinate on the "cp" axis.
        size: the cp degree.
        group: the "cp" axis's process group.
    """

    rank: int
    size: int
    group: Any

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """The global positions of this rank's ``local_len`` tokens (its two chunks)."""
        half = local_len // 2
        first, second = _chunk_order(self.rank, self.size)
        return torch.cat([
            torch.arange(first * half, (first + 1) * half, device=device),
            torch.arange(second * half, (second + 1) * half, device=device),
        ])

    def key_positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """The global positions of the gathered keys, in cp-rank order (``gather``'s order)."""
        return torch.cat([
            ContextParallel(rank=r, size=self.size, group=self.group).positions(local_len, device)
            for r in range(self.size)
        ])

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All-gather ``x[b, s_local, ...]`` along the sequence: ``[b, cp * s_local, ...]``.

        The keys come in cp-rank order (``key_positions``). torch's functional collective
        (``_c10d_functional.all_gather_into_tensor`` and ``wait_tensor``, whose autograd rules
        torch registers in ``torch.distributed._functional_collectives``): backward
        reduce-scatters (sums) the gradient. It returns a new tensor, so selective activation
        checkpointing (recompute.py) saves the gathered K/V rather than re-running the gather.
        """
        # Importing it registers the collectives' autograd rules.
        import torch.distributed._functional_collectives

        functional = torch.ops._c10d_functional
        # Gathered along dim 0: the sequence first. NOTE: funcol.all_gather_single(x, 1, group)
        # returns a view of the in-flight result when b == 1, whose gradient came out wrong here.
        seq_first = x.transpose(0, 1).contiguous()
        gathered = functional.all_gather_into_tensor(seq_first, self.size, self.group.group_name)
        return functional.wait_tensor(gathered).transpose(0, 1)

    def causal_mask(self, local_len: int, device: torch.device,
                    window: int | None = None) -> torch.Tensor:
        """``[s_local, cp * s_local]`` bool: query i may attend key j (key position <= query's,
        and with a sliding ``window``, > query's - window: transformers' sliding window)."""
        queries = self.positions(local_len, device)[:, None]
        keys = self.key_positions(local_len, device)[None, :]
        mask = keys <= queries
        return mask & (keys > queries - window) if window else mask


def apply_context_parallel(model: nn.Module, cp_mesh: Any) -> None:
    """Make the model's attention and positions context-parallel (a no-op when cp == 1).

    The zoo's attention and positions consult ``context_parallel``; a Hugging Face decoder's
    attention modules call ``hf_attention`` (registered with transformers' attention interface
    and named in the model's config), and its rotary embeddings take the global positions of
    the rank's chunks (a forward pre-hook replaces their position ids).

    Args:
        model: a zoo ``Transformer`` or a Hugging Face decoder (before the pipeline split, so
            every stage shares it).
        cp_mesh: the 1-D "cp" sub-mesh.
    """
    if cp_mesh.size() == 1:
        return
    from autopar.models.attention import Attention
    from autopar.models.transformer import Transformer

    shard = ContextParallel(rank=cp_mesh.get_local_rank(), size=cp_mesh.size(),
                            group=cp_mesh.get_group())
    if isinstance(model, Transformer):
        for module in model.modules():
            if isinstance(module, (Attention, Transformer)):
                module.context_parallel = shard
        return
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTENTION, hf_attention)
    config: Any = model.config
    config._attn_implementation = HF_ATTENTION
    for name, module in model.named_modules():
        if getattr(module, "config", None) is not None:
            module.context_parallel = shard  # hf_attention reads it from its attention module
        if name.rpartition(".")[2] == "rotary_emb":
            module.register_forward_pre_hook(_global_positions(shard), with_kwargs=True)


HF_ATTENTION = "autopar_context_parallel"


def hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                 dropout: float = 0.0, sliding_window: int | None = None,
                 **_kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature (``query[b, hq, s, d]``, ``key`` and
    ``value[b, hkv, s, d]``): the rank's queries against the keys and values all-gathered over
    cp, masked by global positions (and the layer's sliding window); returns ``[b, s, hq, d_v]``
    as transformers' SDPA does. ``attention_mask`` is None here (transformers builds none for
    an implementation it has no mask function for): the causal mask is the global one.

    Attention that caps its logits (``softcap``: Gemma 2) or keeps attention sinks (``s_aux``:
    gpt-oss) runs its family's own ``eager_attention_forward`` (``graph.cp.family_eager``) on
    the gathered keys and values, with the global mask as the additive mask it expects."""
    import torch.nn.functional as F

    cp = cast(ContextParallel, module.context_parallel)
    local = query.shape[2]
    key, value = (cp.gather(t.transpose(1, 2)).transpose(1, 2) for t in (key, value))
    if _kwargs.get("softcap") is not None or _kwargs.get("s_aux") is not None:
        from autopar.graph.cp import family_eager

        eager = family_eager(type(module))
        assert eager is not None, "graph.cp.cp_blocker refuses such attention without one"
        allowed = cp.causal_mask(local, query.device, sliding_window)
        additive = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
        additive = additive.masked_fill(~allowed, torch.finfo(query.dtype).min)[None, None]
        out, _ = eager(module, query, key, value, additive,
                       dropout=dropout if module.training else 0.0, scaling=scaling,
                       softcap=_kwargs.get("softcap"))
        return out, None
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each kv head serves ``groups`` query heads
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=cp.causal_mask(local, query.device, sliding_window),
        dropout_p=dropout if module.training else 0.0, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _global_positions(shard: ContextParallel):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = args[0] if args else kwargs["x"]
        positions = shard.positions(x.shape[1], x.device)[None].expand(x.shape[0], -1)
        if len(args) > 1:
            return (args[0], positions, *args[2:]), kwargs
        return args, {**kwargs, "position_ids": positions}

    return hook
