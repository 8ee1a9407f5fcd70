"""``ElasticSampling``: the elastic training sampler on a Trainer strategy, and the reset hooks.

Shared by both Trainer strategies (``elastic_hvd``, ``elastic_fsdp``): whatever the model's
parallelism, every rank of a round reads a disjoint share of what is left of the epoch, and
a commit carries the sampler's position (``SamplerPosition``) so that a new world resumes
with each sample once in the committed history.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

import lightning.pytorch as pl
from lightning_elastic.lightning import compat
from lightning_elastic.lightning.commit import SamplerPosition
from lightning_elastic.membership.worker import ElasticWorker
from lightning_elastic.training.sampler import ElasticSampler


class ElasticSampling:
    """Mixed into a Trainer strategy before Lightning's class; ``_init_sampling()`` in its constructor."""

    worker: ElasticWorker
    lightning_module: Any

    def _init_sampling(self) -> None:
        self._sampler: ElasticSampler | None = None
        # Where the sampler of the next training loader starts: set when a fit attempt loads a commit.
        self._pending_sampler: SamplerPosition | None = None

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.worker.assignment.size, "rank": self.worker.assignment.rank}

    def sampler_position(self) -> SamplerPosition | None:
        """Where the training sampler stands now (for a commit); None without an elastic sampler."""
        sampler = self._sampler
        if sampler is None or sampler.batch_size is None:
            return None
        return SamplerPosition(epoch=sampler.epoch, consumed=sampler.consumed_total(),
                               dataset_size=sampler.dataset_size, batch_size=sampler.batch_size)

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or not isinstance(dataloader, DataLoader):
            return dataloader
        order = _sampling_order(dataloader)
        if order is None:
            rank_zero_warn(_unsampled_warning(dataloader))
            return dataloader
        shuffle, seed = order
        sampler = ElasticSampler(
            dataloader.dataset, shuffle=shuffle, seed=seed, worker=self.worker, batch_size=dataloader.batch_size
        )
        if self._pending_sampler is not None:
            sampler.load_state_dict({"epoch": self._pending_sampler.epoch, "consumed": self._pending_sampler.consumed})
            self._pending_sampler = None
        self._sampler = sampler
        return compat.replace_sampler(dataloader, sampler)

    def record_batch(self, batch_idx: int) -> None:
        """Count batch ``batch_idx`` of the epoch as processed by every rank."""
        sampler = self._sampler
        if sampler is not None and sampler.batch_size is not None:
            sampler.record_batch(batch_idx - sampler.batches_before_pass(), sampler.batch_size)

    def real_samples_in_batch(self, batch_idx: int, batch_len: int) -> int:
        """How many of batch ``batch_idx``'s ``batch_len`` samples are not end-of-epoch padding.

        When the last step of an epoch has fewer samples than ranks, some ranks repeat one
        sample so that all run the same number of steps; code that counts samples exactly
        (or weighs them) can leave the repeats out with this.
        """
        sampler = self._sampler
        if sampler is None or sampler.batch_size is None:
            return batch_len
        pass_batch = batch_idx - sampler.batches_before_pass()
        return min(batch_len, sampler.real_in_batch(pass_batch, sampler.batch_size))


def _unsampled_warning(dataloader: DataLoader) -> str:
    """What a reset does to a training DataLoader the elastic sampler cannot stand in for, by name."""
    dataset = type(dataloader.dataset).__name__
    if isinstance(dataloader.dataset, IterableDataset):
        return (f"lightning-elastic: the training dataset {dataset} is an IterableDataset, whose position "
                "cannot be restored: after a reset its stream starts again from its beginning on every rank "
                "(the epoch's samples so far are repeated, and its end comes later; a run bounded by max_steps "
                "may end before it). Use a map-style Dataset for exactly-once epochs.")
    if dataloader.batch_size is None:
        what = f"batch sampler {type(dataloader.batch_sampler).__name__}"
    else:
        what = f"sampler {type(dataloader.sampler).__name__}"
    return (f"lightning-elastic: the training DataLoader of {dataset} uses the {what}, which the elastic "
            "sampler cannot stand in for: samples may be repeated or skipped across resets (use shuffle= "
            "and batch_size= with a map-style Dataset for exactly-once epochs).")


def _sampling_order(dataloader: DataLoader) -> tuple[bool, int] | None:
    """(shuffle, seed) of a training DataLoader the elastic sampler can stand in for."""
    if isinstance(dataloader.dataset, IterableDataset) or dataloader.batch_size is None:
        return None
    sampler = dataloader.sampler
    if isinstance(sampler, DistributedSampler) and type(sampler) is DistributedSampler:
        return bool(sampler.shuffle), int(sampler.seed)
    if isinstance(sampler, RandomSampler):
        return True, 0
    if isinstance(sampler, SequentialSampler):
        return False, 0
    return None


def call_reset_hooks(trainer: pl.Trainer, old_world_size: int, new_world_size: int) -> None:
    """``on_elastic_reset`` on every callback that has it, then on the LightningModule."""
    for callback in trainer.callbacks:
        hook = getattr(callback, "on_elastic_reset", None)
        if callable(hook):
            hook(trainer, trainer.lightning_module, old_world_size, new_world_size)
    hook = getattr(trainer.lightning_module, "on_elastic_reset", None)
    if callable(hook):
        hook(old_world_size, new_world_size)
