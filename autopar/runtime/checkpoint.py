"""Sharded, atomic training checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout of a checkpoint directory::

    DIR/step_4/       a complete checkpoint: DCP shards + .metadata, then COMPLETE (written last)
    DIR/step_6.tmp/   a checkpoint being written (or left by a crash: ignored and replaced)

What is saved: the model and AdamW state of every model part this rank holds, through
``get_state_dict`` / ``set_state_dict`` with flattened optimizer keys (``state.<fqn>.exp_avg``,
``param_groups.<fqn>.lr``). Keys are the original model's FQNs, so a checkpoint written under one
split loads under any other (tp=2 -> dp=2, pp=2 -> one process): DCP reshards on load. DCP stores
tensors and plain values only; no pickled code.

Atomicity: every rank writes its shards into ``step_N.tmp/``; after a barrier rank 0 renames it to
``step_N/`` and only then writes the ``COMPLETE`` marker (itself written to a temporary name and
renamed). A crash at any point leaves either no ``step_N/`` or one without the marker, and
``latest_complete_step`` skips both, so the previous checkpoint stays the one resumed from. On
several nodes DIR must be on storage every node sees.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError

__all__ = [
    "MARKER_NAME",
    "check_checkpoint_dir",
    "checkpoint_path",
    "latest_complete_step",
    "load_checkpoint",
    "read_marker",
    "save_checkpoint",
]

MARKER_NAME = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_path(checkpoint_dir: str | Path, step: int) -> Path:
    """The directory of the complete checkpoint taken after optimizer step ``step``."""
    return Path(checkpoint_dir) / f"step_{step}"


def latest_complete_step(checkpoint_dir: str | Path) -> int | None:
    """The highest step with a complete checkpoint in ``checkpoint_dir``; None if there is none.

    Pure file-system inspection (no process group), so the launcher can call it before starting
    any worker.
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    steps = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / MARKER_NAME).is_file():
            steps.append(int(match.group(1)))
    return max(steps) if steps else None


def check_checkpoint_dir(
    checkpoint_dir: str | None, *, resume: bool, steps: int, every: int
) -> int:
    """Check the checkpoint arguments of a launch; return the step training starts after.

    Args:
        checkpoint_dir: ``--checkpoint-dir`` (None: no checkpoints).
        resume: ``--resume``.
        steps: ``--steps``, the total.
        every: ``--checkpoint-every``.

    Returns:
        The step of the checkpoint resumed from (0 for a fresh run).

    Raises:
        AutoparError: --resume or --checkpoint-every without a directory; --resume with no
            complete checkpoint; an existing non-empty directory without --resume (a run never
            overwrites checkpoints silently); a checkpoint already past --steps.
    """
    if every < 0:
        raise AutoparError(f"--checkpoint-every must be 0 or more, got {every}")
    if not checkpoint_dir:
        if resume:
            raise AutoparError("--resume needs --checkpoint-dir DIR (the run to continue)")
        if every:
            raise AutoparError("--checkpoint-every needs --checkpoint-dir DIR")
        return 0
    root = Path(checkpoint_dir)
    if root.exists() and not root.is_dir():
        raise AutoparError(f"checkpoint dir {checkpoint_dir} is a file; give a directory")
    if not resume:
        if root.is_dir() and any(root.iterdir()):
            raise AutoparError(
                f"checkpoint dir {checkpoint_dir} already holds a run; pass --resume to continue "
                "it, or give a new --checkpoint-dir"
            )
        return 0
    if not root.is_dir():
        raise AutoparError(
            f"checkpoint dir {checkpoint_dir} does not exist; nothing to resume (drop --resume "
            "to start a new run there)"
        )
    latest = latest_complete_step(root)
    if latest is None:
        raise AutoparError(
            f"checkpoint dir {checkpoint_dir} holds no complete checkpoint to resume"
        )
    if latest > steps:
        raise AutoparError(
            f"the last checkpoint in {checkpoint_dir} is at step {latest}, past --steps {steps}; "
            f"--steps is the total, so pass --steps {latest} or more"
        )
    return latest


def read_marker(checkpoint_dir: str | Path, step: int) -> dict[str, Any]:
    """The JSON the marker of checkpoint ``step`` records (step, world size, config)."""
    text = (checkpoint_path(checkpoint_dir, step) / MARKER_NAME).read_text()
    return json.loads(text)


def _merged_state(model_parts: Sequence[Any], optimizers: Sequence[Any]) -> tuple[dict, list]:
    """One flat state dict over all model parts, and the key sets of each part.

    ``get_optimizer_state_dict`` creates the optimizer state if it does not exist yet (a zero-lr
    step), which DCP needs before it can load into it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    merged: dict[str, Any] = {}
    part_keys = []
    for part, optimizer in zip(model_parts, optimizers, strict=True):
        model_sd, optim_sd = get_state_dict(part, optimizer, options=options)
        part_keys.append((tuple(model_sd), tuple(optim_sd)))
        for key, value in model_sd.items():
            merged[f"model.{key}"] = value
        for key, value in optim_sd.items():
            merged[f"optim.{key}"] = value
    return merged, part_keys


def save_checkpoint(
    checkpoint_dir: str | Path,
    step: int,
    model_parts: Sequence[Any],
    optimizers: Sequence[Any],
    *,
    marker: dict[str, Any],
) -> Path:
    """Write the checkpoint of step ``step`` atomically (collective: every rank calls it).

    Args:
        checkpoint_dir: the run's checkpoint directory.
        step: optimizer steps completed.
        model_parts: the model chunks this rank holds (one per pipeline stage on the rank).
        optimizers: one optimizer per model part, in the same order.
        marker: JSON-ready facts recorded in the marker (world size, config); ``step`` is added.

    Returns:
        The path of the complete checkpoint.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    final = checkpoint_path(checkpoint_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        # A crash may have left partial writes (tmp dirs, or this step renamed without its
        # marker): none is a usable checkpoint, so start clean.
        for stale in Path(checkpoint_dir).glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state, _ = _merged_state(model_parts, optimizers)
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_marker(final, {**marker, "step": step})
    dist.barrier()
    return final


def _write_marker(directory: Path, data: dict[str, Any]) -> None:
    """Write the marker through a temporary file, fsynced, then renamed (atomic on POSIX)."""
    tmp = directory / (MARKER_NAME + ".tmp")
    with tmp.open("w") as f:
        json.dump(data, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MARKER_NAME)


def load_checkpoint(
    checkpoint_dir: str | Path,
    step: int,
    model_parts: Sequence[Any],
    optimizers: Sequence[Any],
) -> None:
    """Load checkpoint ``step`` into this rank's model parts and optimizers, resharding as needed.

    Collective: every rank calls it. The current split may differ from the one that saved.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state, part_keys = _merged_state(model_parts, optimizers)
    dcp.load(state, checkpoint_id=str(checkpoint_path(checkpoint_dir, step)))
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    for part, optimizer, (model_keys, optim_keys) in zip(
        model_parts, optimizers, part_keys, strict=True
    ):
        # DCP replaces non-tensor entries (lr, betas, step counts) in ``state`` rather than
        # loading in place, so rebuild each part's dicts from the loaded merged dict.
        set_state_dict(
            part,
            optimizer,
            model_state_dict={k: state[f"model.{k}"] for k in model_keys},
            optim_state_dict={k: state[f"optim.{k}"] for k in optim_keys},
            options=options,
        )
