"""The in-memory commit of a Lightning run, and how a new world agrees on one.

A commit is a checkpoint dict as Lightning loads it (model, optimizers, LR schedulers,
loops with mid-epoch progress, callbacks) copied into host buffers that are reused
(``lightning_elastic.commit.buffers``), plus what Lightning's checkpoint leaves out and an elastic
restart needs: RNG states, the elastic sampler's position and the world size it was taken
at. A new world agrees on the newest commit and its source rank sends it to every rank
tensor by tensor (``lightning_elastic.commit.transfer``).
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import torch

from lightning_elastic.commit import collectives
from lightning_elastic.lightning import compat
from lightning_elastic.training.sampler import epoch_batches_done
from lightning_elastic.commit.buffers import Committed, HostSnapshot, join, split
from lightning_elastic.durable.files import SnapshotError
from lightning_elastic.durable.store import SnapshotInfo, read_tree
from lightning_elastic.training.state import broadcast_object
from lightning_elastic.commit.transfer import broadcast_commit
from lightning_elastic.membership.worker import ElasticWorker

# The ``ckpt_path`` the fit launcher passes to Lightning to mean "the agreed commit".
COMMIT_MARKER = "lightning-elastic:in-memory-commit"
# Where Lightning's checkpoint keeps the model's weights.
MODEL_KEY = "state_dict"
# The commit's copy of the callback metrics already computed (what a plateau scheduler or a
# callback monitors): Lightning's checkpoint leaves them out, and empties them at a fit start.
METRICS_KEY = "lightning_elastic_metrics"


@dataclasses.dataclass(frozen=True)
class SamplerPosition:
    """Where the elastic training sampler stood when the commit was taken."""

    epoch: int
    consumed: int
    dataset_size: int
    batch_size: int


@dataclasses.dataclass(frozen=True)
class CommitInfo:
    """What is known of a commit without reading its tensors."""

    world_size: int
    global_step: int
    sampler: SamplerPosition | None
    rng: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)  # fresh objects, never changed


def take_commit(
    snapshot: HostSnapshot, checkpoint: dict[str, Any], world_size: int, global_step: int,
    sampler: SamplerPosition | None,
) -> None:
    """Commit a live checkpoint dict, with the RNG states, into ``snapshot``'s host buffers."""
    skeleton, sources = split(checkpoint)
    take_split_commit(snapshot, skeleton, sources, world_size, global_step, sampler)


def take_split_commit(
    snapshot: HostSnapshot, skeleton: Any, sources: list[torch.Tensor], world_size: int, global_step: int,
    sampler: SamplerPosition | None,
) -> None:
    """``take_commit`` of a checkpoint already split (``capture.CheckpointCapture``)."""
    snapshot.capture_split(skeleton, sources, CommitInfo(world_size, global_step, sampler, compat.collect_rng_states()))


def commit_info(snapshot: HostSnapshot) -> CommitInfo | None:
    committed = snapshot.committed()
    return None if committed is None else committed.meta


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """What every rank of a new round agreed to resume from."""

    source_rank: int | None  # the rank whose commit all ranks load; None: nothing committed yet
    logger_versions: list[Any]
    callbacks_state: dict[str, Any] = dataclasses.field(default_factory=dict)  # the source's, for every rank


def agree_on_restore(worker: ElasticWorker, snapshot: HostSnapshot, logger_versions: list[Any],
                     callbacks_state: dict[str, Any] | None = None) -> RestorePlan:
    """Pick the newest commit in the world (lowest rank on ties) and share the logger versions
    and the callbacks' per-process state that decides collectives (``compat.callbacks_deciding_state``).

    Survivors may hold commits of different steps: with commits paced by their cost (the
    default) each rank picks its own steps, and a peer may die between two ranks taking
    theirs. Every commit is a whole, consistent state; the newest one loses least. Joiners
    hold none.
    """
    size = worker.assignment.size
    info = commit_info(snapshot)
    step = torch.tensor([info.global_step if info else -1], dtype=torch.int64, device=worker.device)
    if size > 1:
        values = [int(s.item()) for s in collectives.all_gather(step, worker.device, worker.wait_collective)]
    else:
        values = [int(step.item())]
    newest = max(values)
    source = values.index(newest) if newest >= 0 else None
    versions, callbacks = broadcast_object((logger_versions, callbacks_state or {}), worker, src=source or 0)
    return RestorePlan(source, versions, callbacks)


def receive_commit(worker: ElasticWorker, snapshot: HostSnapshot, source_rank: int) -> Committed:
    """The source rank's commit in every rank's ``snapshot`` (joiners get everything from here)."""
    a = worker.assignment
    return broadcast_commit(snapshot, a.rank, a.size, source_rank, worker.device, wait=worker.wait_collective)


def checkpoint_for_lightning(committed: Committed, world_size: int) -> dict[str, Any]:
    """The commit as a checkpoint dict for Lightning to load, its epoch progress rescaled to ``world_size``.

    Model weights are handed out as the commit's own buffers: loading copies them into the
    parameters. Everything else is a copy (an optimizer keeps the tensors it is given).

    The loops count batches of the current epoch at the world size they ran at; the sampler
    counts samples. After a world size change the batch count is re-expressed at the new
    world size so the epoch ends when its samples are used up, no sooner and no later. A
    commit of an epoch's last batch resumes at the next epoch's start (``compat.finish_epoch``).
    """
    checkpoint = {
        key: join(part, committed.tensors, clone=key != MODEL_KEY) for key, part in committed.skeleton.items()
    }
    return resume_checkpoint(checkpoint, committed.meta, world_size)


def resume_checkpoint(checkpoint: dict[str, Any], info: CommitInfo, world_size: int) -> dict[str, Any]:
    """``checkpoint`` (a commit's Lightning checkpoint dict, changed in place) made ready for
    Lightning to resume at ``world_size``: the commit's RNG states set, its epoch progress
    rescaled (``checkpoint_for_lightning`` says how)."""
    compat.set_rng_states(info.rng)
    position = info.sampler
    progress = compat.batch_progress(checkpoint)
    if position is not None and progress is not None:
        done_now = epoch_batches_done(position.dataset_size, position.consumed, world_size, position.batch_size)
        delta = done_now - int(progress["current"]["ready"])
        for counters in (progress["current"], progress["total"]):
            # A commit is taken at a batch end, where Lightning has processed the batch but
            # counts it completed only when it resumes. The gap is kept, even below zero:
            # rescaled to the start of the epoch, "completed" is -1 and becomes 0 on resuming,
            # so the next batch is the epoch's first (a clamp at 0 would skip one).
            gap = int(counters["processed"]) - int(counters["completed"])
            for key in ("ready", "started", "processed"):
                counters[key] = max(0, int(counters[key]) + delta)
            counters["completed"] = counters["processed"] - gap
    compat.finish_epoch(checkpoint)
    return checkpoint


# The top-level key of a durable snapshot that holds what Lightning's checkpoint leaves out.
SNAPSHOT_KEY = "lightning_elastic"


def snapshot_info(snapshot: HostSnapshot, round_: int, epoch: int) -> SnapshotInfo:
    """The manifest's numbers for the newest commit, and what its file must carry besides
    Lightning's checkpoint (world size, sampler position, RNG states) to resume elastically."""
    committed = snapshot.committed()
    assert committed is not None
    info: CommitInfo = committed.meta
    position = info.sampler
    extra = {SNAPSHOT_KEY: {
        # Pickled: numpy's RNG state would make the file fail torch.load(weights_only=True),
        # which load_from_checkpoint uses; bytes pass it.
        "world_size": info.world_size, "global_step": info.global_step, "rng": pickle.dumps(info.rng),
        "sampler": dataclasses.asdict(position) if position is not None else None,
    }}
    return SnapshotInfo(
        round=round_, step=info.global_step, epoch=epoch, world_size=info.world_size,
        sampler={"epoch": position.epoch, "consumed": position.consumed} if position is not None else None,
        kind="lightning", extra=extra,
    )


def load_snapshot_commit(snapshot: HostSnapshot, path: Any) -> None:
    """Make the durable snapshot at ``path`` the commit in ``snapshot`` (rank 0 of a new job)."""
    checkpoint = read_tree(path)
    extra = checkpoint.pop(SNAPSHOT_KEY, None) if isinstance(checkpoint, dict) else None
    if not isinstance(extra, dict) or "state_dict" not in checkpoint:
        raise SnapshotError(f"{path}: not a snapshot of an elastic_hvd Trainer (written by le.TorchState or "
                            "another program?)")
    sampler = SamplerPosition(**extra["sampler"]) if extra.get("sampler") else None
    rng = pickle.loads(extra["rng"]) if isinstance(extra.get("rng"), bytes) else {}  # noqa: S301 - our own file
    snapshot.capture(checkpoint, CommitInfo(int(extra["world_size"]), int(extra["global_step"]), sampler, rng))
