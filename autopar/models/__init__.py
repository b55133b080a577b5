"""The model zoo (gpt, llama, mlp and named presets), model files, and the HF adapter.

``build("gpt3-175b")`` returns a model on the meta device (no memory); module names follow
docs/model-structure.md. ``from_hf_config`` builds a transformers model from its config (no
download); ``load_model_file`` loads a user's ``build_model()``/``example_inputs()`` file.
"""

from __future__ import annotations

from autopar.lazy import lazy_getattr
from autopar.models.spec import ModelSpec
from autopar.models.transformer import cross_entropy_loss, init_weights
from autopar.models.zoo import build, list_presets, make_spec, num_params

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

# Loaded on first use (PEP 562): the HF adapter imports transformers, which is slow and optional.
_LAZY = {
    "from_hf_config": "autopar.models.hf",
    "hf_tp_structure": "autopar.models.hf",
    "load_model_file": "autopar.models.model_file",
    "ModelFile": "autopar.models.model_file",
    "parse_model_spec": "autopar.models.resolve",
    "resolve_model": "autopar.models.resolve",
}

__getattr__ = lazy_getattr(__name__, _LAZY, globals())
