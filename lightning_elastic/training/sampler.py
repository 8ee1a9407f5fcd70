"""``ElasticSampler``: each sample of an epoch once in the committed history, across resets.

The epoch's order is a permutation fixed by (seed, epoch). The sampler's state is two
numbers, the epoch and how many samples of that order the committed history consumed, so
it commits and syncs with the rest of the state. After a reset it splits what is left
of the epoch over the new world: rank r takes positions r, r+W, r+2W, ... of the remainder,
so after every rank has processed n samples, exactly the first n*W positions are consumed.

So that every rank runs the same number of steps, a rank whose share is one short repeats
one sample of the epoch's final step (at most W-1 repeats per epoch, as torch's
DistributedSampler does). Those repeats lie past the end of the remainder, so they are
never counted as consumed: the committed history holds each sample exactly once.

Given a ``batch_size`` (the Lightning integration does), ``len()`` describes the whole
epoch at the current world size, ``ceil(N / (W * batch_size))`` batches, of which
``batches_before_pass()`` lie behind the current pass: a training loop that counts batches
per epoch keeps counting from there after a reset and ends the epoch on time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from lightning_elastic import api
from lightning_elastic.membership.worker import ElasticWorker


class ElasticSampler(Sampler[int]):
    """Each sample of an epoch once in the committed history, across any number of resets.

    ``ElasticSampler(dataset, shuffle=True, seed=0)`` for a ``DataLoader``'s ``sampler``:
    call ``set_epoch(epoch)`` at the start of every epoch and ``record_batch(batch_idx,
    batch_size)`` after every step, and give it to ``TorchState(..., sampler=sampler)`` so
    that its position is committed with the model. After a reset it splits what is left of
    the epoch over the new world. ``worker`` defaults to the one ``le.init()`` made (a world
    of one before it); ``batch_size`` makes ``len()`` count the epoch's batches at the
    current world size (the Lightning and Fabric integrations install one themselves).
    """

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool = True,
        seed: int = 0,
        worker: ElasticWorker | None = None,
        batch_size: int | None = None,
    ) -> None:
        self.dataset_size = len(dataset)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self._worker = worker
        self.epoch = 0
        self.consumed = 0  # positions of this epoch's order consumed before this pass
        self._processed = 0  # samples this rank processed in this pass (from record_batch)
        self._pass_world = 1  # world size of the current pass: what _processed is counted in
        self._real_share = 0  # this rank's samples in the current pass, padding excluded

    # state: what commit/sync carry ------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed_total()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        self._processed = 0

    # what the training loop calls -------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (call at the start of every epoch)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0
            self._processed = 0

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record that this pass's batches 0..batch_idx of ``batch_size`` have been processed."""
        self._processed = (batch_idx + 1) * batch_size

    def real_in_batch(self, batch_idx: int, batch_size: int) -> int:
        """How many samples of this pass's batch ``batch_idx`` are not padding repeats."""
        return max(0, min(batch_size, self._real_share - batch_idx * batch_size))

    def consumed_total(self) -> int:
        return min(self.dataset_size, self.consumed + self._processed * self._pass_world)

    def remaining(self) -> list[int]:
        return self._order()[self.consumed_total():]

    # Sampler ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        # A new pass (first, or after a reset): what was processed is now consumed.
        self.consumed = self.consumed_total()
        self._processed = 0
        self._pass_world = self._world()[1]
        return iter(self._share())

    def __len__(self) -> int:
        left = self.dataset_size - self.consumed
        world = self._world()[1]
        per_rank = -(-left // world) if left > 0 else 0
        if self.batch_size is None:
            return per_rank
        return self.batches_before_pass() * self.batch_size + per_rank

    def batches_before_pass(self) -> int:
        """Batches of this epoch behind the current pass, counted at the current world size."""
        if self.batch_size is None:
            raise ValueError("batches_before_pass() needs the sampler's batch_size")
        return epoch_batches_done(self.dataset_size, self.consumed, self._world()[1], self.batch_size)

    def _share(self) -> list[int]:
        rank, world = self._world()
        rest = self._order()[self.consumed:]
        if not rest:
            self._real_share = 0
            return []
        share = rest[rank::world]
        self._real_share = len(share)
        per_rank = -(-len(rest) // world)
        if len(share) < per_rank:  # pad from the epoch's final step; never counted as consumed
            share.append(rest[-1 - (rank % len(rest))])
        return share

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_size))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=g).tolist()

    def _world(self) -> tuple[int, int]:
        worker = self._worker if self._worker is not None else api.initialised_worker()
        if worker is None:
            return 0, 1
        a = worker.assignment
        return a.rank, a.size


def epoch_batches_done(dataset_size: int, consumed: int, world: int, batch_size: int) -> int:
    """Batches of an epoch done once ``consumed`` samples are, counted at world size ``world``.

    Chosen so that done + what the remaining samples need = ceil(N / (W * B)): the epoch
    keeps its length in batches at the current world size, whatever world sizes came before.
    """
    full = -(-dataset_size // (world * batch_size))
    left = max(0, dataset_size - consumed)
    left_per_rank = -(-left // world)
    return full - (-(-left_per_rank // batch_size))
