"""``ElasticEnvironment`` and ``WorkerBacked``: what both elastic strategies need of the worker.

Shared by the Trainer strategy (``strategy.py``) and the Fabric strategy
(``lightning_elastic.fabric``), with ``WorkerBacked``: both ask their worker, which the
rendezvous gives a new assignment at every round. Imports only ``lightning.fabric``, so the Fabric integration
does not load ``lightning.pytorch``.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Protocol

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_elastic import api
from lightning_elastic.durable import store as snapshot_store
from lightning_elastic.membership.worker import ElasticWorker


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


class WorkerBacked:
    """What the Trainer and Fabric strategies share: the worker, joined on first use with the
    strategy's collective timeout and backend, and the device of the current round.

    Mixed in before Lightning's ``DDPStrategy`` (its ``root_device`` is replaced); the
    strategy calls ``_bind_worker`` in its constructor, before anything asks for the worker.
    """

    parallel_devices: list[torch.device] | None
    elastic_name = "elastic_hvd"  # the strategy's registered name, as messages say it

    def _bind_worker(self, worker: ElasticWorker | None, collective_timeout: float | None,
                     backend: str | None, snapshots: dict[str, Any] | None = None) -> None:
        """``snapshots``: the strategy's ``snapshot_dir``, ``snapshot_every``, ``snapshot_keep``
        and ``resume`` (those given), as ``le.init`` takes them; checked here."""
        self._worker = worker
        self._collective_timeout = collective_timeout
        self._requested_backend = backend
        given = {k: v for k, v in (snapshots or {}).items() if v is not None}
        # Validated now: a bad value fails when the strategy is built.
        self._snapshot_plan = snapshot_store.plan(os.environ, **given) if given else None
        if worker is not None:
            worker.configure_collectives(collective_timeout, backend)
            self._configure_snapshots(worker)

    def _configure_snapshots(self, worker: ElasticWorker) -> None:
        if self._snapshot_plan is not None:
            worker.configure_snapshots(*self._snapshot_plan)

    @property
    def worker(self) -> ElasticWorker:
        """The process's elastic worker; the first use joins the job (rendezvous)."""
        if self._worker is None:
            # timeout= and process_group_backend= apply to the worker's process group, which
            # the worker (not Lightning) forms at every round.
            self._worker = api.init(use_cuda=self._wants_cuda(), collective_timeout=self._collective_timeout,
                                    backend=self._requested_backend)
            self._worker.configure_collectives(self._collective_timeout, self._requested_backend)
            self._configure_snapshots(self._worker)
        return self._worker

    def _warn_ignored_settings(self, api: str) -> None:
        """Say that ``devices`` and ``num_nodes`` change nothing here (called once Lightning has
        set them): the launcher decides how many processes run and where, and each uses one
        device. Without this, ``devices=4`` silently trains with the launcher's world.

        Every visible GPU (``devices="auto"`` on a GPU machine, as torchrun scripts write
        it) is not a request: each process still takes the GPU of its local rank.
        """
        devices = self.parallel_devices or []
        all_gpus = bool(devices) and devices[0].type == "cuda" and len(devices) == torch.cuda.device_count()
        size = self.worker.assignment.size
        if len(devices) > 1 and not all_gpus:
            rank_zero_warn(
                f'lightning-elastic: strategy="{self.elastic_name}" ignores {api}(devices=...) asking for {len(devices)} '
                f"devices: lightning-elastic launch starts one process per device (launch -np and the hosts' slots "
                f"set how many; the job has {size} now), and this process uses {self.root_device}. Leave devices out."
            )
        num_nodes = getattr(self, "num_nodes", 1)
        if num_nodes != 1:
            rank_zero_warn(
                f'lightning-elastic: strategy="{self.elastic_name}" ignores {api}(num_nodes={num_nodes}): the hosts are '
                "lightning-elastic launch's (-H, --hostfile, --host-discovery-script, --ray or --slurm; the job has "
                f"{size} process(es) now). Leave num_nodes out."
            )

    def _wants_cuda(self) -> bool:
        """Did Lightning choose GPUs for this strategy (its accelerator's devices)?"""
        devices = self.parallel_devices or []
        return bool(devices) and devices[0].type == "cuda"

    @property
    def root_device(self) -> torch.device:
        """``cuda:LOCAL_RANK`` of the current round on GPUs (the local rank may change at a reset),
        or the device the launcher pinned the worker to (Ray); else the CPU."""
        if self._wants_cuda():
            return torch.device("cuda", self.worker.cuda_index)
        return torch.device("cpu")


def timeout_seconds(timeout: Any, owner: str) -> float:
    """A strategy's ``timeout=`` in seconds; ``owner`` names the strategy in the error."""
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        return float(timeout)
    raise ValueError(f"{owner}: timeout must be a datetime.timedelta, got {timeout!r}")


def check_parallel_sizes(owner: str, data_parallel_size: Any, tensor_parallel_size: Any) -> None:
    """An elastic FSDP2 strategy's sizes: data parallel over every rank of the round, no
    tensor parallelism (``owner`` names the strategy in the error)."""
    if tensor_parallel_size not in ("auto", 1):
        raise ValueError(f"{owner}: tensor_parallel_size={tensor_parallel_size!r}: tensor parallelism is "
                         "not supported; expected 1 (FSDP2 over every rank of the job)")
    if data_parallel_size != "auto":
        raise ValueError(f"{owner}: data_parallel_size={data_parallel_size!r}: the data-parallel size is "
                         "the job's world size, set by lightning-elastic launch; expected it left out")
