"""Pristine: a LightningModule's submodules before configure_model, on the meta device, put back
after a reset (lightning_elastic/lightning/pristine.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_elastic.errors import ElasticError
from lightning_elastic.lightning.pristine import Pristine
from tests.unit.fakes import run_ranks

pytestmark = pytest.mark.timeout(60)


class Owner(torch.nn.Module):
    """Stands in for a LightningModule: a model built in __init__, a head built by configure_model."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
        self.model[2].weight = torch.nn.Parameter(torch.ones(4, 8), requires_grad=False)
        self.shares = torch.nn.Module()
        self.shares.weight = self.model[0].weight  # the same parameter under two names
        self.head: torch.nn.Module | None = None
        self.register_buffer("steps", torch.zeros(()))

    def configure_model(self) -> None:
        if self.head is None:
            self.head = torch.nn.Linear(4, 1)


def test_a_rebuild_gives_fresh_meta_copies_of_the_submodules_as_they_were_before_configure_model():
    owner = Owner()
    pristine = Pristine.take(owner)
    owner.configure_model()
    old_model = owner.model
    pristine.rebuild(owner)
    assert owner.model is not old_model
    assert [type(m) for m in owner.model] == [type(m) for m in old_model]
    for (name, new), (_, old) in zip(owner.model.named_parameters(), old_model.named_parameters(), strict=True):
        assert new.is_meta and new.shape == old.shape and new.requires_grad == old.requires_grad, name
    assert owner.shares.weight is owner.model[0].weight  # shared across submodules, still shared
    assert not owner.steps.is_meta  # the owner's own tensors are not its submodules': left alone
    # What configure_model built is gone, and the attribute it replaced is back: it builds it again.
    assert owner.head is None and "head" not in dict(owner.named_children())
    owner.configure_model()
    assert isinstance(owner.head, torch.nn.Linear)


def test_each_rebuild_is_a_new_copy_and_the_pristine_copy_stays_unconfigured():
    owner = Owner()
    pristine = Pristine.take(owner)
    pristine.rebuild(owner)
    first = owner.model
    first.extra = torch.nn.Linear(1, 1)  # as fully_shard changes a module in place
    pristine.rebuild(owner)
    assert owner.model is not first and not hasattr(owner.model, "extra")


def test_a_child_that_refers_to_its_owner_refers_to_the_same_owner_after_a_rebuild():
    owner = Owner()
    object.__setattr__(owner.model, "owner", owner)  # a plain reference back to the LightningModule
    pristine = Pristine.take(owner)
    pristine.rebuild(owner)
    assert owner.model.owner is owner  # not a copy of the whole LightningModule (and its trainer)


def test_taking_the_copy_costs_no_memory_of_the_weights():
    owner = Owner()
    pristine = Pristine.take(owner)
    assert all(t.is_meta for child in pristine.children.values() for t in child.parameters())
    assert not any(t.is_meta for t in owner.parameters())  # the live module is untouched


def test_a_rebuild_of_another_module_is_refused():
    pristine = Pristine.take(Owner())
    with pytest.raises(ElasticError, match=r"^Pristine.rebuild: Owner is not the module the copy was taken from; "):
        pristine.rebuild(Owner())


def take_from_sharded(rank: int, worker: object) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    owner = Owner()
    fully_shard(owner.model, mesh=init_device_mesh("cpu", (1,)))
    try:
        Pristine.take(owner)
    except ElasticError as err:
        return str(err)
    return "no error"


def test_a_module_already_sharded_when_fit_starts_is_refused():
    [message] = run_ranks(1, take_from_sharded)
    assert message == ('strategy="elastic_fsdp": model.0.weight is already sharded when fit starts; expected '
                       "fully_shard to be applied in the LightningModule's configure_model, not before fit")
