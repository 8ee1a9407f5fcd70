"""Forming and tearing down the torch.distributed process group of one round.

Backend: NCCL when CUDA is available (one device per worker: ``cuda:LOCAL_RANK``), gloo
otherwise. Every round uses a fresh ``PrefixStore`` on the job's one store (served by the
driver), so no key of an earlier round is ever read.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import logging
import math
import os

import torch
import torch.distributed as dist

from lightning_elastic.protocol import STORE_ROUND_PREFIX

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    backend: str
    device: torch.device


BACKENDS = ("gloo", "nccl")


def validate_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"process_group_backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    return backend


def validate_timeout(seconds: float) -> float:
    # "not > 0" so NaN fails too.
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0 or math.isinf(seconds):
        raise ValueError(f"timeout: expected a positive, finite number of seconds, got {seconds!r}")
    return float(seconds)


def choose_backend(cuda_index: int, cuda_available: bool | None = None, requested: str | None = None) -> BackendChoice:
    """NCCL on ``cuda:cuda_index`` when CUDA is available, else gloo on the CPU.

    ``cuda_index`` is the worker's local rank, unless its launcher pinned it to devices of
    its own (``ElasticWorker.cuda_index``).

    ``requested`` (a Lightning strategy's ``process_group_backend``) overrides the backend;
    the device still follows CUDA's availability (gloo can run DDP on GPUs too).
    """
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    device = torch.device("cuda", cuda_index) if cuda_available else torch.device("cpu")
    backend = "nccl" if cuda_available else "gloo"
    if requested is not None:
        backend = validate_backend(requested)
        if backend == "nccl" and not cuda_available:
            raise ValueError("process_group_backend: 'nccl' needs CUDA devices, and this worker has none")
    return BackendChoice(backend, device)


def nccl_environment(environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """Variables that make an NCCL collective error raise instead of killing the process.

    torch's default TORCH_NCCL_ASYNC_ERROR_HANDLING=3 tears the process down on a collective
    error; mode 2 aborts only the communicator, so ``@run`` can catch the error, re-form the
    group and go on. A value the user set is kept.
    """
    wanted = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    return {k: v for k, v in wanted.items() if k not in environ}


# How long gloo may take to connect a round's peers to each other once their addresses are
# in the store. gloo waits for a connection from a peer for five times the group's
# timeout: without this bound, a peer that dies between publishing its address and
# connecting holds the others for 5 x --collective-timeout (docs/reliability.md). Live peers connect within milliseconds of each other;
# the wait for their addresses is the store's, bounded and interruptible on its own.
GLOO_CONNECT_TIMEOUT = datetime.timedelta(seconds=5)


# Beyond this many ranks, say once that gloo's bootstrap is quadratic in the store: each
# rank reads every rank's address (2N + 1 store operations of 154 + 8N bytes each): seconds
# at 256 ranks (docs/performance.md). NCCL's bootstrap is one or two requests per rank.
GLOO_LARGE_WORLD = 256


def gloo_scale_warning(backend: str, size: int) -> str | None:
    if backend != "gloo" or size <= GLOO_LARGE_WORLD:
        return None
    return (f"a gloo process group of {size} ranks: gloo's bootstrap reads every rank's address from the store "
            f"({size * (2 * size + 1):,} store operations in all), which takes minutes at this size; "
            "use NCCL (GPUs) for large worlds")


def init_round_group(
    store: dist.Store, round_number: int, rank: int, size: int, choice: BackendChoice,
    timeout: datetime.timedelta, connect_timeout: datetime.timedelta = GLOO_CONNECT_TIMEOUT,
) -> None:
    """Form the round's default process group; its collectives get ``timeout``."""
    if choice.backend == "nccl":
        os.environ.update(nccl_environment(os.environ))
        torch.cuda.set_device(choice.device)
    warning = gloo_scale_warning(choice.backend, size)
    if warning is not None and rank == 0:
        log.warning("%s.", warning)
    prefixed = dist.PrefixStore(f"{STORE_ROUND_PREFIX}{round_number}", store)  # it adds the "/"
    kwargs = {"device_id": choice.device} if choice.backend == "nccl" else {}
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    forming = min(timeout, connect_timeout) if choice.backend == "gloo" and set_timeout is not None else timeout
    try:
        dist.init_process_group(
            choice.backend, store=prefixed, rank=rank, world_size=size, timeout=forming, **kwargs
        )
    except BaseException:
        _forget_failed_formation()
        raise
    if forming != timeout:
        set_timeout(timeout)  # the formation's bound must not become the collectives' timeout


def _forget_failed_formation() -> None:
    """Leave no trace of a formation that raised, so that every rank's next one agrees.

    torch names the default group after a process-wide count of groups, which only a
    destroy resets, and keys the group's store entries with that name. A formation that
    failed (a peer died while connecting) has nothing to destroy but counted its group: the
    next round's keys on this rank would be "…/1/…" while every other rank's are "…/0/…",
    and no round could form again (docs/reliability.md).
    """
    if dist.is_initialized():
        destroy_round_group()
        return
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def abandon_round_group() -> None:
    """Leave the current gloo group without destroying it: one of its operations is stuck.

    gloo can leave a send pending for the group's whole timeout after the peer closed its
    end (see ``ElasticWorker.wait_collective``). Destroying the group then joins its worker
    thread, blocked in that send, so the destroy itself would hang. The group object is
    therefore leaked on purpose: one reference is never released, its threads end when its
    timeout expires, and the next round forms a group of its own.
    """
    if not dist.is_initialized():
        return
    group = dist.group.WORLD
    if group is not None:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    try:
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - the group is being left either way
        log.debug("Leaving the abandoned process group raised %s; continuing.", err)


def destroy_round_group(abort: bool = False) -> None:
    """Leave the current group. ``abort`` unblocks collectives stuck on a dead NCCL peer."""
    if not dist.is_initialized():
        return
    if abort:
        abort_fn = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort_fn is not None:
            try:
                abort_fn()
                return
            except Exception as err:  # fall back to an ordinary destroy
                log.debug("Aborting the process group failed: %s", err)
    try:
        dist.destroy_process_group()
    except Exception as err:  # a group broken by a lost peer may fail to shut down cleanly
        log.debug("Destroying the process group raised %s; continuing.", err)
