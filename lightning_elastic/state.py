"""Training state that survives resets: committed in host memory, synced from rank 0.

``commit()`` copies the state into host memory and checks for host changes. After a
failure ``@run`` restores the last commit; after an announced host change it keeps the live
state. Either way, after the new round is formed every rank takes rank 0's state.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from lightning_elastic.worker import ElasticWorker


def _current_worker() -> ElasticWorker:
    from lightning_elastic.api import current_worker

    return current_worker()


def to_host(value: Any) -> Any:
    """A deep copy with every tensor copied to CPU memory (a commit must not cost GPU memory)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        # A shallow copy keeps what the constructor would need (a defaultdict's factory).
        result = copy.copy(value)
        result.clear()
        result.update((k, to_host(v)) for k, v in value.items())
        return result
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_host(v) for v in value)
    return copy.deepcopy(value)


def broadcast_object(value: Any, worker: ElasticWorker, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` on every rank (tensors travel on CPU, pickled)."""
    if worker.assignment.size == 1:
        return value
    box = [to_host(value) if worker.assignment.rank == src else None]
    device = worker.device if worker.backend == "nccl" else None
    dist.broadcast_object_list(box, src=src, device=device)
    return box[0]


class State:
    """Base of every elastic state: subclasses define save, restore and sync."""

    def __init__(self, worker: ElasticWorker | None = None) -> None:
        object.__setattr__(self, "_worker", worker)
        object.__setattr__(self, "_reset_callbacks", [])

    @property
    def worker(self) -> ElasticWorker:
        return self._worker if self._worker is not None else _current_worker()

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Callbacks run after every re-rendezvous, before the state is synced."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save a copy in host memory, then check for host changes (may raise the interrupt)."""
        self.save()
        self.worker.note_commit()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises ``HostsUpdatedInterrupt`` on every rank at the same step if hosts changed."""
        self.worker.check_host_updates()

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Plain Python values, kept as attributes: ``state.epoch += 1``."""

    def __init__(self, worker: ElasticWorker | None = None, **values: Any) -> None:
        super().__init__(worker)
        object.__setattr__(self, "_names", list(values))
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_saved", {})
        ObjectState.save(self)

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and name not in self._names:
            self._names.append(name)
        object.__setattr__(self, name, value)

    def _plain_values(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in self._names if not _is_stateful(getattr(self, n))}

    def save(self) -> None:
        object.__setattr__(self, "_saved", to_host(self._plain_values()))

    def restore(self) -> None:
        for name, value in copy.deepcopy(self._saved).items():
            object.__setattr__(self, name, value)

    def sync(self) -> None:
        for name, value in broadcast_object(self._plain_values(), self.worker).items():
            object.__setattr__(self, name, value)


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


class TorchState(ObjectState):
    """Modules, optimizers, LR schedulers (anything with ``state_dict``) plus plain values.

    ``le.TorchState(model, optimizer, epoch=0, batch=0)``: objects with ``state_dict()`` are
    saved and restored through it; other values as objects.
    """

    def __init__(
        self, model: Any = None, optimizer: Any = None, worker: ElasticWorker | None = None, **values: Any
    ) -> None:
        named = {k: v for k, v in (("model", model), ("optimizer", optimizer)) if v is not None}
        object.__setattr__(self, "_saved_stateful", {})
        super().__init__(worker, **named, **values)

    def _stateful(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in self._names if _is_stateful(getattr(self, n))}

    def save(self) -> None:
        super().save()
        object.__setattr__(self, "_saved_stateful", {n: to_host(v.state_dict()) for n, v in self._stateful().items()})

    def restore(self) -> None:
        super().restore()
        for name, obj in self._stateful().items():
            if name in self._saved_stateful:
                saved = self._saved_stateful[name]
                # An optimizer adopts the tensors it is given: its next step would overwrite
                # the commit in place. A module copies into its own parameters.
                obj.load_state_dict(saved if isinstance(obj, torch.nn.Module) else copy.deepcopy(saved))

    def sync(self) -> None:
        worker = self.worker
        for name, obj in self._stateful().items():
            if isinstance(obj, torch.nn.Module):
                broadcast_module(obj, worker)
            else:
                obj.load_state_dict(broadcast_object(obj.state_dict(), worker))
        super().sync()


def broadcast_module(module: torch.nn.Module, worker: ElasticWorker) -> None:
    """Rank 0's parameters and buffers, in place, one collective per tensor, on its device."""
    if worker.assignment.size == 1:
        return
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=0)
