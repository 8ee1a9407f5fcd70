"""``ElasticEnvironment``: Lightning's cluster environment for an elastic job.

Shared by the Trainer strategy (``strategy.py``) and the Fabric strategy
(``lightning_elastic.fabric``): both ask their worker, which the rendezvous gives a new
assignment at every round. Imports only ``lightning.fabric``, so the Fabric integration
does not load ``lightning.pytorch``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment

from lightning_elastic.worker import ElasticWorker


class HasWorker(Protocol):
    @property
    def worker(self) -> ElasticWorker: ...


class ElasticEnvironment(ClusterEnvironment):
    """Lightning's view of the current round: every answer comes from the worker's assignment."""

    def __init__(self, strategy: HasWorker) -> None:
        self._strategy = strategy

    @property
    def creates_processes_externally(self) -> bool:
        return True  # lightning-elastic launch starts the workers

    @property
    def main_address(self) -> str:
        return self._strategy.worker.assignment.store_host or "127.0.0.1"

    @property
    def main_port(self) -> int:
        return self._strategy.worker.assignment.store_port

    @staticmethod
    def detect() -> bool:
        return False  # chosen through the strategy, never by environment detection

    def world_size(self) -> int:
        return self._strategy.worker.assignment.size

    def set_world_size(self, size: int) -> None:
        pass  # decided by the rendezvous

    def global_rank(self) -> int:
        return self._strategy.worker.assignment.rank

    def set_global_rank(self, rank: int) -> None:
        pass  # decided by the rendezvous

    def local_rank(self) -> int:
        return self._strategy.worker.assignment.local_rank

    def node_rank(self) -> int:
        return self._strategy.worker.assignment.cross_rank


def wants_cuda(parallel_devices: Sequence[torch.device] | None) -> bool:
    """Did Lightning choose GPUs for this strategy (its accelerator's devices)?"""
    return bool(parallel_devices) and parallel_devices[0].type == "cuda"


def root_device(parallel_devices: Sequence[torch.device] | None, worker: ElasticWorker) -> torch.device:
    """``cuda:LOCAL_RANK`` of the current round on GPUs (the local rank may change at a reset), else the CPU."""
    if wants_cuda(parallel_devices):
        return torch.device("cuda", worker.assignment.local_rank)
    return torch.device("cpu")
