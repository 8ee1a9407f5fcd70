"""lightning_elastic/membership/process_group.py: backend choice, NCCL environment, a real gloo round group."""

from __future__ import annotations

import datetime
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from lightning_elastic.membership.process_group import (
    BackendChoice,
    choose_backend,
    destroy_round_group,
    init_round_group,
    nccl_environment,
    validate_backend,
    validate_timeout,
)

pytestmark = pytest.mark.timeout(60)

GLOO = BackendChoice("gloo", torch.device("cpu"))
TIMEOUT = datetime.timedelta(seconds=20)


# ----- choose_backend ------------------------------------------------------------------
# There is no GPU here, so CUDA availability is monkeypatched to exercise the NCCL branch.


def test_nccl_on_the_local_rank_device_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert choose_backend(3) == BackendChoice("nccl", torch.device("cuda", 3))


def test_gloo_on_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_backend(3) == GLOO


def test_explicit_cuda_flag_overrides_detection(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert choose_backend(0, cuda_available=False) == GLOO
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_backend(1, cuda_available=True).backend == "nccl"


def test_this_machine_without_gpu_gets_gloo():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert choose_backend(0) == GLOO


def test_requested_gloo_on_gpus_keeps_the_cuda_device():
    # process_group_backend="gloo" on a GPU machine: DDP on cuda:LOCAL_RANK over gloo.
    assert choose_backend(2, cuda_available=True, requested="gloo") == BackendChoice("gloo", torch.device("cuda", 2))


def test_requested_nccl_without_cuda_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^process_group_backend: 'nccl' needs CUDA devices, and this worker has none$"):
        choose_backend(0, cuda_available=False, requested="nccl")


@pytest.mark.parametrize("backend", ["mpi", "NCCL", ""])
def test_an_unknown_backend_is_refused_naming_the_choices(backend):
    with pytest.raises(ValueError, match=r"^process_group_backend: expected one of 'gloo', 'nccl', got "):
        validate_backend(backend)


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), float("inf"), True, "60"])
def test_an_invalid_collective_timeout_is_refused(seconds):
    with pytest.raises(ValueError, match=r"^timeout: expected a positive, finite number of seconds, got "):
        validate_timeout(seconds)


# ----- nccl_environment ----------------------------------------------------------------


def test_nccl_async_error_handling_is_set_to_abort_the_communicator_only():
    assert nccl_environment({}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


@pytest.mark.parametrize("value", ["3", "0", ""])
def test_users_own_nccl_async_error_handling_is_kept(value):
    assert nccl_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": value}) == {}


def test_nccl_environment_does_not_modify_its_argument():
    env = {"PATH": "/bin"}
    nccl_environment(env)
    assert env == {"PATH": "/bin"}


# ----- a real gloo group in a world of one ---------------------------------------------


@pytest.fixture
def clean_world() -> Iterator[None]:
    assert not dist.is_initialized()
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_gloo_round_group_forms_works_and_is_destroyed(clean_world):
    init_round_group(dist.HashStore(), 1, 0, 1, GLOO, TIMEOUT)
    assert dist.is_initialized()
    assert dist.get_backend() == "gloo"
    assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
    t = torch.tensor([2.0, 3.0])
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 3.0]
    destroy_round_group()
    assert not dist.is_initialized()


class RecordingStore(dist.Store):
    """A real c10d store (a HashStore inside) that records every key it is asked about."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = dist.HashStore()
        self.keys: list[str] = []

    def set(self, key, value):
        self.keys.append(key)
        return self.inner.set(key, value)

    def get(self, key):
        self.keys.append(key)
        return self.inner.get(key)

    def add(self, key, value):
        self.keys.append(key)
        return self.inner.add(key, value)

    def compare_set(self, key, expected, desired):
        self.keys.append(key)
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys, *args):
        self.keys.extend(keys)
        return self.inner.wait(keys, *args)

    def check(self, keys):
        self.keys.extend(keys)
        return self.inner.check(keys)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


def test_every_store_key_of_a_round_is_under_that_rounds_prefix(clean_world):
    store = RecordingStore()
    init_round_group(store, 7, 0, 1, GLOO, TIMEOUT)
    destroy_round_group()
    assert store.keys, "the group did not use the store at all"
    assert all(k.startswith("lightning_elastic/round/7/") for k in store.keys), store.keys


def test_consecutive_rounds_can_be_formed_on_one_store(clean_world):
    store = dist.HashStore()
    for number in (1, 2, 3):
        init_round_group(store, number, 0, 1, GLOO, TIMEOUT)
        t = torch.tensor([float(number)])
        dist.all_reduce(t)
        assert t.item() == number
        destroy_round_group(abort=(number == 2))
        assert not dist.is_initialized()


def test_a_formation_that_failed_leaves_the_next_rounds_keys_where_every_rank_looks(clean_world):
    # torch names a default group after a process-wide counter that only a destroy resets; a
    # failed formation has nothing to destroy. Seen: a survivor whose formation timed out
    # (a peer died while connecting) then looked for "round/N/0/..." while it wrote
    # "round/N/1/...", round after round, until the job failed.
    store = RecordingStore()
    with pytest.raises(Exception):  # noqa: B017 - torch's error type for a store timeout varies
        init_round_group(store, 1, 0, 2, GLOO, TIMEOUT, connect_timeout=datetime.timedelta(seconds=0.2))
    assert not dist.is_initialized()
    store.keys.clear()
    init_round_group(store, 2, 0, 1, GLOO, TIMEOUT)
    destroy_round_group()
    assert store.keys and all(k.startswith("lightning_elastic/round/2/0/") for k in store.keys), store.keys


def test_abort_leaves_no_group_behind(clean_world):
    init_round_group(dist.HashStore(), 1, 0, 1, GLOO, TIMEOUT)
    destroy_round_group(abort=True)
    assert not dist.is_initialized()


def test_destroy_without_a_group_is_a_no_op(clean_world):
    destroy_round_group()
    destroy_round_group(abort=True)
    assert not dist.is_initialized()


def test_round_group_on_a_tcp_store(clean_world):
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False,
                          timeout=TIMEOUT, use_libuv=True)
    init_round_group(store, 1, 0, 1, GLOO, TIMEOUT)
    assert dist.get_world_size() == 1
    destroy_round_group()
    assert not dist.is_initialized()


def test_the_formed_group_has_the_collective_timeout_not_the_connect_bound(clean_world):
    long = datetime.timedelta(seconds=1800)
    init_round_group(dist.HashStore(), 1, 0, 1, GLOO, long, connect_timeout=datetime.timedelta(seconds=2))
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert backend.options._timeout == long


# ----- a peer that dies between publishing its address and connecting --------------------

_RANK_SCRIPT = r"""
import datetime, os, signal, sys, time
import torch.distributed as dist
from lightning_elastic.membership.process_group import BackendChoice, init_round_group
import torch

rank, path = int(sys.argv[1]), sys.argv[2]
store = dist.FileStore(path, 3)

class DiesAfterPublishing(dist.Store):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
    def set(self, key, value):
        self.inner.set(key, value)
        os.kill(os.getpid(), signal.SIGKILL)  # its address is in the store; it never connects
    def get(self, key):
        return self.inner.get(key)
    def wait(self, keys, timeout=None):
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)
    def add(self, key, amount):
        return self.inner.add(key, amount)
    def check(self, keys):
        return self.inner.check(keys)

started = time.monotonic()
try:
    init_round_group(DiesAfterPublishing(store) if rank == 2 else store, 1, rank, 3,
                     BackendChoice("gloo", torch.device("cpu")), datetime.timedelta(seconds=1800),
                     connect_timeout=datetime.timedelta(seconds=1))
    print("formed")
except Exception:
    print(f"raised after {time.monotonic() - started:.1f} s")
"""


def _form_with_a_dying_peer(store: str) -> tuple[list[str], int | None]:
    """Three ranks form a group; rank 2 dies at its first store write. (outputs of 0 and 1, rank 2's status)."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    procs = [subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, str(r), store], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for r in range(3)]
    try:
        outputs = [p.communicate(timeout=60)[0].strip() for p in procs]
    finally:
        for p in procs:
            p.kill()
    return outputs[:2], procs[2].returncode


def test_a_peer_dying_after_publishing_its_address_fails_the_formation_within_the_connect_bound(tmp_path):
    # Before the bound, the survivors waited 5 x the collective timeout (the chaos case
    # "second worker killed during the re-formation" hung CI this way). Rank 2's first store
    # write is usually its gloo address; once in about ten runs the mesh was already
    # connected by then and the group formed: such an attempt shows nothing and is repeated.
    for attempt in range(3):
        survivors, dying = _form_with_a_dying_peer(str(tmp_path / f"store{attempt}"))
        assert dying == -9
        if survivors != ["formed", "formed"]:
            break
    else:
        pytest.fail("rank 2 never died before the mesh was connected in 3 attempts")
    # A survivor rank 2 had already connected to forms; every other one must give up in time.
    raised = [out for out in survivors if out != "formed"]
    assert raised, survivors
    for out in raised:
        assert out.startswith("raised after"), survivors
        assert float(out.split()[2]) < 30, survivors  # 5 x the 1 s bound, with room for a loaded machine


def test_a_large_gloo_world_is_told_that_its_bootstrap_is_quadratic():
    from lightning_elastic.membership.process_group import GLOO_LARGE_WORLD, gloo_scale_warning

    assert gloo_scale_warning("gloo", GLOO_LARGE_WORLD) is None
    assert gloo_scale_warning("nccl", 4096) is None
    warning = gloo_scale_warning("gloo", 4096)
    assert warning is not None and "33,558,528 store operations" in warning and "use NCCL" in warning
