"""Jobs on a real Ray cluster: ``launch --ray`` and ``ElasticRayExecutor``.

One ``ray.cluster_utils.Cluster`` for the module: a head with no CPU (so no worker lands on
it) and, per test, worker nodes of one CPU each (separate raylets on this machine), which
the test removes or adds during training. Ray stays small: no dashboard, 80 MiB object
stores. Every node a test added is removed when it ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.integration.harness import REPO, Job, assert_epochs_complete, assert_replicas_identical, wait_for
from tests.integration.test_elastic_launch import SLOW, STEADY, last_step_of_round, synced_step
from tests.integration.test_lightning import assert_exactly_once, assert_final_state
from tests.integration.test_lightning import start as start_lightning

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a local Ray cluster: minutes

MB = 2**20
EXECUTOR_EXAMPLE = REPO / "examples" / "ray_executor.py"
SMALL = {"include_dashboard": False, "object_store_memory": 80 * MB}


def host_of(node: Any) -> str:
    """The host name the driver gives a Ray node."""
    return f"ray-{node.node_id[:12]}"


class RayCluster:
    def __init__(self) -> None:
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **SMALL})
        self.added: list[Any] = []

    @property
    def address(self) -> str:
        return self.cluster.address

    def add(self) -> Any:
        node = self.cluster.add_node(num_cpus=1, **SMALL)
        self.added.append(node)
        return node

    def remove(self, node: Any) -> None:
        self.added.remove(node)
        self.cluster.remove_node(node)

    def remove_all(self) -> None:
        for node in list(self.added):
            self.remove(node)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    c = RayCluster()
    try:
        yield c
    finally:
        c.cluster.shutdown()


@pytest.fixture
def nodes(cluster: RayCluster) -> Iterator[RayCluster]:
    """The cluster; the nodes a test adds are removed when it ends."""
    try:
        yield cluster
    finally:
        cluster.remove_all()


def add_nodes(cluster: RayCluster, count: int) -> list[Any]:
    return [cluster.add() for _ in range(count)]


def ray_args(cluster: RayCluster, *extra: str) -> list[str]:
    return ["--ray", cluster.address, *extra]


def worker_started_on(job: Job, host: str) -> list[dict[str, Any]]:
    return [e for e in job.events("start") if e["worker"].startswith(f"{host}[")]


def test_cli_trains_to_the_end_on_three_nodes(job: Job, nodes: RayCluster) -> None:
    add_nodes(nodes, 3)
    # --child: what each worker starts ends with it (the node agent ends its group)
    code = job.run(ray_args(nodes, "-np", "3"), [*STEADY, "--epochs", "2", "--child"], timeout=180)
    assert code == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [3]
    hosts = {e["worker"].split("[")[0] for e in job.events("start")}
    assert hosts == {host_of(n) for n in nodes.added}  # a worker per node, none on the CPU-less head
    assert "[0] training finished: " in job.stdout()  # rank-prefixed output came back to the driver
    assert_epochs_complete(job, 2)
    assert_replicas_identical(job)


def test_ray_local_starts_a_private_ray_for_the_job(job: Job) -> None:
    # This machine's 2 CPUs make one node of 2 slots, next to the module's cluster.
    code = job.run(["--ray", "local", "-np", "2"], [*STEADY, "--epochs", "1"], timeout=180)
    assert code == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [2]
    assert len({e["worker"].split("[")[0] for e in job.events("start")}) == 1
    assert_epochs_complete(job, 1)


def test_node_removed_mid_training_survivors_go_on(job: Job, nodes: RayCluster) -> None:
    victim = add_nodes(nodes, 3)[-1]
    job.start(ray_args(nodes, "-np", "3", "--min-np", "1"), [*STEADY, "--epochs", "3"])
    job.wait_rounds(1)
    job.wait_steps(5)
    nodes.remove(victim)
    assert job.wait(180) == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert job.world_sizes() == [3, 2]
    assert f"its Ray actor on {host_of(victim)} died" in err
    assert f"Blacklisted host {host_of(victim)}" in err
    assert synced_step(job, 2) % 2 == 0  # the survivors restored the last commit
    survivors = {e["pid"] for e in job.events("start") if not e["worker"].startswith(host_of(victim))}
    assert {e["pid"] for e in job.events("done")} == survivors  # the same processes went on
    assert_epochs_complete(job, 3)
    assert_replicas_identical(job)


def test_node_added_mid_training_joins_with_the_state(job: Job, nodes: RayCluster) -> None:
    add_nodes(nodes, 2)
    job.start(ray_args(nodes, "-np", "2", "--min-np", "1", "--max-np", "3"), [*SLOW, "--epochs", "4"])
    job.wait_rounds(1)
    job.wait_steps(3)
    joiner = nodes.add()
    assert job.wait(180) == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [2, 3]
    assert synced_step(job, 2) == last_step_of_round(job, 2)  # nothing rolled back
    synced = [e for e in job.events("synced") if e["worker"].startswith(host_of(joiner))]
    assert synced and synced[0]["round"] == 2
    assert "failures:      0" in job.stderr()
    assert_epochs_complete(job, 4)
    assert_replicas_identical(job)


def test_drained_node_is_a_graceful_removal(job: Job, nodes: RayCluster) -> None:
    drained = add_nodes(nodes, 3)[-1]
    # Slow steps: `ray drain-node` itself takes seconds to start (it imports Ray).
    job.start(ray_args(nodes, "-np", "3", "--min-np", "1"), [*SLOW, "--epochs", "4"])
    job.wait_rounds(1)
    job.wait_steps(2)
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray_cli, "drain-node", "--address", nodes.address, "--node-id", drained.node_id,
                    "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot instance reclaimed",
                    "--deadline-remaining-seconds", "60"], check=True, capture_output=True, timeout=60)
    assert job.wait(180) == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert job.world_sizes() == [3, 2]
    assert "failures:      0" in err and "blacklisted:   none" in err
    assert f"removed {[host_of(drained)]}" in err
    assert synced_step(job, 2) == last_step_of_round(job, 3)  # a removal keeps the live state
    assert_epochs_complete(job, 4)
    assert_replicas_identical(job)


def test_killed_worker_actor_is_a_lost_worker(job: Job, nodes: RayCluster) -> None:
    add_nodes(nodes, 2)
    victim = nodes.add()
    job.start(ray_args(nodes, "-np", "3", "--min-np", "1"), [*STEADY, "--epochs", "3"])
    job.wait_rounds(1)
    job.wait_steps(5)
    worker = worker_started_on(job, host_of(victim))[0]["worker"]
    ray.init(address=nodes.address, logging_level="WARNING", log_to_driver=False)
    try:
        named = wait_for(
            lambda: [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(f":{worker}")],
            30, "the worker's named actor",
        )
        ray.kill(ray.get_actor(named[0]["name"], namespace=named[0]["namespace"]))
    finally:
        ray.shutdown()
    assert job.wait(180) == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert job.world_sizes() == [3, 2]
    assert f"worker {worker} was lost: its Ray actor on {host_of(victim)} died" in err
    assert f"Blacklisted host {host_of(victim)}" in err
    assert_epochs_complete(job, 3)
    assert_replicas_identical(job)


def test_lightning_example_under_ray_with_a_node_removed(job: Job, nodes: RayCluster) -> None:
    add_nodes(nodes, 2)
    victim = nodes.add()
    start_lightning(job, ray_args(nodes, "-np", "3", "--min-np", "1"))
    job.wait_steps(7)
    nodes.remove(victim)
    assert job.wait(240) == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [3, 2]
    assert f"Blacklisted host {host_of(victim)}" in job.stderr()
    survivors = {e["pid"] for e in job.events("start") if not e["worker"].startswith(host_of(victim))}
    assert {e["pid"] for e in job.events("done")} == survivors
    history = assert_exactly_once(job)
    assert_final_state(job, history, start_size=3, end_size=2)


def test_killed_driver_leaves_no_worker_behind(job: Job, nodes: RayCluster) -> None:
    add_nodes(nodes, 2)
    job.start(ray_args(nodes, "-np", "2"), [*STEADY, "--epochs", "50"])
    job.wait_rounds(1)
    job.wait_steps(3)
    workers = [psutil.Process(e["pid"]) for e in job.events("start")]
    assert job.proc is not None
    job.proc.kill()  # SIGKILL: none of the driver's own shutdown runs
    job.proc.wait(10)
    # Ray ends the actors of a driver that is gone; each worker dies with its actor.
    wait_for(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers), 60,
             "the workers to end with their driver")


def test_a_command_that_cannot_start_is_reported_in_one_line(job: Job, nodes: RayCluster) -> None:
    node = add_nodes(nodes, 1)[0]
    job.start(ray_args(nodes, "-np", "1", "--elastic-timeout", "5"), command=["/nonexistent/python", "train.py"])
    assert job.wait(120) == 1
    assert (f"cannot start '/nonexistent/python' on {host_of(node)}: [Errno 2] No such file or directory"
            in job.stderr())
    assert "job failed" in job.reason()


def run_executor_example(cluster: RayCluster, tmp_path: Path, *args: str) -> dict[str, Any]:
    """``examples/ray_executor.py`` from a plain Python process (no CLI); its JSON line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ELASTIC_")}
    done = subprocess.run([sys.executable, str(EXECUTOR_EXAMPLE), "--address", cluster.address, *args],
                          capture_output=True, text=True, timeout=200, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Round 1 formed with 2 worker(s)" in done.stderr  # the driver's log, in the caller's process
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_python_api_returns_the_final_rounds_results_in_rank_order(tmp_path, nodes: RayCluster) -> None:
    add_nodes(nodes, 2)
    outcome = run_executor_example(nodes, tmp_path, "--np", "2", "--steps", "20", "--runs", "2")
    assert outcome["runs"] == 2  # run() again on the same executor
    results = outcome["results"]
    assert [(r["rank"], r["size"], r["steps"]) for r in results] == [(0, 2, 20), (1, 2, 20)]
    assert results[0]["loss"] < 10.0


def test_python_api_raises_a_user_error_with_its_message(tmp_path, nodes: RayCluster) -> None:
    add_nodes(nodes, 2)
    error = run_executor_example(nodes, tmp_path, "--np", "2", "--fail-with", "bad learning rate 7")["error"]
    assert error.startswith("elastic job failed: all 2 worker(s) of round 1 failed")
    assert "ValueError: bad learning rate 7" in error
    assert "\n" not in error
