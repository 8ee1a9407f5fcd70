"""lightning_elastic/commit/init_sync.py: torch DDP skips its initial broadcast exactly when the
state sync already made the replicas identical (le.DistributedDataParallel, elastic_hvd)."""

from __future__ import annotations

import gc
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_elastic import api
from lightning_elastic.commit import init_sync
from lightning_elastic.training.ddp import DistributedDataParallel
from lightning_elastic.commit.init_sync import SyncedModules, agree, ddp_kwargs_for, fingerprint, needs_init_sync
from lightning_elastic.training.state import TorchState
from tests.unit.fakes import FakeWorker, run_ranks

pytestmark = pytest.mark.timeout(60)


def net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


class WithScratch(torch.nn.Module):
    """A module with a buffer no state_dict carries (``persistent=False``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


class HidesAParameter(torch.nn.Linear):
    """A custom state_dict that leaves the bias out: the sync never carries it."""

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        full = super().state_dict(*args, **kwargs)
        full.pop("bias")
        return full


def agreeing(ranks: int = 2):
    """A gather in which every other rank sent what this one sends."""
    calls: list[torch.Tensor] = []

    def gather(row: torch.Tensor) -> list[torch.Tensor]:
        calls.append(row)
        return [row.clone() for _ in range(ranks)]

    return gather, calls


# ----- which modules this round's sync loaded ------------------------------------------


def test_a_synced_module_and_its_submodules_are_held_in_their_round_only():
    model, other = net(), net()
    synced = SyncedModules()
    synced.note(3, [model])
    assert synced.holds(model, 3)
    assert synced.holds(model[2], 3)  # a submodule's weights came with the module's
    assert not synced.holds(other, 3)
    assert not synced.holds(model, 4)  # a later round: its own sync has not run yet
    synced.note(4, [other])
    assert not synced.holds(model, 4) and synced.holds(other, 4)


def test_a_module_holding_a_synced_one_is_not_held():
    model = net()
    synced = SyncedModules()
    synced.note(1, [model[0]])
    assert not synced.holds(model, 1)  # its other layers were never synced


def test_a_module_gone_is_forgotten():
    synced = SyncedModules()
    synced.note(1, [net()])
    gc.collect()
    assert not synced.holds(net(), 1)


def test_torch_state_sync_notes_its_modules_for_the_round():
    worker = FakeWorker(round=7)
    model = net()
    state = TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1), worker=worker, epoch=0)
    assert not worker.synced_modules.holds(model, 7)
    state.sync()
    assert worker.synced_modules.holds(model, 7)


# ----- the decision -------------------------------------------------------------------


def test_weights_no_sync_loaded_keep_the_initial_sync():
    # e.g. the first fit of a Lightning job: ranks may hold different random weights
    assert needs_init_sync(net(), {}, synced=False)


def test_synced_weights_need_no_initial_sync():
    assert not needs_init_sync(net(), {}, synced=True)
    gather, calls = agreeing()
    assert ddp_kwargs_for(net(), {"bucket_cap_mb": 5}, True, 2, gather) == {"bucket_cap_mb": 5, "init_sync": False}
    assert len(calls) == 1


@pytest.mark.parametrize("given", [True, False])
def test_the_users_init_sync_is_left_alone_without_a_collective(given):
    gather, calls = agreeing()
    assert ddp_kwargs_for(net(), {"init_sync": given}, True, 2, gather) == {"init_sync": given}
    assert ddp_kwargs_for(net(), {"init_sync": given}, False, 2, gather) == {"init_sync": given}
    assert calls == []


def test_a_world_of_one_asks_nobody():
    gather, calls = agreeing()
    assert ddp_kwargs_for(net(), {}, True, 1, gather) == {}
    assert calls == []


def test_unsynced_weights_keep_the_initial_sync_after_asking_every_rank():
    gather, calls = agreeing()
    assert ddp_kwargs_for(net(), {}, False, 2, gather) == {}
    assert len(calls) == 1  # every rank takes part, whatever it decided


@pytest.mark.parametrize("kwargs, needed", [
    ({}, False),  # DDP broadcasts every buffer before each forward
    ({"forward_sync_buffers": True}, False),
    ({"broadcast_buffers": False}, True),  # then only the initial sync could align it
    ({"forward_sync_buffers": False}, True),
])
def test_a_buffer_outside_the_state_dict_keeps_the_initial_sync_unless_forward_aligns_it(kwargs, needed):
    assert needs_init_sync(WithScratch(), kwargs, synced=True) is needed


def test_persistent_buffers_are_synced_with_the_state():
    # BatchNorm's running statistics are in its state_dict: loaded by the sync
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    assert not needs_init_sync(model, {"broadcast_buffers": False}, synced=True)


def test_a_parameter_the_state_dict_leaves_out_keeps_the_initial_sync():
    assert needs_init_sync(HidesAParameter(2, 2), {}, synced=True)


def test_one_rank_needing_it_keeps_it_on_every_rank():
    print_ = fingerprint(net())
    rows = {0: [0, print_], 1: [1, print_]}
    for me in (0, 1):
        gather = lambda row: [torch.tensor(rows[r]) for r in (0, 1)]  # noqa: E731
        assert not agree(needed=bool(rows[me][0]), print_=print_, gather=gather)
    assert agree(False, print_, lambda row: [torch.tensor([0, print_])] * 3)


def test_parameters_that_do_not_line_up_keep_the_initial_sync():
    # A rank that froze a layer builds other gradient buckets: torch's initial check must run.
    frozen = net()
    frozen[0].weight.requires_grad_(False)
    assert fingerprint(frozen) != fingerprint(net())
    assert fingerprint(net()) == fingerprint(net())  # values do not count, layout does
    assert fingerprint(torch.nn.Linear(4, 9)) != fingerprint(torch.nn.Linear(4, 8))
    theirs = fingerprint(frozen)
    assert not agree(False, fingerprint(net()), lambda row: [row, torch.tensor([0, theirs])])


# ----- le.DistributedDataParallel in a real group ----------------------------------------


def build_after_sync(rank: int, worker: FakeWorker) -> dict[str, Any]:
    torch.manual_seed(rank)  # different initial weights on each rank
    model, stray = net(), net()
    built: list[dict[str, Any]] = []

    class Recording(torch.nn.parallel.DistributedDataParallel):
        def __init__(self, module: torch.nn.Module, **kwargs: Any) -> None:
            built.append(dict(kwargs))
            super().__init__(module, **kwargs)

    import lightning_elastic.training.ddp as ddp_module  # noqa: PLC0415

    ddp_module.TorchDDP = Recording
    api._worker = worker  # what le.init() sets
    TorchState(model, worker=worker, step=0).sync()  # rank 0's weights everywhere
    ddp, other = DistributedDataParallel(model), DistributedDataParallel(stray)
    x = torch.ones(2, 4)
    ddp(x).sum().backward()
    other(x).sum().backward()  # never synced: built with the initial sync, which aligns it
    return {"built": built,
            "weights": [p.detach().flatten().tolist() for p in model.parameters()],
            "stray": [p.detach().flatten().tolist() for p in stray.parameters()],
            "grads": [p.grad.flatten().tolist() for p in model.parameters()]}


def test_a_ddp_of_a_synced_module_skips_the_initial_sync_and_stays_identical():
    results = run_ranks(2, build_after_sync)
    for r in results:
        assert r["built"] == [{"init_sync": False}, {}]
    assert results[0]["weights"] == results[1]["weights"]
    assert results[0]["stray"] == results[1]["stray"]
    assert results[0]["grads"] == results[1]["grads"]


# ----- the Lightning strategy -------------------------------------------------------------


@pytest.fixture()
def strategy(monkeypatch, request):
    """An ElasticStrategy in a world of one whose DDP set-up and weight loading are recorded."""
    from lightning.pytorch.strategies import DDPStrategy  # noqa: PLC0415

    from lightning_elastic.lightning import compat  # noqa: PLC0415
    from lightning_elastic.lightning.strategy import ElasticStrategy  # noqa: PLC0415

    from lightning_elastic.membership.worker import ElasticWorker  # noqa: PLC0415

    worker = ElasticWorker(None)
    worker.start()
    request.addfinalizer(worker.shutdown)
    strategy = ElasticStrategy(worker=worker, bucket_cap_mb=5)
    strategy.decided: list[bool] = []
    strategy.built: list[dict[str, Any]] = []

    def decide(module, kwargs, synced, size, gather):
        strategy.decided.append(synced)
        return {**kwargs, "init_sync": False} if synced else dict(kwargs)

    monkeypatch.setattr(init_sync, "ddp_kwargs_for", decide)
    monkeypatch.setattr(DDPStrategy, "configure_ddp", lambda self: self.built.append(compat.ddp_kwargs(self)))
    monkeypatch.setattr(DDPStrategy, "load_model_state_dict", lambda self, checkpoint, strict=True: None)
    return strategy


def fit_attempt(strategy, strict: bool = True) -> None:
    """What Lightning calls of the strategy in a fit: restore (when there is a commit), then set up DDP."""
    from lightning_elastic.lightning.commit import COMMIT_MARKER  # noqa: PLC0415

    if strategy.agree_on_restore(SimpleNamespace(loggers=[], callbacks=[])):
        checkpoint = strategy.load_checkpoint(COMMIT_MARKER)
        strategy.load_model_state_dict(checkpoint, strict=strict)
    strategy.configure_ddp()


def commit(strategy) -> None:
    from lightning_elastic.lightning.commit import take_commit  # noqa: PLC0415

    take_commit(strategy.snapshot, {"state_dict": {"w": torch.ones(2)}}, 1, 5, None)


def test_lightning_first_fit_keeps_the_initial_sync(strategy):
    fit_attempt(strategy)  # no commit yet: each rank's own initial weights
    assert strategy.decided == [False]
    assert strategy.built == [{"bucket_cap_mb": 5}]


def test_lightning_after_a_reset_the_restored_weights_skip_it_for_that_build_only(strategy):
    commit(strategy)
    fit_attempt(strategy)
    assert strategy.decided == [True]
    assert strategy.built == [{"bucket_cap_mb": 5, "init_sync": False}]
    assert vars(strategy)["_ddp_kwargs"] == {"bucket_cap_mb": 5}  # the user's again afterwards
    strategy.configure_ddp()  # a DDP built again without a restore in between
    assert strategy.decided == [True, False]


def test_lightning_a_lenient_load_keeps_the_initial_sync(strategy):
    commit(strategy)
    fit_attempt(strategy, strict=False)  # strict_loading=False: some weights may not be loaded
    assert strategy.decided == [False]
