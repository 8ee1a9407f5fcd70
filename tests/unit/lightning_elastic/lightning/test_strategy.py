"""ElasticStrategy(timeout=..., process_group_backend=...): checked at once, applied to the worker."""

from __future__ import annotations

from datetime import timedelta

import pytest

from lightning_elastic.membership.worker import ElasticWorker
from tests.troubleshooting_rows import assert_documented

pytest.importorskip("lightning")
from lightning_elastic.lightning.strategy import ElasticStrategy  # noqa: E402


def test_timeout_and_backend_reach_the_workers_process_group():
    worker = ElasticWorker(None)  # a world of one: no launcher
    ElasticStrategy(worker=worker, timeout=timedelta(minutes=5), process_group_backend="gloo")
    assert worker.collective_timeout == 300.0
    worker.start()
    try:
        assert worker.backend == "gloo"
    finally:
        worker.shutdown()


def test_without_options_the_launchers_bound_applies():
    worker = ElasticWorker(None)
    ElasticStrategy(worker=worker)
    assert worker.collective_timeout == 1800.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(timeout=timedelta(seconds=-1)), "timeout: expected a positive, finite number of seconds, got -1.0"),
        (dict(timeout="10 minutes"), "ElasticStrategy: timeout must be a datetime.timedelta, got '10 minutes'"),
        (dict(process_group_backend="mpi"), "process_group_backend: expected one of 'gloo', 'nccl', got 'mpi'"),
    ],
)
def test_invalid_options_fail_when_the_strategy_is_built(kwargs, message):
    with pytest.raises(ValueError) as info:
        ElasticStrategy(**kwargs)
    assert str(info.value) == message


# ----- devices and num_nodes: the launcher decides, a value asking otherwise is said to be ignored ----


def build(api: str, **kwargs):
    """A Trainer or Fabric with the elastic strategy in a world of one; the warnings it gave."""
    import warnings  # noqa: PLC0415

    worker = ElasticWorker(None)
    worker.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if api == "Trainer":
                import lightning.pytorch as pl  # noqa: PLC0415

                pl.Trainer(strategy=ElasticStrategy(worker=worker), accelerator="cpu", logger=False,
                           enable_progress_bar=False, enable_model_summary=False, **kwargs)
            else:
                from lightning.fabric import Fabric  # noqa: PLC0415

                from lightning_elastic.fabric import ElasticFabricStrategy  # noqa: PLC0415

                Fabric(strategy=ElasticFabricStrategy(worker=worker), accelerator="cpu", **kwargs)
    finally:
        worker.shutdown()
    return [str(w.message) for w in caught if "lightning-elastic" in str(w.message)]


@pytest.mark.parametrize("api", ["Trainer", "Fabric"])
def test_devices_asking_for_several_processes_are_said_to_be_ignored(api):
    warned = build(api, devices=4)
    assert_documented(warned[0].replace(api, "Trainer"))  # the row is written for Trainer, and says Fabric too
    assert warned == [
        f'lightning-elastic: strategy="elastic_hvd" ignores {api}(devices=...) asking for 4 devices: '
        "lightning-elastic launch starts one process per device (launch -np and the hosts' slots set how many; "
        "the job has 1 now), and this process uses cpu. Leave devices out."
    ]


@pytest.mark.parametrize("api", ["Trainer", "Fabric"])
def test_num_nodes_is_said_to_be_ignored(api):
    warned = build(api, num_nodes=2)
    assert_documented(warned[0].replace(api, "Trainer"))
    assert warned == [
        f'lightning-elastic: strategy="elastic_hvd" ignores {api}(num_nodes=2): the hosts are lightning-elastic '
        "launch's (-H, --hostfile, --host-discovery-script, --ray or --slurm; the job has 1 process(es) now). "
        "Leave num_nodes out."
    ]


@pytest.mark.parametrize("kwargs", [{}, {"devices": 1}, {"devices": "auto", "num_nodes": 1}])
def test_devices_and_num_nodes_that_ask_for_nothing_else_say_nothing(kwargs):
    assert build("Trainer", **kwargs) == []


def test_snapshot_options_reach_the_worker_and_bad_ones_fail_when_the_strategy_is_built(tmp_path):
    worker = ElasticWorker(None)
    ElasticStrategy(worker=worker, snapshot_dir=tmp_path, snapshot_every=5.0, snapshot_keep=3, resume=False)
    assert worker.snapshot_writer is not None
    assert (worker.snapshot_writer.settings.every, worker.snapshot_writer.settings.keep) == (5.0, 3)
    assert worker.resume_from is None  # resume=False
    with pytest.raises(ValueError, match="--snapshot-every: expected a positive"):
        ElasticStrategy(worker=ElasticWorker(None), snapshot_dir=tmp_path, snapshot_every=0)
    with pytest.raises(ValueError, match="need snapshot_dir"):
        ElasticStrategy(worker=ElasticWorker(None), snapshot_every=5.0)
# ----- under srun: Slurm's variables say one task of rank 0; the elastic job's ranks apply ----

SRUN_STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "3", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "train", "SLURM_NNODES": "1"}


@pytest.mark.parametrize("api", ["Trainer", "Fabric"])
def test_in_an_srun_step_the_elastic_environment_is_used_not_slurms(api, monkeypatch):
    from lightning.fabric.plugins.environments import SLURMEnvironment  # noqa: PLC0415

    from lightning_elastic.lightning.environment import ElasticEnvironment  # noqa: PLC0415

    for name, value in SRUN_STEP.items():
        monkeypatch.setenv(name, value)
    assert SLURMEnvironment.detect()  # what Lightning would pick on its own here
    worker = ElasticWorker(None)
    worker.start()
    try:
        if api == "Trainer":
            import lightning.pytorch as pl  # noqa: PLC0415

            trainer = pl.Trainer(strategy=ElasticStrategy(worker=worker), accelerator="cpu", logger=False,
                                 enable_progress_bar=False, enable_model_summary=False)
            environment = trainer.strategy.cluster_environment
        else:
            from lightning.fabric import Fabric  # noqa: PLC0415

            from lightning_elastic.fabric import ElasticFabricStrategy  # noqa: PLC0415

            environment = Fabric(strategy=ElasticFabricStrategy(worker=worker), accelerator="cpu").strategy.cluster_environment
        assert isinstance(environment, ElasticEnvironment)
        assert not isinstance(environment, SLURMEnvironment)
    finally:
        worker.shutdown()


def test_a_slurm_environment_plugin_with_the_elastic_strategy_is_refused(monkeypatch):
    import lightning.pytorch as pl  # noqa: PLC0415
    from lightning.fabric.plugins.environments import SLURMEnvironment  # noqa: PLC0415

    for name, value in SRUN_STEP.items():
        monkeypatch.setenv(name, value)
    worker = ElasticWorker(None)
    worker.start()
    try:
        with pytest.raises(Exception, match="cluster_environment set through both strategy class and plugins"):
            pl.Trainer(strategy=ElasticStrategy(worker=worker), plugins=[SLURMEnvironment()], accelerator="cpu",
                       logger=False)
    finally:
        worker.shutdown()
