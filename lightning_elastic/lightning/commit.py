"""The in-memory commit of a Lightning run, and how a new world agrees on one.

A commit is Lightning's full checkpoint dict (model, optimizers, LR schedulers, loops with
mid-epoch progress, callbacks) copied into host memory, plus what Lightning's checkpoint
leaves out and an elastic restart needs: RNG states, the elastic sampler's position and the
world size it was taken at.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from lightning_elastic.lightning import compat
from lightning_elastic.sampler import epoch_batches_done
from lightning_elastic.state import broadcast_object, to_host
from lightning_elastic.worker import ElasticWorker

# The ``ckpt_path`` the fit launcher passes to Lightning to mean "the agreed commit".
COMMIT_MARKER = "lightning-elastic:in-memory-commit"
# Where our additions live inside the checkpoint dict.
EXTRA_KEY = "lightning_elastic"


@dataclasses.dataclass(frozen=True)
class SamplerPosition:
    """Where the elastic training sampler stood when the commit was taken."""

    epoch: int
    consumed: int
    dataset_size: int
    batch_size: int


@dataclasses.dataclass(frozen=True)
class Commit:
    checkpoint: dict[str, Any]  # host-memory copy, never handed to Lightning directly
    world_size: int
    global_step: int

    @property
    def sampler(self) -> SamplerPosition | None:
        raw = self.checkpoint[EXTRA_KEY].get("sampler")
        return SamplerPosition(**raw) if raw else None


def take_commit(
    checkpoint: dict[str, Any], world_size: int, global_step: int, sampler: SamplerPosition | None
) -> Commit:
    """Copy a live checkpoint dict into host memory, with RNG states and sampler position."""
    host = to_host(checkpoint)
    host[EXTRA_KEY] = {
        "world_size": world_size,
        "rng": to_host(compat.collect_rng_states()),
        "sampler": dataclasses.asdict(sampler) if sampler else None,
    }
    return Commit(host, world_size, global_step)


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """What every rank of a new round agreed to resume from."""

    source_rank: int | None  # the rank whose commit all ranks load; None: nothing committed yet
    logger_versions: list[Any]


def agree_on_restore(worker: ElasticWorker, commit: Commit | None, logger_versions: list[Any]) -> RestorePlan:
    """Pick the newest commit in the world (lowest rank on ties) and share the logger versions.

    Every survivor holds a commit of the same step, except when a peer died between two
    ranks taking theirs; taking the newest one then loses nothing. Joiners hold none.
    """
    size = worker.assignment.size
    step = torch.tensor([commit.global_step if commit else -1], dtype=torch.int64, device=worker.device)
    if size > 1:
        steps = [torch.zeros_like(step) for _ in range(size)]
        dist.all_gather(steps, step)
        values = [int(s.item()) for s in steps]
    else:
        values = [int(step.item())]
    newest = max(values)
    source = values.index(newest) if newest >= 0 else None
    versions = broadcast_object(logger_versions, worker, src=source or 0)
    return RestorePlan(source, versions)


def receive_commit(worker: ElasticWorker, commit: Commit | None, source_rank: int) -> Commit:
    """The source rank's commit on every rank (joiners get everything from here)."""
    payload = commit.checkpoint if worker.assignment.rank == source_rank and commit else None
    checkpoint = broadcast_object(payload, worker, src=source_rank)
    extra = checkpoint[EXTRA_KEY]
    step = checkpoint.get("global_step", 0)
    return Commit(checkpoint, int(extra["world_size"]), int(step))


def checkpoint_for_lightning(commit: Commit, world_size: int) -> dict[str, Any]:
    """A copy of the commit for Lightning to load, its epoch progress rescaled to ``world_size``.

    The loops count batches of the current epoch at the world size they ran at; the sampler
    counts samples. After a world size change the batch count is re-expressed at the new
    world size so the epoch ends when its samples are used up, no sooner and no later.
    """
    checkpoint = copy.deepcopy(commit.checkpoint)
    extra = checkpoint.pop(EXTRA_KEY)
    compat.set_rng_states(extra["rng"])
    position = commit.sampler
    progress = compat.batch_progress(checkpoint)
    if position is not None and progress is not None:
        done_now = epoch_batches_done(position.dataset_size, position.consumed, world_size, position.batch_size)
        delta = done_now - int(progress["current"]["ready"])
        for counters in (progress["current"], progress["total"]):
            for key in ("ready", "started", "processed", "completed"):
                counters[key] = max(0, int(counters[key]) + delta)
    return checkpoint
