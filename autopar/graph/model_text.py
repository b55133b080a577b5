"""Build a model from its MODEL text and profile it: the one rule plan, run and verify share.

``autopar plan`` profiles a model, stores the profile's fingerprint in the plan, and ``autopar
run`` / ``autopar verify`` rebuild and re-profile the model to check it is the same one; they all
call ``build_and_profile`` so the fingerprints agree. The model is built on the meta device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autopar.errors import AutoparError
from autopar.graph.types import ModelProfile

__all__ = ["build_and_profile", "plan_model_text"]


def plan_model_text(plan_model: str, given: str | None) -> str:
    """The MODEL a plan is rebuilt from: the user's ``--model``, else the plan's ``model`` field.

    A plan is data anyone can write, and a ``.py`` model is code: the plan's own field is used
    only when it is data too (a zoo name or spec, an HF config JSON). A model file runs only
    when the user names it with ``--model`` (the same path or another).

    Args:
        plan_model: the plan's ``model`` field ("" when it records none).
        given: ``--model`` as the user gave it (None or "": not given).

    Raises:
        AutoparError: no model at all, or the plan names a model file and ``given`` is empty.
    """
    if given:
        return given
    if not plan_model:
        raise AutoparError("the plan does not record its model; pass --model MODEL")
    if plan_model.endswith(".py"):
        raise AutoparError(
            f"the plan names a model file ({plan_model!r}), and loading it runs its code; pass "
            "--model FILE (that path, or your own copy) if you trust it"
        )
    return plan_model


def build_and_profile(
    model_text: str, *, seq_len: int | None = None, dtype: Any = None, kernels: str = "cuda",
    loss: str = "eager",
) -> tuple[Any, ModelProfile]:
    """Build ``model_text`` on the meta device and profile it.

    Args:
        model_text: a model file, a zoo name or ``kind:key=value`` spec, or an HF config JSON.
        seq_len: tokens per sequence. None: a model file's ``example_inputs`` decide, else the
            model's own (``graph.facts.default_seq_len``: its zoo spec's, or the HF config's
            context capped at 4096, as ``autopar.profile`` takes it).
        dtype: the dtype the profile counts bytes at (None: ``autopar.profile``'s default).
        kernels: whose kernels' saved tensors the profile counts ("cuda" or "cpu", see
            ``autopar.profile``).
        loss: the token cross-entropy kernel ("eager" or "fused", see ``autopar.profile``).

    Returns:
        (the meta-device model, its ModelProfile).

    Raises:
        AutoparError: the model cannot be found, built or traced, or its sequence length is
            unknown or contradicts a model file's inputs.
    """
    from autopar.graph.facts import default_seq_len
    from autopar.graph.profiler import profile
    from autopar.models import resolve_model

    builder, _ = resolve_model(model_text)
    model = builder(device="meta")
    example_inputs, own_loss = None, False
    if model_text.endswith(".py"):
        from autopar.graph.inputs import pipeline_blocker, seq_len_of
        from autopar.models import load_model_file

        model_file = load_model_file(model_text)
        example_inputs, own_loss = model_file.example_inputs, model_file.loss_fn is not None
        file_seq_len = seq_len_of(example_inputs)
        if seq_len is not None and file_seq_len is not None and seq_len != file_seq_len:
            raise AutoparError(
                f"--seq-len {seq_len} differs from the {file_seq_len} tokens of {model_text}'s "
                "example_inputs; drop --seq-len or change example_inputs"
            )
        seq_len = seq_len or file_seq_len
    if seq_len is None:
        seq_len = default_seq_len(model)  # the zoo spec's, or the HF context capped
    if seq_len is None:
        raise AutoparError(f"cannot tell the sequence length of {model_text}; pass --seq-len S")
    kwargs = {} if dtype is None else {"dtype": dtype}
    prof = profile(model, seq_len=seq_len, example_inputs=example_inputs, kernels=kernels,
                   loss=loss, **kwargs)
    if own_loss:
        _check_own_loss(model, model_file.loss_fn, seq_len, example_inputs)
    # The file's own loss runs on whole logits in autopar's runtime (ModelProfile.own_loss); the
    # profile itself counts the token cross entropy's head, as for every model.
    if not own_loss:
        return model, prof
    return model, dataclasses.replace(
        prof, own_loss=True, pp_blocker=pipeline_blocker(example_inputs, model_file.loss_fn))


def _check_own_loss(model: Any, loss_fn: Any, seq_len: int, example_inputs: Any) -> None:
    """Run the file's ``loss_fn`` once on the model's meta output: what it returns must be one
    number (``checked_loss``), found here rather than in every worker. A loss that cannot run
    on meta tensors (it reads values) is left to the run."""
    from autopar.graph.inputs import checked_loss, make_batch

    batch = make_batch(model, 1, seq_len, example_inputs)
    try:
        value = loss_fn(model(*batch.args, **batch.kwargs), batch.raw)
    except Exception:  # values read on meta, or the file's own error: only the run can tell
        return
    checked_loss(value)
