"""Workers as srun steps on a real Slurm cluster of namespaced nodes (see slurm_cluster.py),
with real faults: a worker SIGKILLed, a node whose every process dies, a step sent SIGTERM
through Slurm, ``--slurm`` outside an allocation.
"""

from __future__ import annotations

import time

import pytest

from tests.integration.slurm_cluster import SlurmCluster, job_nodes

pytestmark = [pytest.mark.integration, pytest.mark.slurm]


@pytest.mark.timeout(60)
def test_the_testbed_is_a_slurm_cluster_of_namespaced_nodes(slurm: SlurmCluster) -> None:
    started = time.monotonic()
    job_id = slurm.allocate(slurm.nodes[:3])
    assert job_nodes(slurm, job_id) == slurm.nodes[:3]
    out = slurm.run(["srun", "--jobid", job_id, "--overlap", "-N3", "hostname"]).stdout.split()
    assert sorted(out) == slurm.nodes[:3]  # each step task on its own host name
    assert time.monotonic() - started < 10
