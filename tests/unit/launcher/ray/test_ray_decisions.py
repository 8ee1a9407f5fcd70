"""The Ray integration's decisions that need no cluster: slots, device pinning, the agent.

A node's slots come from its total resources; a worker pinned to its own GPUs (Ray shows
an actor only its devices) uses device 0 whatever its local rank. NCCL cannot run here (no
GPU): these tests check the decisions the NCCL path rests on. The agent is the plain class
the actor wraps, exercised in this process with a real child.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import signal
import sys
import time

import pytest
import torch

from lightning_elastic import protocol as p
from lightning_elastic.launcher.config import RaySettings
from lightning_elastic.launcher.errors import ConfigError
from lightning_elastic.membership.worker import ElasticWorker, WorkerSettings

ray = pytest.importorskip("ray")

from lightning_elastic.launcher.ray.agent import AUTOLOAD_DIR, WorkerAgent, node_pythonpath  # noqa: E402
from lightning_elastic.launcher.ray.nodes import host_name, slots_on  # noqa: E402
from lightning_elastic.launcher.ray.sealed import KeyPair, Sealed, SealError, open_sealed, seal  # noqa: E402


@pytest.mark.parametrize(
    ("resources", "cpus", "gpus", "slots"),
    [
        ({"CPU": 8.0}, 1.0, 0.0, 8),
        ({"CPU": 8.0}, 3.0, 0.0, 2),
        ({"CPU": 0.9}, 0.3, 0.0, 3),  # 0.9 / 0.3 is 2.9999999999999996 in floating point
        ({"CPU": 16.0, "GPU": 4.0}, 1.0, 1.0, 4),  # the scarcer resource decides
        ({"CPU": 2.0, "GPU": 4.0}, 1.0, 1.0, 2),
        ({"CPU": 16.0}, 1.0, 1.0, 0),  # no GPU on the node
        ({}, 1.0, 0.0, 0),  # a head started with num_cpus=0
        ({"CPU": 4.0, "GPU": 2.0}, 0.0, 0.5, 4),
    ],
)
def test_slots_are_the_workers_a_nodes_total_resources_fit(resources, cpus, gpus, slots):
    assert slots_on(resources, cpus, gpus) == slots


def test_host_names_are_short_node_ids():
    assert host_name("c806f1aac092a041953158981977cee6df55685774d0339f6baebc8d") == "ray-c806f1aac092"


def test_fractional_resources_are_valid_settings():
    assert RaySettings("auto", cpus_per_worker=0.5, gpus_per_worker=0.25).cpus_per_worker == 0.5
    with pytest.raises(ConfigError):
        RaySettings("auto", cpus_per_worker=0.0, gpus_per_worker=0.0)


def settings(**extra: str) -> WorkerSettings:
    read_end, write_end = os.pipe()
    os.write(write_end, b"s")
    os.close(write_end)
    environ = {p.ENV_DRIVER_URL: "http://127.0.0.1:1", p.ENV_WORKER_ID: "w", p.ENV_HOSTNAME: "h",
               p.ENV_SECRET_FD: str(read_end), **extra}
    found = WorkerSettings.from_environment(environ)
    assert found is not None
    return found


def assigned(worker: ElasticWorker, local_rank: int) -> ElasticWorker:
    worker._assignment = p.Assignment(2, 1, 3, local_rank, 2, 0, 1, "h", "", 0, 0)
    return worker


def test_a_pinned_worker_uses_its_pinned_device_whatever_its_local_rank():
    worker = assigned(ElasticWorker(settings(**{p.ENV_CUDA_DEVICE: "0"})), local_rank=1)
    assert worker.cuda_index == 0


def test_an_unpinned_worker_uses_its_local_rank():
    worker = assigned(ElasticWorker(settings()), local_rank=1)
    assert worker.cuda_index == 1


def test_the_lightning_strategy_puts_a_pinned_worker_on_its_pinned_device():
    from lightning_elastic.lightning import ElasticStrategy

    strategy = ElasticStrategy(parallel_devices=[torch.device("cuda", 0), torch.device("cuda", 1)])
    strategy._worker = assigned(ElasticWorker(settings(**{p.ENV_CUDA_DEVICE: "0"})), 1)
    assert strategy.root_device == torch.device("cuda", 0)


def read_to_end(agent: WorkerAgent, until: bytes | None = None) -> tuple[bytes, int | None]:
    """Output and status, reading until the exit (or until ``until`` was read); bounded."""
    output, status = b"", None
    deadline = time.monotonic() + 30
    while status is None and time.monotonic() < deadline and (until is None or until not in output):
        chunk = agent.read(0.5)
        output += chunk.data
        status = chunk.status
    return output, status


def sealed_for(agent: WorkerAgent, secret: str = "s") -> Sealed:
    return seal(secret, agent.public_key())


def test_the_agent_relays_output_and_the_exit_status(tmp_path):
    agent = WorkerAgent()
    command = [sys.executable, "-c", "import os, sys; print('hello', os.environ['JOB_VALUE']); "
               "print(sys.stdin.read() == ''); "
               f"print(os.read(int(os.environ['{p.ENV_SECRET_FD}']), 100).decode()); sys.exit(3)"]
    pid = agent.start(command, {"JOB_VALUE": "42"}, sealed_for(agent, "the-secret"), str(tmp_path))
    assert pid > 0
    output, status = read_to_end(agent)
    assert status == 3
    assert output.decode().splitlines() == ["hello 42", "True", "the-secret"]


def test_the_secret_reaches_the_agent_sealed_and_opens_only_with_its_key():
    # What crosses Ray's RPC: the actor's public value, then the sealed secret. Neither
    # holds the secret; another actor's key cannot open it; a changed byte is refused.
    agent = WorkerAgent()
    secret = "ab" * 32
    sealed = seal(secret, agent.public_key())
    assert secret.encode() not in pickle.dumps((agent.public_key(), sealed))
    assert secret not in repr(sealed)
    assert open_sealed(agent._key, sealed) == secret
    with pytest.raises(SealError):
        open_sealed(KeyPair(), sealed)
    tampered = dataclasses.replace(sealed, ciphertext=bytes([sealed.ciphertext[0] ^ 1]) + sealed.ciphertext[1:])
    with pytest.raises(SealError):
        open_sealed(agent._key, tampered)
    with pytest.raises(SealError):
        WorkerAgent().start([sys.executable, "-c", "pass"], {}, sealed, "/")
    # Two seals of one secret share nothing (a fresh driver key each time).
    again = seal(secret, agent.public_key())
    assert again.public != sealed.public and again.ciphertext != sealed.ciphertext


def test_the_agent_signals_the_workers_process_group(tmp_path):
    agent = WorkerAgent()
    agent.start([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], {}, sealed_for(agent), str(tmp_path))
    assert read_to_end(agent, until=b"up\n") == (b"up\n", None)
    agent.signal(signal.SIGTERM)
    assert read_to_end(agent)[1] == -signal.SIGTERM


def test_the_agent_raises_when_the_command_cannot_start(tmp_path):
    agent = WorkerAgent()
    with pytest.raises(OSError):
        agent.start([str(tmp_path / "missing")], {}, sealed_for(agent), str(tmp_path))


def test_the_agent_runs_in_its_own_directory_when_the_drivers_is_missing(tmp_path):
    agent = WorkerAgent()
    agent.start([sys.executable, "-c", "import os; print(os.getcwd())"], {}, sealed_for(agent), str(tmp_path / "not-here"))
    output, status = read_to_end(agent)
    assert status == 0 and output.decode().strip() == os.getcwd()


def test_the_agent_replaces_the_drivers_autoload_with_the_nodes_own(tmp_path):
    # The driver's install lies elsewhere than this node's: its _autoload folder comes first
    # on the PYTHONPATH the driver sends. Two copies of the sitecustomize chained to each
    # other until RecursionError, printed by every worker.
    driver_autoload = tmp_path / "driver-venv" / "lightning_elastic" / "_autoload"
    driver_autoload.mkdir(parents=True)
    shutil.copy(AUTOLOAD_DIR + "/sitecustomize.py", driver_autoload)
    shutil.copy(os.path.dirname(AUTOLOAD_DIR) + "/import_hook.py", driver_autoload.parent)
    users = tmp_path / "users-code"
    env = {"PYTHONPATH": os.pathsep.join([str(driver_autoload), str(users)]), p.ENV_DRIVER_URL: "http://127.0.0.1:9"}
    agent = WorkerAgent()
    agent.start([sys.executable, "-c", "import os; print(os.environ['PYTHONPATH'])"], env, sealed_for(agent), str(tmp_path))
    output, status = read_to_end(agent)
    assert status == 0, output
    assert output.decode().splitlines() == [os.pathsep.join([AUTOLOAD_DIR, str(users)])]


def test_the_nodes_pythonpath_keeps_the_users_entries_in_order():
    assert node_pythonpath(None) == AUTOLOAD_DIR
    assert node_pythonpath("") == AUTOLOAD_DIR
    other = "/elsewhere/venv/lib/python3.11/site-packages/lightning_elastic/_autoload"
    assert node_pythonpath(os.pathsep.join([other, "/a", AUTOLOAD_DIR, "/b/_autoload", "/c"])) == os.pathsep.join(
        [AUTOLOAD_DIR, "/a", "/b/_autoload", "/c"]
    )
