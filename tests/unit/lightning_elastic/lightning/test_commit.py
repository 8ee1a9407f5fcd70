"""lightning_elastic/lightning/commit.py: taking a commit, agreeing on one, rescaling its progress.

Checkpoints here are dicts shaped like Lightning's (``loops.fit_loop`` holding the epoch
loop's ``batch_progress``); one test checks that shape against a real Trainer's fit loop.
``agree_on_restore`` and ``receive_commit`` run once on real gloo ranks (a module fixture:
every spawned rank imports Lightning, which is the bulk of the cost) and each scenario's
test reads its part of the result.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from lightning_elastic.lightning import compat
from lightning_elastic.lightning.commit import (
    CommitInfo,
    RestorePlan,
    SamplerPosition,
    agree_on_restore,
    checkpoint_for_lightning,
    receive_commit,
    take_commit,
)
from lightning_elastic.commit.buffers import Committed, HostSnapshot
from lightning_elastic.training.sampler import epoch_batches_done
from tests.unit.fakes import FakeWorker, run_ranks

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def keep_global_rng() -> Iterator[None]:
    """checkpoint_for_lightning sets the process's RNG states: put them back after each test."""
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])


def counters(ready: int, completed: int | None = None) -> dict[str, int]:
    done = ready if completed is None else completed
    return {"ready": ready, "started": ready, "processed": ready, "completed": done}


def lightning_checkpoint(current: dict[str, int], total: dict[str, int], global_step: int = 0) -> dict[str, Any]:
    """The parts of Lightning's checkpoint dict that the commit code reads, and a tensor."""
    progress = {"current": current, "total": total, "is_last_batch": False}
    return {
        "state_dict": {"weight": torch.arange(4.0)},
        "loops": {"fit_loop": {"epoch_loop.batch_progress": progress, "epoch_progress": {"epoch": 1}}},
        "global_step": global_step,
    }


def position(consumed: int, dataset_size: int = 100, batch_size: int = 5, epoch: int = 1) -> SamplerPosition:
    return SamplerPosition(epoch=epoch, consumed=consumed, dataset_size=dataset_size, batch_size=batch_size)


def progress_of(checkpoint: dict[str, Any]) -> dict[str, Any]:
    return checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]


def commit_of(
    checkpoint: dict[str, Any], world_size: int, global_step: int, sampler: SamplerPosition | None,
    snapshot: HostSnapshot | None = None,
) -> Committed:
    snapshot = snapshot or HostSnapshot()
    take_commit(snapshot, checkpoint, world_size, global_step, sampler)
    committed = snapshot.committed()
    assert committed is not None
    return committed


# ----- take_commit ------------------------------------------------------------------------


def test_take_commit_records_world_size_step_sampler_position_and_rng_states():
    live = lightning_checkpoint(counters(4), counters(24), global_step=24)
    commit = commit_of(live, world_size=2, global_step=24, sampler=position(consumed=40))
    assert commit.meta == CommitInfo(world_size=2, global_step=24, sampler=position(consumed=40))
    assert set(commit.meta.rng) >= {"torch", "python", "numpy"}


def test_take_commit_without_a_sampler_records_none():
    commit = commit_of(lightning_checkpoint(counters(1), counters(1)), world_size=1, global_step=1, sampler=None)
    assert commit.meta.sampler is None


def test_take_commit_copies_the_live_checkpoint_and_leaves_it_alone():
    live = lightning_checkpoint(counters(4), counters(24))
    commit = commit_of(live, world_size=2, global_step=24, sampler=None)
    assert set(live) == {"state_dict", "loops", "global_step"}
    live["state_dict"]["weight"].add_(10.0)
    progress_of(live)["current"]["ready"] = 99
    assert commit.tree()["state_dict"]["weight"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert progress_of(commit.tree())["current"]["ready"] == 4


def test_commits_into_the_same_snapshot_reuse_its_buffers():
    snapshot = HostSnapshot()
    pointers = []
    for step in range(3):
        live = lightning_checkpoint(counters(step), counters(step), global_step=step)
        pointers.append(commit_of(live, 1, step, None, snapshot).tree(clone=False)["state_dict"]["weight"].data_ptr())
    assert pointers[2] == pointers[0] != pointers[1]


def test_the_commit_restores_the_rng_states_it_was_taken_with():
    commit = commit_of(lightning_checkpoint(counters(0), counters(0)), world_size=1, global_step=0, sampler=None)
    expected = (torch.rand(3).tolist(), random.random(), np.random.rand())
    torch.rand(5), random.random(), np.random.rand(2)  # the run goes on
    checkpoint_for_lightning(commit, world_size=1)
    assert (torch.rand(3).tolist(), random.random(), np.random.rand()) == expected


# ----- checkpoint_for_lightning -----------------------------------------------------------


def test_the_checkpoint_for_lightning_is_a_copy():
    commit = commit_of(lightning_checkpoint(counters(4), counters(24)), 2, 24, position(consumed=40))
    checkpoint = checkpoint_for_lightning(commit, world_size=4)
    assert set(checkpoint) == set(commit.tree())
    progress_of(checkpoint)["total"]["ready"] = 1000
    assert progress_of(commit.tree())["current"] == counters(4)  # the commit is not rescaled
    assert progress_of(commit.tree())["total"] == counters(24)


def test_the_checkpoint_for_lightning_lends_the_model_weights_and_copies_optimizer_state():
    live = lightning_checkpoint(counters(1), counters(1))
    live["optimizer_states"] = [{"state": {0: {"momentum_buffer": torch.ones(2)}}, "param_groups": [{"lr": 0.1}]}]
    commit = commit_of(live, 1, 1, None)
    checkpoint = checkpoint_for_lightning(commit, world_size=1)
    buffers = {t.data_ptr() for t in commit.tensors}
    assert checkpoint["state_dict"]["weight"].data_ptr() in buffers  # Lightning copies it into the model
    momentum = checkpoint["optimizer_states"][0]["state"][0]["momentum_buffer"]
    assert momentum.data_ptr() not in buffers  # an optimizer adopts it: the commit must not change
    momentum.add_(1.0)
    assert commit.tree()["optimizer_states"][0]["state"][0]["momentum_buffer"].tolist() == [1.0, 1.0]


def test_the_same_world_size_keeps_the_batch_progress():
    # 4 batches of 5 at world size 2: 40 of 100 samples consumed.
    commit = commit_of(lightning_checkpoint(counters(4, 3), counters(24, 23)), 2, 24, position(consumed=40))
    progress = progress_of(checkpoint_for_lightning(commit, world_size=2))
    assert progress == {"current": counters(4, 3), "total": counters(24, 23), "is_last_batch": False}


@pytest.mark.parametrize(
    ("old_world", "batches", "new_world", "done_now"),
    [
        (2, 4, 4, 2),  # 40 of 100 consumed; at 4 ranks the epoch has 5 batches, 3 left
        (2, 4, 3, 3),  # 60 left: 20 per rank, 4 batches of 7 (ceil(100/15))
        (4, 2, 1, 8),  # 40 consumed; alone the epoch has 20 batches, 12 left
        (2, 10, 4, 5),  # the epoch's samples are used up: done at any world size
    ],
)
def test_a_new_world_size_rescales_current_and_total_batch_progress(old_world, batches, new_world, done_now):
    consumed = batches * 5 * old_world
    commit = commit_of(
        lightning_checkpoint(counters(batches, batches - 1), counters(20 + batches, 19 + batches)),
        old_world, 20 + batches, position(consumed=consumed),
    )
    progress = progress_of(checkpoint_for_lightning(commit, world_size=new_world))
    delta = done_now - batches
    assert progress["current"] == counters(batches + delta, batches - 1 + delta)
    assert progress["total"] == counters(20 + batches + delta, 19 + batches + delta)
    assert progress["is_last_batch"] is False
    assert epoch_batches_done(100, consumed, new_world, 5) == done_now  # the expectation's own arithmetic


def test_an_uneven_split_rescales_up():
    # 10 samples, batches of 2 at world size 3: one batch consumed 6 samples; 4 left.
    commit = commit_of(lightning_checkpoint(counters(1), counters(1)), 3, 1, position(6, dataset_size=10, batch_size=2))
    progress = progress_of(checkpoint_for_lightning(commit, world_size=2))
    assert progress["current"] == counters(2)  # at 2 ranks: 3 batches in the epoch, 1 left
    assert progress["total"] == counters(2)


def test_counters_never_go_below_zero():
    # A total behind current (hand-made): a counter the shift would make negative stops at zero.
    commit = commit_of(lightning_checkpoint(counters(4), counters(1)), 2, 4, position(consumed=40))
    progress = progress_of(checkpoint_for_lightning(commit, world_size=4))
    assert progress["current"] == counters(2)
    assert progress["total"] == counters(0)


def test_without_a_sampler_position_the_progress_is_kept():
    commit = commit_of(lightning_checkpoint(counters(4), counters(24)), 2, 24, sampler=None)
    progress = progress_of(checkpoint_for_lightning(commit, world_size=4))
    assert (progress["current"], progress["total"]) == (counters(4), counters(24))


def test_a_checkpoint_without_loops_is_passed_through():
    commit = commit_of({"state_dict": {}, "global_step": 3}, 2, 3, position(consumed=40))
    assert checkpoint_for_lightning(commit, world_size=4) == {"state_dict": {}, "global_step": 3}


def test_the_progress_of_a_real_fit_loop_is_found_and_rescaled():
    import lightning.pytorch as pl  # noqa: PLC0415

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    loops = trainer.fit_loop.state_dict()
    progress = loops["epoch_loop.batch_progress"]
    assert set(progress) == {"current", "total", "is_last_batch"}
    assert set(progress["current"]) == set(progress["total"]) == set(counters(0))
    progress["current"].update(counters(4))
    progress["total"].update(counters(4))
    commit = commit_of({"loops": {"fit_loop": loops}, "global_step": 4}, 2, 4, position(consumed=40))
    rescaled = compat.batch_progress(checkpoint_for_lightning(commit, world_size=4))
    assert rescaled is not None
    assert (rescaled["current"], rescaled["total"]) == (counters(2), counters(2))


# ----- agree_on_restore, receive_commit in a world of one ---------------------------------


def test_alone_without_a_commit_there_is_nothing_to_restore():
    assert agree_on_restore(FakeWorker(), HostSnapshot(), ["v1"]) == RestorePlan(None, ["v1"])


def test_alone_with_a_commit_rank_0_is_the_source():
    snapshot = HostSnapshot()
    commit_of(lightning_checkpoint(counters(1), counters(1), 7), 1, 7, None, snapshot)
    assert agree_on_restore(FakeWorker(), snapshot, ["v1"]) == RestorePlan(0, ["v1"])


def test_alone_receive_commit_gives_back_the_commit():
    snapshot = HostSnapshot()
    commit_of(lightning_checkpoint(counters(1), counters(1), global_step=7), 3, 7, position(consumed=15), snapshot)
    received = receive_commit(FakeWorker(), snapshot, source_rank=0)
    assert received.meta == CommitInfo(3, 7, position(consumed=15))
    assert received.tree()["state_dict"]["weight"].tolist() == [0.0, 1.0, 2.0, 3.0]


# ----- agree_on_restore, receive_commit across real ranks ---------------------------------

RANKS = 3
# Each rank's commit step (None: holds no commit, a joiner) -> the agreed source rank.
SCENARIOS: dict[str, tuple[list[int | None], int | None]] = {
    "newest wins, lowest rank on a tie": ([5, 7, 7], 1),
    "all tied: rank 0": ([4, 4, 4], 0),
    "nobody holds one": ([None, None, None], None),
    "only a joiner's peer holds one": ([None, 3, None], 1),
    "the newest is the last rank's": ([2, None, 9], 2),
    "step 0 counts as a commit": ([None, None, 0], 2),
}


def snapshot_at(step: int | None, rank: int) -> HostSnapshot:
    snapshot = HostSnapshot()
    if step is not None:
        checkpoint = lightning_checkpoint(counters(step), counters(step), global_step=step)
        checkpoint["state_dict"]["weight"] = torch.full((2,), float(rank))
        commit_of(checkpoint, world_size=10 + rank, global_step=step, sampler=position(consumed=rank), snapshot=snapshot)
    return snapshot


def agree_everywhere(rank: int, worker: FakeWorker) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, (steps, _) in SCENARIOS.items():
        snapshot = snapshot_at(steps[rank], rank)
        plan = agree_on_restore(worker, snapshot, [f"version of rank {rank}"])
        received = None
        if plan.source_rank is not None:
            got = receive_commit(worker, snapshot, plan.source_rank).meta
            weight = snapshot.committed().tree()["state_dict"]["weight"].tolist()
            received = (got.world_size, got.global_step, got.sampler, weight)
        results[name] = (plan, received)
    return results


@pytest.fixture(scope="module")
def agreed() -> list[dict[str, Any]]:
    return run_ranks(RANKS, agree_everywhere, timeout=60)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_rank_agrees_on_the_newest_commit(agreed, name):
    steps, source = SCENARIOS[name]
    versions = [f"version of rank {source or 0}"]  # the source's logger versions, rank 0's if none
    assert [result[name][0] for result in agreed] == [RestorePlan(source, versions)] * RANKS


@pytest.mark.parametrize("name", [n for n, (_, source) in SCENARIOS.items() if source is not None])
def test_every_rank_receives_the_source_ranks_commit(agreed, name):
    steps, source = SCENARIOS[name]
    expected = (10 + source, steps[source], position(consumed=source), [float(source)] * 2)
    assert [result[name][1] for result in agreed] == [expected] * RANKS


def test_nothing_is_received_when_nobody_holds_a_commit(agreed):
    assert [result["nobody holds one"][1] for result in agreed] == [None] * RANKS



# ----- the loop state taken at every commit -----------------------------------------------


def tiny_module() -> type:
    """A LightningModule class for real fits in a world of one (Lightning imported here)."""
    import lightning.pytorch as pl  # noqa: PLC0415

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.layer(batch[0]).sum()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            pass

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny


def test_the_fast_loop_state_equals_lightnings_own_mid_fit():
    import lightning.pytorch as pl  # noqa: PLC0415
    from torch.utils.data import DataLoader, TensorDataset  # noqa: PLC0415

    Tiny = tiny_module()
    seen: list[tuple[dict[str, Any], dict[str, Any]]] = []

    class Compare(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            connector = trainer._checkpoint_connector
            seen.append((compat.loops_state_dict(trainer), type(connector)._get_loops_state_dict(connector)))

    data = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, val_check_interval=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Compare()],
    )
    trainer.fit(Tiny(), data, data)
    assert len(seen) == 8
    for fast, lightning in seen:
        assert fast == lightning
    assert seen[-1][0]["fit_loop"]["epoch_loop.val_loop.batch_progress"]["total"]["completed"] > 0


def test_a_commit_rescaled_to_the_start_of_its_epoch_resumes_at_the_first_batch(tmp_path):
    """The edge a clamp at zero got wrong: a world that grows right after an epoch's first
    batch has done none of the new epoch at its size; Lightning must restart at batch 0."""
    import lightning.pytorch as pl  # noqa: PLC0415
    from torch.utils.data import DataLoader, TensorDataset  # noqa: PLC0415

    Tiny = tiny_module()
    path = tmp_path / "commit.ckpt"

    class CommitAtEpoch1Batch0(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.current_epoch == 1 and batch_idx == 0:
                # As if 1 of 16 samples were consumed: at world size 1, batches of 2, no
                # batch of the epoch is done (epoch_batches_done(16, 1, 1, 2) == 0).
                commit = commit_of(compat.dump_checkpoint(trainer), 1, trainer.global_step,
                                   position(consumed=1, dataset_size=16, batch_size=2))
                torch.save(checkpoint_for_lightning(commit, world_size=1), path)

    batches: list[tuple[int, int]] = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
            batches.append((trainer.current_epoch, batch_idx))

    def trainer(callback: pl.Callback) -> pl.Trainer:
        return pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])

    data = DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=2)
    trainer(CommitAtEpoch1Batch0()).fit(Tiny(), data)
    assert epoch_batches_done(16, 1, 1, 2) == 0
    trainer(Record()).fit(Tiny(), data, ckpt_path=path)
    assert batches == [(1, b) for b in range(8)]


def test_a_commit_of_an_epochs_last_batch_resumes_at_the_next_epoch_and_later_commits_stay_mid_epoch(tmp_path):
    """Found by a host change during the epoch-end validation, then a second one mid-epoch:
    resumed on Lightning's own path, the first commit left the next epoch uncounted as
    started, so a commit in it resumed as if the epoch had not begun: the epoch replayed
    from its first batch (here) or, with the elastic sampler, ended short and its StepLR
    step was lost (the job's LR twice the expected)."""
    import lightning.pytorch as pl  # noqa: PLC0415
    from torch.utils.data import DataLoader, TensorDataset  # noqa: PLC0415

    class Scheduled(tiny_module()):  # type: ignore[misc]
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)}

    class CommitAt(pl.Callback):
        def __init__(self, epoch: int, batch_idx: int, path: Any) -> None:
            self.at, self.path = (epoch, batch_idx), path

        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (trainer.current_epoch, batch_idx) == self.at:
                commit = commit_of(compat.dump_checkpoint(trainer), 1, trainer.global_step, None)
                torch.save(checkpoint_for_lightning(commit, world_size=1), self.path)

    batches: list[tuple[int, int]] = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
            batches.append((trainer.current_epoch, batch_idx))

    def fit(callback: pl.Callback, ckpt_path: Any = None) -> pl.Trainer:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, Record()])
        trainer.fit(Scheduled(), DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2), ckpt_path=ckpt_path)
        return trainer

    last_batch, mid_epoch = tmp_path / "last-batch.ckpt", tmp_path / "mid-epoch.ckpt"
    fit(CommitAt(0, 3, last_batch))
    resumed = torch.load(last_batch, weights_only=False)["loops"]["fit_loop"]
    assert resumed["epoch_progress"]["current"] == {"ready": 1, "started": 1, "processed": 1, "completed": 1}
    batches.clear()
    trainer = fit(CommitAt(1, 1, mid_epoch), last_batch)
    assert batches == [(e, b) for e in (1, 2) for b in range(4)]
    assert (trainer.global_step, trainer.lr_scheduler_configs[0].scheduler.last_epoch) == (12, 3)
    batches.clear()
    trainer = fit(pl.Callback(), mid_epoch)
    assert batches == [(1, 2), (1, 3)] + [(2, b) for b in range(4)]
    assert (trainer.global_step, trainer.lr_scheduler_configs[0].scheduler.last_epoch) == (12, 3)
