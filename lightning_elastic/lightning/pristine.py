"""A LightningModule's submodules as they were before ``configure_model`` first ran, kept on
the meta device, and put back (as fresh copies) for ``configure_model`` to shard again.

FSDP2 binds a module to the mesh ``fully_shard`` was given, and a reset forms a new process
group: the module cannot be moved to the new mesh in place. So the strategy copies the
unconfigured submodules once, before the first ``configure_model`` (every tensor replaced by
a meta tensor of its shape: the copy costs no memory), and after a reset replaces the
module's submodules with fresh copies of that, on which the user's ``configure_model`` runs
again with the new round's mesh. The copy carries no values: every tensor of the rebuilt
module comes from the commit.

A ``configure_model`` that builds its submodules itself (``if self.model is None: ...``)
finds them gone again: a submodule added since the copy is removed, and the attribute it
replaced (``self.model = None``) comes back.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_elastic.errors import ElasticError


@dataclasses.dataclass(frozen=True)
class Pristine:
    """The submodules of one LightningModule before ``configure_model``, on the meta device."""

    owner: int  # id() of the LightningModule they were taken from
    children: dict[str, torch.nn.Module]
    attributes: dict[str, Any]  # its plain attributes then (``self.model = None``)

    @classmethod
    def take(cls, module: torch.nn.Module) -> Pristine:
        """Copy ``module``'s submodules (not yet sharded) to the meta device."""
        sharded = next((name for name, t in _tensors(module) if isinstance(t, DTensor)), None)
        if sharded is not None:
            raise ElasticError(f'strategy="elastic_fsdp": {sharded} is already sharded when fit starts; expected '
                               "fully_shard to be applied in the LightningModule's configure_model, not before fit")
        children = dict(module.named_children())
        attributes = {name: value for name, value in vars(module).items() if not isinstance(value, torch.nn.Module)}
        return cls(id(module), _meta_copy(children, keep=module), attributes)

    def rebuild(self, module: torch.nn.Module) -> None:
        """Give ``module`` fresh meta copies of its submodules as they were before ``configure_model``."""
        if id(module) != self.owner:
            raise ElasticError(f"Pristine.rebuild: {type(module).__name__} is not the module the copy was taken "
                               "from; expected the same LightningModule as at the first fit")
        fresh = _meta_copy(self.children, keep=module)
        for name, _ in list(module.named_children()):
            if name not in fresh:
                delattr(module, name)  # built by configure_model: it builds it again
                if name in self.attributes:
                    setattr(module, name, self.attributes[name])
        for name, child in fresh.items():
            setattr(module, name, child)


def _tensors(module: torch.nn.Module) -> itertools.chain[tuple[str, torch.Tensor]]:
    return itertools.chain(module.named_parameters(), module.named_buffers())


def _meta_copy(children: dict[str, torch.nn.Module], keep: object) -> dict[str, torch.nn.Module]:
    """A deep copy of ``children`` (in one go: weights tied across them stay tied) whose
    parameters and buffers are meta tensors; ``keep`` (the owner, which a child may refer
    to) is not copied."""
    memo: dict[int, Any] = {id(keep): keep}
    for child in children.values():
        for tensor in itertools.chain(child.parameters(), child.buffers()):
            if id(tensor) not in memo:
                memo[id(tensor)] = _meta_like(tensor)
    return copy.deepcopy(children, memo)


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_like(tensor, device="meta")
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(meta, requires_grad=tensor.requires_grad)
    return meta
