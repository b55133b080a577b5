"""The training process of ``autopar run`` (``python -m autopar.runtime.worker ARGS``).

``ARGS`` is a JSON file the launcher wrote (``WorkerArgs``). Every rank builds the model from the
run's seed on its real device, applies the plan, trains with AdamW at a constant learning rate on
seeded synthetic tokens (``data.py``), checkpoints every K steps (``checkpoint.py``), and resumes
from the newest checkpoint whose manifest verifies when one exists (``--resume``, or a torchrun
restart after a fault). The local rank 0 of every node appends one JSON line per step to the
node's result file (loss, step time, peak memory); the launcher reads it.

Peak memory is the peak of live tensor bytes on the rank (``LiveTensorBytes``, a counting
``TorchDispatchMode``), reported as the largest over ranks; on CUDA it is
``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from autopar.errors import AutoparError
from autopar.graph.inputs import own_batches
from autopar.runtime import checkpoint
from autopar.runtime.data import step_seed, synthetic_batch

__all__ = [
    "LEARNING_RATE", "WEIGHT_DECAY", "LiveTensorBytes", "NoUsableCheckpointError", "WorkerArgs",
    "build_model", "main",
]

# AdamW settings of ``autopar run``: constant (no dependence on --steps, so a run resumed up to
# step N equals an uninterrupted run of N steps) and no warm-up.
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 0.01
# Environment hook for fault tests: "RANK:STEP:MARKER" makes RANK exit with code 1 at the start of
# STEP, once (the marker file records that it happened, so the restarted group does not repeat it).
FAULT_ENV = "AUTOPAR_TEST_FAIL_AT"


class NoUsableCheckpointError(AutoparError):
    """The checkpoint directory holds checkpoints but none verifies (the same on every rank)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerArgs:
    """What the launcher tells every worker (the JSON args file).

    Attributes:
        plan: the Plan as ``Plan.to_dict()``.
        model: how to build the model (``gpt:layers=...``, a preset, a model file, an HF config).
        steps: total optimizer steps (a resumed run continues up to this step).
        seed: seed of the weights and of the synthetic data.
        checkpoint_dir: where checkpoints go ("" for none).
        checkpoint_every: checkpoint every K steps (0: only at the end when checkpoint_dir is set).
        seq_len: tokens per synthetic sequence.
        vocab: vocabulary size of the synthetic tokens.
        result_path: JSON-lines file the node's local rank 0 appends its per-step results to.
        device_type: "cpu" (gloo) or "cuda" (NCCL).
        pg_timeout_s: process-group timeout; a hung collective fails after this long.
        trust_checkpoint: load a checkpoint without a manifest (``--trust-checkpoint``).
    """

    plan: dict[str, Any]
    model: str
    steps: int
    seed: int
    checkpoint_dir: str
    checkpoint_every: int
    seq_len: int
    vocab: int
    result_path: str
    device_type: str
    pg_timeout_s: float
    trust_checkpoint: bool = False

    def to_json(self) -> str:
        """The args as JSON text."""
        return json.dumps({f: getattr(self, f) for f in self.__slots__}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> WorkerArgs:
        """Inverse of ``to_json``."""
        return cls(**json.loads(text))


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages created under it and keeps their peak.

    Every storage an operator returns is counted once, at its size when first seen, until Python
    frees it (a weakref finalizer). Build the model under the mode so parameters, gradients and
    optimizer state are all counted. DTensors count their local shard. Storages resized in place
    (``UntypedStorage.resize_``, which no operator dispatch sees: FSDP2 frees and re-allocates
    its unsharded parameters that way) are followed by wrapping ``resize_`` while the mode is
    active, as torch's own ``torch.distributed._tools.mem_tracker.MemTracker`` does.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}
        self._orig_resize: Any = None

    def __enter__(self) -> LiveTensorBytes:
        self._orig_resize = torch.UntypedStorage.resize_
        orig, sizes = self._orig_resize, self._sizes

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = orig(storage, size)
            key = storage._cdata
            if key in sizes:
                new = storage.nbytes()
                self.current_bytes += new - sizes[key]
                sizes[key] = new
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def _release(self, key: int) -> None:
        self.current_bytes -= self._sizes.pop(key, 0)

    def _track(self, value: Any) -> None:
        local = getattr(value, "_local_tensor", value)
        if not isinstance(local, torch.Tensor) or local.device.type == "meta":
            return
        storage = local.untyped_storage()
        key = storage._cdata
        if key in self._sizes:
            return
        nbytes = storage.nbytes()
        self._sizes[key] = nbytes
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(storage, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            self._track(leaf)
        return out


class _Optimizers:
    """One AdamW per model part, stepped together (AdamW is per parameter, so this equals one
    optimizer over all parts; per-part optimizers let DCP map parameters to FQNs per part)."""

    def __init__(self, model_parts: list[torch.nn.Module]) -> None:
        self.optimizers = [
            torch.optim.AdamW(p.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
            for p in model_parts
        ]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Job:
    """The parallelized model of this rank and how to train it one step."""

    model_parts: list[torch.nn.Module]
    step: Callable[[int, _Optimizers], float]
    global_batch: int
    seq_len: int
    vocab: int
    tied: tuple[str, str] | None = None  # a tied weight's FQNs, split over pp (checkpoint.py)


def _build_job(args: WorkerArgs, device: torch.device) -> _Job:
    """Build the model from the run's seed on ``device`` and apply the plan (``apply_plan``)."""
    from autopar.plan import Plan
    from autopar.runtime.apply import apply_plan
    from autopar.runtime.mesh import build_mesh, random_ops_seed
    from autopar.runtime.step import local_batch, train_step

    plan = Plan.from_dict(args.plan)
    model = build_model(args.model, device=device, seed=args.seed)
    file_batch = _model_file_batches(args.model)
    loss_fn = file_batch.loss_fn if file_batch is not None else None
    pmodel = apply_plan(model, plan, build_mesh(plan, device.type), loss_fn=loss_fn)

    def step(index: int, optimizers: _Optimizers) -> float:
        if file_batch is not None:
            # The model file's own batch: its inputs and what its loss_fn reads.
            raw = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t,
                           file_batch.make(seed=args.seed, step=index,
                                           batch=plan.config.global_batch))
            inputs = targets = local_batch(pmodel, raw)
        else:
            batch = synthetic_batch(seed=args.seed, step=index, batch=plan.config.global_batch,
                                    seq_len=args.seq_len, vocab=args.vocab)
            inputs = local_batch(pmodel, batch.tokens.to(device))
            targets = local_batch(pmodel, batch.labels.to(device))
        # The step's random ops (dropout) from (seed, step), after the batch (whose seeding
        # reaches the CUDA generators too): a resumed run draws the same masks, and the ranks
        # of a tp group draw the same ones (mesh.random_ops_seed).
        torch.manual_seed(random_ops_seed(pmodel.mesh, step_seed(args.seed, index)))
        return train_step(pmodel, inputs, targets, optimizers)

    return _Job(model_parts=list(pmodel.model_parts), step=step,
                global_batch=plan.config.global_batch, seq_len=args.seq_len, vocab=args.vocab,
                tied=pmodel.tied.fqns if pmodel.tied is not None else None)


@dataclass(frozen=True, slots=True, kw_only=True)
class _FileBatches:
    """A model file's data: seeded ``example_inputs(global_batch)`` and the loss that reads it."""

    example_inputs: Callable[[int], Any]
    loss_fn: Callable[[Any, Any], torch.Tensor]

    def make(self, *, seed: int, step: int, batch: int) -> Any:
        """The global batch of ``step``: a pure function of (seed, step), like synthetic data."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(step_seed(seed, step))
            return self.example_inputs(batch)


def _model_file_batches(model_text: str) -> _FileBatches | None:
    """How a model file trains, or None for synthetic tokens and the LM default loss.

    A file with ``loss_fn(output, batch)`` trains on its own ``example_inputs`` batches; so does a
    file without one whose inputs are not token ids (one 2-D integer tensor), with the model's
    own ``output.loss`` (or the LM default on its logits). A token model without ``loss_fn``
    trains on the synthetic tokens.
    """
    if not model_text.endswith(".py"):
        return None
    from autopar.models import load_model_file

    mf = load_model_file(model_text)
    if not own_batches(mf.example_inputs, mf.loss_fn):
        return None
    return _FileBatches(example_inputs=mf.example_inputs, loss_fn=mf.loss_fn or _own_loss)


def pipeline_batch_problem(model_text: str, profile: Any, pp: int) -> str:
    """Why a run of ``model_text`` (profiled as ``profile``) at ``pp`` pipeline ranks cannot be
    pipelined by autopar's runtime ("" when it can): ``ModelProfile.pp_blocker``, the
    planner's rule (a model file trained on its own batches, a weight two blocks share)."""
    if pp <= 1 or not profile.pp_blocker:
        return ""
    return (f"autopar's runtime cannot pipeline {model_text}: {profile.pp_blocker}; run it at "
            "pp 1 (--dp, --tp, --zero)")


def _own_loss(output: Any, _batch: Any) -> torch.Tensor:
    # A model file without loss_fn whose inputs are not tokens: the model's own ``output.loss``.
    own = getattr(output, "loss", None)
    if own is None and isinstance(output, dict):
        own = output.get("loss")
    if not isinstance(own, torch.Tensor):
        raise AutoparError(
            f"the model returned {type(output).__name__} without a loss and its inputs are not "
            "token ids; define loss_fn(output, batch) in the model file"
        )
    return own


def build_model(model_text: str, *, device: str | torch.device, seed: int | None = None
                ) -> torch.nn.Module:
    """Build the model ``model_text`` names, as ``autopar run`` does on every rank.

    Args:
        model_text: ``gpt:layers=...``, a zoo preset, a ``.py`` model file, an HF config JSON.
        device: "meta" for planning and dry runs, the rank's device for training.
        seed: weights seed on a real device (the same seed gives the same weights everywhere).

    Returns:
        The fp32 model.
    """
    from autopar.models import resolve_model

    builder, _ = resolve_model(model_text)
    return builder(device=device) if seed is None else builder(device=device, seed=seed)


def _init_process_group(args: WorkerArgs) -> torch.device:
    from autopar.runtime.mesh import backend_of

    backend = backend_of(args.device_type)
    if args.device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=args.pg_timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return device
    # NOTE: torchrun's agent keeps one TCPStore for all restarts of the group, and the workers'
    # keys carry no attempt prefix: after a restart a rank can read a dead peer's gloo address
    # from the previous attempt ("Connection refused"). Prefix the store with the restart count.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    world_size = int(os.environ["WORLD_SIZE"])
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
        is_master=False, timeout=timeout,
    )
    store = dist.PrefixStore(f"autopar/attempt_{attempt}", client)
    dist.init_process_group(
        backend, store=store, rank=int(os.environ["RANK"]), world_size=world_size,
        timeout=timeout,
    )
    return device


def _maybe_fail(step: int) -> None:
    """The fault-test hook (see ``FAULT_ENV``): exit hard, once, at the start of a step."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    rank_text, step_text, marker = spec.split(":", 2)
    if dist.get_rank() == int(rank_text) and step == int(step_text) and not Path(marker).exists():
        Path(marker).write_text(f"rank {rank_text} exited at step {step}\n")
        print(f"[autopar] fault injected: rank {rank_text} exits at step {step}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)


def _append_result(args: WorkerArgs, record: dict[str, Any]) -> None:
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    with open(args.result_path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


# Live tensor bytes are counted from the model build through this many training steps of a
# launch: by then parameters, gradients, optimizer state and a step's activations have all been
# allocated, so the peak is reached; later steps run without the counting mode's overhead, so
# their step times are the plain ones.
TRACKED_STEPS = 2


def _train(args: WorkerArgs, device: torch.device, tracker: LiveTensorBytes | None) -> None:
    tracking = tracker is not None
    if tracking:
        tracker.__enter__()
    try:
        job = _build_job(args, device)
        optimizers = _Optimizers(job.model_parts)
        start = _resume(args, job, optimizers)
        if dist.get_rank() == 0:
            print(f"[autopar] training steps {start + 1}..{args.steps}", file=sys.stderr)
        for step in range(start + 1, args.steps + 1):
            _maybe_fail(step)
            t0 = time.perf_counter()
            loss = job.step(step, optimizers)
            step_time_s = time.perf_counter() - t0
            if tracking and step >= start + TRACKED_STEPS:
                tracker.__exit__(None, None, None)
                tracking = False
            _append_result(args, {
                "step": step, "loss": float(loss), **_step_figures(device, tracker, step_time_s),
            })
            if args.checkpoint_dir and (
                step == args.steps or (args.checkpoint_every and step % args.checkpoint_every == 0)
            ):
                checkpoint.save_checkpoint(
                    args.checkpoint_dir, step, job.model_parts, optimizers.optimizers,
                    marker={"world_size": dist.get_world_size(), "config": args.plan["config"]},
                    tied=job.tied,
                )
    finally:
        if tracking:
            tracker.__exit__(None, None, None)
    _append_result(args, {"done": True, "world_size": dist.get_world_size()})


def _resume(args: WorkerArgs, job: _Job, optimizers: _Optimizers) -> int:
    """Load the newest checkpoint that verifies (collective); the step it was taken after.

    The launcher checked the directory and printed what it skipped before the first attempt;
    after a torchrun restart rank 0 says it here.

    Raises:
        NoUsableCheckpointError: checkpoints exist but none verifies (nor is trusted).
    """
    if not args.checkpoint_dir:
        return 0
    point = checkpoint.load_latest_checkpoint(
        args.checkpoint_dir, job.model_parts, optimizers.optimizers, trust=args.trust_checkpoint,
        tied=job.tied,
    )
    if point.step is None and point.skipped:
        raise NoUsableCheckpointError(point.refusal(args.checkpoint_dir))
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if point.note() and restarted and dist.get_rank() == 0:
        print(f"autopar: note: {point.note()}", file=sys.stderr)
    return point.step or 0


def _step_figures(
    device: torch.device, tracker: LiveTensorBytes | None, step_time_s: float
) -> dict[str, Any]:
    """The slowest rank's step time and every rank's peak memory (two small all-reduces)."""
    step_time = torch.tensor([step_time_s], dtype=torch.float64, device=device)
    dist.all_reduce(step_time, op=dist.ReduceOp.MAX)
    peaks = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    peaks[dist.get_rank()] = float(_peak_bytes(device, tracker))
    dist.all_reduce(peaks, op=dist.ReduceOp.SUM)
    per_rank = [int(x) for x in peaks.tolist()]
    return {
        "step_time_s": float(step_time[0]),
        "peak_memory_bytes": max(per_rank),
        "peak_memory_bytes_per_rank": per_rank,
    }


def _peak_bytes(device: torch.device, tracker: LiveTensorBytes | None) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return tracker.peak_bytes if tracker is not None else 0


def main(argv: list[str] | None = None) -> None:
    """Run one worker: ``python -m autopar.runtime.worker ARGS_JSON``; exits the process."""
    argv = sys.argv[1:] if argv is None else argv
    args = WorkerArgs.from_json(Path(argv[0]).read_text())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    device = _init_process_group(args)
    tracker = LiveTensorBytes() if device.type == "cpu" else None
    try:
        _train(args, device, tracker)
    except NoUsableCheckpointError as err:
        # Every rank reached the same verdict (the check is collective): one line, exit 2.
        if dist.get_rank() == 0:
            print(f"autopar: error: {' '.join(str(err).split())}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)
    # Clean exit (runtime notes): without it TP processes can abort during interpreter shutdown.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
