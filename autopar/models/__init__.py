"""The model zoo (gpt, llama, mlp and named presets), model files, and the HF adapter.

``build("gpt3-175b")`` returns a model on the meta device (no memory); module names follow
docs/model-structure.md. ``from_hf_config`` builds a transformers model from its config (no
download); ``load_model_file`` loads a user's ``build_model()``/``example_inputs()`` file.
"""

from __future__ import annotations

from autopar.lazy import lazy_getattr
from autopar.models.spec import ModelSpec

__all__ = [
    "ModelFile",
    "ModelSpec",
    "build",
    "cross_entropy_loss",
    "from_hf_config",
    "hf_tp_structure",
    "init_weights",
    "list_presets",
    "load_model_file",
    "make_spec",
    "num_params",
    "parse_model_spec",
    "resolve_model",
]

# Loaded on first use (PEP 562): the zoo imports torch, and the HF adapter transformers (slow and
# optional), so the cost model reads the presets' figures without either.
_LAZY = {
    "build": "autopar.models.zoo",
    "list_presets": "autopar.models.zoo",
    "make_spec": "autopar.models.zoo",
    "num_params": "autopar.models.zoo",
    "cross_entropy_loss": "autopar.models.transformer",
    "init_weights": "autopar.models.transformer",
    "from_hf_config": "autopar.models.hf",
    "hf_tp_structure": "autopar.models.hf",
    "load_model_file": "autopar.models.model_file",
    "ModelFile": "autopar.models.model_file",
    "parse_model_spec": "autopar.models.resolve",
    "resolve_model": "autopar.models.resolve",
}

__getattr__ = lazy_getattr(__name__, _LAZY, globals())
