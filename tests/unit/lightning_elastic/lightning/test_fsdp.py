"""strategy="elastic_fsdp": its options, its name, and a fit's sharded parts with several
optimizers (lightning_elastic/lightning/fsdp.py, sharded_commit.py). The strategy's resets run
in real launches: tests/integration/test_lightning_sharded.py."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.troubleshooting_rows import assert_documented
from tests.unit.fakes import run_ranks

pytest.importorskip("lightning")
from lightning_elastic.lightning.fsdp import ElasticFSDPStrategy  # noqa: E402

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tensor_parallel_size=2), "ElasticFSDPStrategy: tensor_parallel_size=2: tensor parallelism is not "
                                       "supported; expected 1 (FSDP2 over every rank of the job)"),
        (dict(data_parallel_size=4), "ElasticFSDPStrategy: data_parallel_size=4: the data-parallel size is the job's "
                                     "world size, set by lightning-elastic launch; expected it left out"),
        (dict(timeout="10 minutes"), "ElasticFSDPStrategy: timeout must be a datetime.timedelta, got '10 minutes'"),
        (dict(process_group_backend="mpi"), "process_group_backend: expected one of 'gloo', 'nccl', got 'mpi'"),
    ],
)
def test_invalid_options_are_one_line_errors_when_the_strategy_is_built(kwargs, message):
    with pytest.raises(ValueError) as info:
        ElasticFSDPStrategy(**kwargs)
    assert str(info.value) == message
    if "parallel_size" in message:
        assert_documented(message)


def test_tensor_parallel_size_one_and_a_timeout_are_accepted():
    strategy = ElasticFSDPStrategy(tensor_parallel_size=1, timeout=timedelta(minutes=5))
    assert strategy.commits_together


def test_the_name_is_registered_with_lightning():
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_elastic  # noqa: F401  (registers both names once lightning.pytorch is imported)

    assert StrategyRegistry["elastic_fsdp"]["strategy"] is ElasticFSDPStrategy


# ----- a fit's parts: the module with each of its optimizers --------------------------


class Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 6)
        self.b = torch.nn.Linear(6, 3)
        self.register_buffer("scale", torch.full((3,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) * self.scale


def _build(meta: bool) -> tuple[Two, list[torch.optim.Optimizer]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    with torch.device("meta") if meta else torch.device("cpu"):
        module = Two()
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(module.a, mesh=mesh)
    fully_shard(module.b, mesh=mesh)
    if meta:
        module.to_empty(device="cpu")
    optimizers = [torch.optim.AdamW(module.a.parameters(), lr=0.1),
                  torch.optim.SGD(module.b.parameters(), lr=0.2, momentum=0.9)]
    return module, optimizers


def _state(module: Two, optimizers: list[torch.optim.Optimizer]) -> list[Any]:
    out: list[Any] = [t.to_local().clone() if hasattr(t, "to_local") else t.clone()
                      for t in (*module.parameters(), *module.buffers())]
    for optimizer in optimizers:
        for param in (p for g in optimizer.param_groups for p in g["params"]):
            for key, value in sorted(optimizer.state[param].items()):
                out.append((key, value.to_local().clone() if hasattr(value, "to_local") else value))
        out.append([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    return out


def two_optimizers_round_trip(rank: int, worker: object) -> str:
    from lightning_elastic.lightning import compat
    from lightning_elastic.lightning.commit import CommitInfo
    from lightning_elastic.lightning.sharded_commit import destinations, load_fit, split_fit
    from lightning_elastic.training.state import to_host

    module, optimizers = _build(meta=False)
    module.scale.fill_(3.0)
    for _ in range(2):
        module(torch.randn(5, 4)).sum().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    checkpoint = {"state_dict": "weights", "optimizer_states": "moments", "epoch": 0, "lr_schedulers": []}
    info = CommitInfo(2, 2, None, compat.collect_rng_states())
    entries, tensors, rest = split_fit(module, optimizers, checkpoint, info)
    kinds = sorted({e.key[0] for e in entries})
    # A rebuild at the same world size: each local row is this rank's own.
    fresh, fresh_optimizers = _build(meta=True)
    with torch.no_grad():  # as exchange.run_transfers writes them
        for index, target in destinations(fresh, fresh_optimizers, tuple(entries)).items():
            target.copy_(tensors[index])
    loaded = load_fit(fresh, fresh_optimizers, to_host(rest), 2)
    same = all(_equal(a, b) for a, b in zip(_state(module, optimizers), _state(fresh, fresh_optimizers), strict=True))
    try:
        load_fit(fresh, fresh_optimizers[:1], to_host(rest), 2)
        mismatch = "no error"
    except Exception as err:  # noqa: BLE001 - the message is what is checked
        mismatch = str(err)
    return repr((kinds, same, sorted(loaded), mismatch))


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return a[0] == b[0] and _equal(a[1], b[1])
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_a_fit_with_two_optimizers_comes_back_whole_in_a_rebuilt_module():
    results = run_ranks(2, two_optimizers_round_trip, timeout=60)
    kinds, same, keys, mismatch = eval(results[0])  # noqa: S307 - our own repr
    assert results[0] == results[1]
    assert kinds == ["model", "optimizer", "optimizer1.optimizer"]  # AdamW's moments, SGD's momentum
    assert same, "the rebuilt module or optimizers differ from the committed ones"
    assert keys == ["epoch", "lr_schedulers"]  # Lightning's state dicts are the rows instead
    assert mismatch == ("sharded state: the commit has 2 optimizer(s), the rebuilt fit 1; expected "
                        "configure_optimizers to return the same optimizers every time")


# ----- a fit's durable snapshot: written at 2 ranks, read back at 1 ---------------------


def _one_optimizer(meta: bool) -> tuple[Two, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    with torch.device("meta") if meta else torch.device("cpu"):
        module = Two()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    fully_shard(module.a, mesh=mesh)
    fully_shard(module.b, mesh=mesh)
    if meta:
        module.to_empty(device="cpu")
    return module, torch.optim.AdamW(module.parameters(), lr=0.1)


def _digest(module: Two, optimizer: torch.optim.Optimizer) -> list[Any]:
    def full(t: Any) -> Any:
        return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()

    out: list[Any] = [full(t) for t in (*module.parameters(), *module.buffers())]
    for param in module.parameters():
        out += [(k, full(v)) for k, v in sorted(optimizer.state[param].items())]
    return [*out, [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]]


def write_fit_snapshot(directory: str, rank: int, worker: Any) -> list[Any]:
    from lightning_elastic.durable.files import SHARDED, SnapshotSettings
    from lightning_elastic.durable.store import SnapshotInfo
    from lightning_elastic.lightning import compat
    from lightning_elastic.lightning.commit import CommitInfo, SamplerPosition
    from lightning_elastic.lightning.sharded_commit import split_fit
    from lightning_elastic.lightning.sharded_snapshot import fit_tree
    from lightning_elastic.sharded.commit import ShardedCommit
    from lightning_elastic.sharded.layout import Layout
    from lightning_elastic.sharded.snapshots import ShardedSnapshotWriter, SnapshotPlan

    module, optimizer = _one_optimizer(meta=False)
    module.scale.fill_(3.0)
    for _ in range(2):
        module(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    for group in optimizer.param_groups:
        group["lr"] = 0.05  # a scheduler's doing: saved with the groups
    checkpoint = {"state_dict": "weights", "optimizer_states": "moments", "epoch": 0, "loops": {"done": 2}}
    info = CommitInfo(2, 2, SamplerPosition(0, 8, 20, 2), compat.collect_rng_states())
    entries, tensors, rest = split_fit(module, [optimizer], checkpoint, info)
    commit = ShardedCommit()
    commit.save(entries, tensors, rest, Layout(1, 2, 0), rank, torch.device("cpu"), worker.wait_collective)
    writer = ShardedSnapshotWriter(SnapshotSettings(directory), rank, 2, SnapshotPlan("abcd1234", 1), "job-1")
    assert commit.own is not None
    assert writer.offer(fit_tree(commit.own.rows, commit.own.rest),
                        SnapshotInfo(round=1, step=2, epoch=0, world_size=2, sampler=None, kind=SHARDED))
    writer.close(30)
    return _digest(module, optimizer)


def read_fit_snapshot(directory: str, rank: int, worker: object) -> Any:
    from lightning_elastic.durable import files
    from lightning_elastic.lightning.sharded_snapshot import read_fit

    module, optimizer = _one_optimizer(meta=True)
    found = files.newest_valid(directory, print)
    assert found is not None, "no snapshot published"
    checkpoint, info = read_fit(found, module, optimizer)
    return _digest(module, optimizer), checkpoint, (info.world_size, info.global_step, info.sampler)


def test_a_fits_snapshot_written_at_two_ranks_is_read_back_whole_at_one(tmp_path):
    import functools

    from lightning_elastic.lightning.commit import SamplerPosition

    written = run_ranks(2, functools.partial(write_fit_snapshot, str(tmp_path)), timeout=60)
    assert all(_equal(a, b) for a, b in zip(written[0], written[1], strict=True))
    (read,) = run_ranks(1, functools.partial(read_fit_snapshot, str(tmp_path)), timeout=60)
    digest, checkpoint, info = read
    assert all(_equal(a, b) for a, b in zip(written[0], digest, strict=True)), "the state read differs"
    assert checkpoint == {"epoch": 0, "loops": {"done": 2}}  # Lightning's state dicts are the rows instead
    assert info == (2, 2, SamplerPosition(0, 8, 20, 2))


def test_a_fits_snapshot_is_refused_by_a_sharded_state_in_one_line(tmp_path):
    import functools

    from lightning_elastic.durable import files
    from lightning_elastic.errors import ElasticError
    from lightning_elastic.sharded.state import ShardedState

    run_ranks(2, functools.partial(write_fit_snapshot, str(tmp_path)), timeout=60)
    found = files.newest_valid(str(tmp_path), print)
    assert found is not None
    with pytest.raises(ElasticError) as refused:
        # The check comes before anything is built: no state or worker is needed to reach it.
        ShardedState._resume_from(None, found)  # type: ignore[arg-type]
    message = str(refused.value)
    assert message == (f'{files.base_name(found.path)}: a sharded snapshot of a strategy="elastic_fsdp" fit, not of '
                       "a le.ShardedState (to start over: --no-resume, or another --snapshot-dir)")
    assert "\n" not in message
    assert_documented(message)
