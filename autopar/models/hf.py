"""Build Hugging Face transformers models from a config alone (no download), on meta by default.

``from_hf_config`` accepts a config object, a dict, or a path to a ``config.json``; it builds
``AutoModelForCausalLM.from_config`` under ``torch.device(device)`` with ``use_cache=False`` (the
KV cache is for generation; it also breaks tracing). ``hf_tp_structure`` reads the sizes and the
module layout (the decoder-layer ModuleList, embedding, lm head, which linears shard column- or
row-wise) that the profiler and runtime need. transformers is an optional dependency.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.errors import AutoparError, UnknownModelError
from autopar.json_data import read_json
from autopar.models.spec import MAX_SIZES
from autopar.models.tp_names import COLWISE_NAMES, FUSED_NAMES, ROWWISE_NAMES

__all__ = ["HFStructure", "from_hf_config", "hf_config_notes", "hf_tp_structure", "load_hf_config"]

# Last FQN component of a linear inside a decoder layer -> its tensor-parallel style. Column-wise:
# input projections (q, k, v, gate, up, fc in); row-wise: output projections (o, down, fc out).
# Fused projections (qkv in one matrix, gate+up in one) are listed apart: a plain column split
# of them would mix q with k/v, so they need a layout-aware split.
# Beyond the names any model's are recognised by (tp_names.py): T5's q / k / v / o, BERT's
# attention-output dense.
_COLWISE = COLWISE_NAMES | {"q", "k", "v"}
_ROWWISE = ROWWISE_NAMES | {"dense", "o"}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise AutoparError(
            "building a model from an HF config needs transformers: pip install 'autopar[hf]'"
        ) from None
    return transformers


def load_hf_config(config: Any) -> Any:
    """Turn a config object, dict, or JSON path into a transformers ``PretrainedConfig``.

    Args:
        config: a ``PretrainedConfig``, a dict with ``model_type``, or a path to a config JSON
            (a file, or a directory holding ``config.json``).

    Returns:
        The config, with ``use_cache=False``.

    Raises:
        AutoparError: transformers is not installed, or the file cannot be read.
        UnknownModelError: no ``model_type``, or one this transformers does not know.
    """
    transformers = _transformers()
    if isinstance(config, transformers.PretrainedConfig):
        config = config.to_dict()
    if isinstance(config, (str, Path)):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        config = read_json(path, f"HF config {path}", "an HF config")
    if not isinstance(config, Mapping) or "model_type" not in config:
        raise UnknownModelError('an HF config needs a \'model_type\' key (e.g. "llama", "gpt2")')
    data = dict(config)
    model_type = data.pop("model_type")
    known = transformers.CONFIG_MAPPING.keys()
    if model_type not in known:
        close = difflib.get_close_matches(str(model_type), list(known), n=3)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise UnknownModelError(
            f"transformers {transformers.__version__} does not know model_type "
            f"{model_type!r}.{hint} Upgrade transformers or check the config"
        )
    data["use_cache"] = False
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **data)
    except Exception as err:  # transformers' own validators: ValueError and its own classes
        text = " ".join(str(err).split())
        raise AutoparError(
            f"transformers rejects the {model_type} config: {text[-300:]}; fix the config"
        ) from None
    _check_sizes(cfg)
    return cfg


def hf_config_notes(config: Mapping[str, Any]) -> tuple[str, ...]:
    """What an HF config asks for that a plan does not model, in words (for stderr notes)."""
    quant = config.get("quantization_config")
    if not quant:
        return ()
    method = quant.get("quant_method", "?") if isinstance(quant, Mapping) else "?"
    return (f"the config's quantization_config ({method}) is not modelled: autopar plans full "
            "training of the architecture in the plan's dtype (the weights dequantized), not "
            "quantized fine-tuning",)


# The config's counts and widths (transformers' names; attribute_map gives GPT-2's n_layer and
# the like these names): each at least 1, and the zoo's bound on the size it stands for
# (spec.MAX_SIZES), where one applies. transformers checks none of them: a 0 builds a model
# with no blocks, or fails inside it with an internal error.
_SIZE_FIELDS = {"num_hidden_layers": "layers", "hidden_size": "hidden",
                "intermediate_size": "ffn_hidden", "vocab_size": "vocab",
                "num_attention_heads": "", "num_key_value_heads": "", "head_dim": "",
                "max_position_embeddings": ""}
# Expert counts: 0 is a dense variant of an MoE family (Granite 4.0 dense, a dense llama4_text),
# and one expert is a plain MLP (Jamba): only a negative count is a typo.
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "num_experts_per_tok")


def _check_sizes(cfg: Any) -> None:
    for name, bound in _SIZE_FIELDS.items():
        value = getattr(cfg, name, None)
        if isinstance(value, bool) or not isinstance(value, int):
            continue  # absent or None: the family does not use it
        limit = MAX_SIZES.get(bound)
        if value < 1 or (limit is not None and value > limit):
            need = f"from 1 to {limit:,}" if limit is not None else "at least 1"
            raise AutoparError(f"HF config {name} is {value:,}; it must be {need}: fix the "
                               "config")
    heads, kv_heads = (getattr(cfg, n, None) for n in ("num_attention_heads",
                                                       "num_key_value_heads"))
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise AutoparError(f"HF config num_key_value_heads ({kv_heads}) must divide "
                           f"num_attention_heads ({heads}): fix the config")
    for name in _EXPERT_FIELDS:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise AutoparError(f"HF config {name} is {value:,}; it must be at least 0: fix the "
                               "config")
    experts = next((getattr(cfg, n) for n in ("num_local_experts", "num_experts")
                    if isinstance(getattr(cfg, n, None), int)), None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if (isinstance(experts, int) and experts > 1 and isinstance(top_k, int)
            and top_k > experts):
        raise AutoparError(f"HF config num_experts_per_tok ({top_k}) is more than its "
                           f"{experts} experts: fix the config")
    if isinstance(experts, int) and experts > 1 and top_k == 0:
        raise AutoparError(f"HF config num_experts_per_tok is 0: its router would send tokens "
                           f"to none of its {experts} experts; fix the config (1 or more)")


def from_hf_config(
    config: Any,
    *,
    device: str | torch.device = "meta",
    dtype: torch.dtype | None = None,
    seed: int | None = None,
) -> nn.Module:
    """Build a causal-LM transformers model from its config, without downloading weights.

    Args:
        config: a ``PretrainedConfig``, a dict, or a path to ``config.json`` (see
            ``load_hf_config``).
        device: default device while building ("meta": no memory).
        dtype: parameter dtype (None: float32, transformers' default for ``from_config``).
        seed: on a real device, seed torch's generator for the init (restored afterwards).

    Returns:
        The model (``AutoModelForCausalLM.from_config``), in train mode.

    Raises:
        AutoparError: transformers missing, or the family has no causal-LM class.
        UnknownModelError: unknown ``model_type``.

    Example:
        >>> model = from_hf_config({"model_type": "llama", "hidden_size": 64,
        ...     "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
        ...     "vocab_size": 256})
    """
    transformers = _transformers()
    cfg = load_hf_config(config)
    kwargs = {} if dtype is None else {"dtype": dtype}
    with torch.random.fork_rng(devices=[]), torch.device(device):
        if seed is not None:
            torch.manual_seed(seed)
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, **kwargs)
        except ValueError as err:
            if "Unrecognized configuration class" not in str(err):
                raise _unbuildable(cfg, err) from None
            raise AutoparError(
                f"HF model_type {cfg.model_type!r} has no causal-LM model in transformers; "
                f"autopar plans decoder-only language models"
            ) from None
        except (ArithmeticError, AssertionError, AttributeError, ImportError, IndexError,
                KeyError, RuntimeError, TypeError) as err:
            # ImportError: a kernel the config asks for (attn_implementation flash_attention_2)
            # is not installed; ArithmeticError: a field of 0 (decoder_sparse_step).
            raise _unbuildable(cfg, err) from None
    model.train()
    return model


def _unbuildable(cfg: Any, err: BaseException) -> AutoparError:
    """transformers could not build the model from ``cfg`` (a field missing or out of range,
    such as a pad_token_id outside the vocabulary): the config is what to fix."""
    first = (str(err).strip().splitlines() or [""])[0][:200]
    return AutoparError(
        f"transformers cannot build a {cfg.model_type} model from this config "
        f"({type(err).__name__}: {first}); fix the config")


@dataclass(frozen=True, slots=True, kw_only=True)
class HFStructure:
    """Sizes and module layout of a transformers causal LM.

    Attributes:
        model_type: the config's ``model_type``.
        hidden: model width h.
        heads: attention heads.
        kv_heads: key/value heads (== heads without GQA).
        ffn_hidden: MLP inner width (0 when the config does not say).
        vocab: vocabulary size.
        num_layers: decoder layers.
        layers_fqn: FQN of the decoder-layer ModuleList ("model.layers", "transformer.h", ...).
        embedding_fqn: FQN of the token embedding.
        lm_head_fqn: FQN of the output projection ("" if none found).
        tied_embeddings: whether the lm head shares the embedding's weight.
        colwise: linears inside one decoder layer (relative FQNs) to shard column-wise.
        rowwise: linears inside one decoder layer to shard row-wise.
        fused: fused projections (qkv, gate+up) that need a layout-aware split.
        other: linears not recognised (kept replicated unless the caller knows better).
    """

    model_type: str
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    num_layers: int
    layers_fqn: str
    embedding_fqn: str
    lm_head_fqn: str
    tied_embeddings: bool
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    fused: tuple[str, ...]
    other: tuple[str, ...]


def _layers_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    # The decoder stack is the longest ModuleList of same-class modules.
    best: tuple[str, nn.ModuleList] | None = None
    for fqn, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            same = len({type(m) for m in module}) == 1
            if same and (best is None or len(module) > len(best[1])):
                best = (fqn, module)
    if best is None:
        raise AutoparError(f"{type(model).__name__} has no ModuleList of decoder layers")
    return best


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _classify(layer: nn.Module) -> dict[str, tuple[str, ...]]:
    groups: dict[str, list[str]] = {"colwise": [], "rowwise": [], "fused": [], "other": []}
    for fqn, module in layer.named_modules():
        if not _is_linear(module):
            continue
        leaf = fqn.rsplit(".", 1)[-1]
        group = (
            "fused" if leaf in FUSED_NAMES
            else "colwise" if leaf in _COLWISE
            else "rowwise" if leaf in _ROWWISE
            else "other"
        )  # fmt: skip
        groups[group].append(fqn)
    return {k: tuple(v) for k, v in groups.items()}


def _fqn_of(model: nn.Module, target: nn.Module | None) -> str:
    if target is None:
        return ""
    return next((fqn for fqn, m in model.named_modules() if m is target), "")


def hf_tp_structure(model: nn.Module) -> HFStructure:
    """Read sizes and layout from a transformers causal LM (any device, meta included).

    Args:
        model: a model from ``from_hf_config`` (or any ``PreTrainedModel`` causal LM).

    Returns:
        The HFStructure.
    """
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    ffn = getattr(cfg, "intermediate_size", None) or getattr(cfg, "ffn_dim", None)
    if ffn is None and hasattr(cfg, "n_inner"):
        ffn = cfg.n_inner or 4 * int(cfg.hidden_size)  # GPT-2 family: n_inner None means 4h
    layers_fqn, layers = _layers_list(model)
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = bool(head is not None and embedding is not None and head.weight is embedding.weight)
    return HFStructure(
        model_type=str(cfg.model_type),
        hidden=int(cfg.hidden_size),
        heads=heads,
        kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        ffn_hidden=int(ffn or 0),
        vocab=int(cfg.vocab_size),
        num_layers=len(layers),
        layers_fqn=layers_fqn,
        embedding_fqn=_fqn_of(model, embedding),
        lm_head_fqn=_fqn_of(model, head),
        tied_embeddings=tied,
        **_classify(layers[0]),
    )
