"""lightning_elastic/sharded: durable sharded snapshots in the torch.distributed.checkpoint format.

The pure parts (flattening, pieces, the merge, the plan, manifests, leftovers) are tested
without processes, and so is the writer: writers of several ranks in one process share
nothing but the directory, as the ranks' writer threads do. Real ranks (``run_ranks``:
gloo processes from a forkserver) train an FSDP2 model at world 4 and write it. The
snapshot is then read back at worlds 2, 1 and 3 and compared, bit for bit, with the state
gathered at world 4.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import pickle
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

import lightning_elastic as le
from lightning_elastic.durable import files
from lightning_elastic.durable.files import SnapshotError, SnapshotSettings
from lightning_elastic.durable.store import ResumePlan, SnapshotInfo, WriterStats, locate
from lightning_elastic.sharded import dcp_format, snapshots
from lightning_elastic.sharded.dcp_format import Part, PartItem, ShardPiece, flatten, merge
from lightning_elastic.sharded.snapshots import ShardedSnapshotWriter, SnapshotPlan, read_sharded, steps_between
from tests.troubleshooting_rows import assert_documented
from tests.unit.fakes import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's "assuming a single process"

ROWS = (5, 7, 3)  # each Linear's out_features: uneven at every world size tested
PLAN = SnapshotPlan("abcd1234", 1)


def info(step: int, world_size: int = 2, **extra: Any) -> SnapshotInfo:
    return SnapshotInfo(round=1, step=step, epoch=0, world_size=world_size, sampler={"epoch": 0, "consumed": step},
                        kind=files.SHARDED, extra=extra or None)


def rows_of(full: torch.Tensor, rank: int, world_size: int) -> ShardPiece:
    """Rank ``rank``'s rows of ``full`` as FSDP2 shards it (torch.chunk semantics)."""
    chunk = math.ceil(full.shape[0] / world_size)
    start = rank * chunk
    return ShardPiece(full[start:start + chunk], tuple(full.shape), start)


def full_tree(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(5, 3, generator=g), "b": torch.randn(5, generator=g)},
            "optimizer": {"state": {"w": {"step": torch.tensor(float(step))}},
                          "param_groups": [{"lr": 0.1, "params": ["w", "b"]}]},
            "extra": {"epoch": step, "names": ("a", "b")}}


def tree_of(full: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """A rank's tree: the model's tensors as its rows, the rest as it is (the same everywhere)."""
    return {**full, "model": {k: rows_of(v, rank, world_size) for k, v in full["model"].items()}}


def write_ranks(directory: Any, full: dict[str, Any], step: int, world_size: int, plan: SnapshotPlan = PLAN,
                keep: int = 2, absent: tuple[int, ...] = (), publish_wait: float = 10.0) -> list[ShardedSnapshotWriter]:
    """Each rank's writer offers its tree, as the ranks of a round do; the ranks in ``absent`` never write."""
    writers = [ShardedSnapshotWriter(SnapshotSettings(directory, keep=keep), r, world_size, plan, "job-1",
                                     publish_wait=publish_wait) for r in range(world_size)]
    for rank, writer in enumerate(writers):
        if rank not in absent:
            assert writer.offer(tree_of(full, rank, world_size), info(step, world_size))
    for writer in writers:
        assert writer.wait(20)
    return writers


def empty_like(full: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in full["model"].items()},
            "optimizer": {"state": {"w": {"step": torch.tensor(0.0)}}, "param_groups": [{"lr": 0.0, "params": []}]},
            "extra": {"epoch": -1, "names": ()}}


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Bitwise: tensors of the same dtype and bytes, everything else equal, at every key."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), (where, sorted(actual), sorted(expected))
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}.{i}")
    else:
        assert actual == expected, where


# ----- flattening, pieces, the merge ----------------------------------------------------------


@pytest.mark.parametrize("tree", [
    {"a": {"b": 1, "c": [1, 2]}, "d": (3, 4)},  # a list of plain values and a tuple are leaves
    {"a": [torch.ones(2), torch.zeros(1)], "b": [[1, 2], [3]], "c": {}},  # a list with tensors is walked; {} vanishes
    {"o": {"state": {"0.weight": {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1, "params": ["x"]}]}},
    {1: {2: "x"}, "l": [{"k": 1}, 5], "e": []},  # int keys become strings; a list with a dict is walked
    {"n": [[torch.ones(1)], 7]},  # a list holding a list with a tensor
    {"t": (torch.ones(1), 2)},  # a tuple stays a leaf even with a tensor in it
])
def test_keys_are_flattened_as_dcp_flattens_them(tree):
    flat = flatten(tree)
    expected, mapping = flatten_state_dict(tree)
    assert list(flat.leaves) == list(expected) and flat.paths == mapping


def test_a_piece_in_a_list_counts_as_a_tensor_when_flattening():
    piece = ShardPiece(torch.ones(1, 2), (3, 2), 0)
    assert list(flatten({"l": [piece, 1]}).leaves) == list(flatten_state_dict({"l": [torch.ones(3, 2), 1]})[0])


@pytest.mark.parametrize(("make", "message"), [
    (lambda: ShardPiece(torch.ones(2, 3), (5, 4), 0), r"rows of shape \(2, 3\) do not fit a tensor of global shape"),
    (lambda: ShardPiece(torch.ones(2, 3), (5, 3), 4), r"rows \[4, 6\) are not within the 5 rows"),
    (lambda: ShardPiece(torch.ones(2, 3), (5, 3), -1), r"rows \[-1, 1\) are not within"),
    (lambda: ShardPiece([1, 2], (2,), 0), "expected a plain CPU tensor"),
    (lambda: ShardPiece(torch.ones(()), (), 0), r"rows of shape \(\) do not fit"),
])
def test_a_piece_that_cannot_be_rows_of_its_tensor_is_refused_in_one_line(make, message):
    with pytest.raises(SnapshotError, match=message) as caught:
        make()
    assert "\n" not in str(caught.value)


def test_an_empty_piece_sits_at_the_end_of_the_rows_as_a_dtensor_shard_says():
    # 5 rows at world 4: chunks of 2, rank 3 starts at row 6 and holds none.
    assert rows_of(torch.ones(5, 4), 3, 4).chunk_offsets == (5, 0)
    assert rows_of(torch.ones(5, 4), 2, 4).chunk_offsets == (4, 0)


def test_a_dtensor_offered_whole_is_refused_with_the_fix():
    class FakeDTensor(torch.Tensor):
        def to_local(self) -> torch.Tensor:
            return self

    with pytest.raises(SnapshotError, match=r"m\.w: a DTensor; offer this rank's rows as ShardPiece"):
        dcp_format.check_leaves(flatten({"m": {"w": torch.ones(2).as_subclass(FakeDTensor)}}).leaves)


def part(rank: int, world: int, items: list[PartItem]) -> Part:
    return Part(rank, world, 1, "abcd1234", dcp_format.data_file_name(rank), 10, "0" * 64, tuple(items))


def rows(key: str, offset: int, count: int, total: int = 4) -> PartItem:
    return PartItem(key, "tensor", 0, 1, "torch.float32", (total, 2), (offset, 0), (count, 2), True)


W = ("w",)
WX = ("w", "x")


@pytest.mark.parametrize(("keys", "parts", "message"), [
    (W, [part(0, 2, [rows("w", 0, 2)]), part(1, 2, [rows("w", 3, 1)])], "w: rank 1's rows start at 3, expected 2"),
    (W, [part(0, 2, [rows("w", 0, 2)]), part(1, 2, [rows("w", 1, 3)])], "w: rank 1's rows start at 1, expected 2"),
    (W, [part(0, 2, [rows("w", 0, 2)]), part(1, 2, [rows("w", 2, 1)])], "w: the ranks' rows end at 3, the tensor has 4"),
    (W, [part(0, 2, [rows("w", 0, 2)]), part(1, 2, [])], r"w: no rows from rank\(s\) 1"),
    (W, [part(0, 2, [rows("w", 0, 2)]), part(1, 2, [rows("w", 2, 2), rows("v", 0, 4)])],
     "v: written by rank 1 but not in rank 0's tree"),
    (WX, [part(0, 2, [rows("w", 0, 2)]), part(1, 2, [rows("w", 2, 2), PartItem("x", "bytes", 0, 1)])],
     "x: written whole by rank 1; only rank 0 writes whole values"),
    (WX, [part(0, 2, [rows("w", 0, 2)]), part(1, 2, [rows("w", 2, 2)])], "x: in rank 0's tree but in no rank's part"),
    (W, [part(1, 2, []), part(0, 2, [])], "part 0 of 2: written by rank 1 of 2"),
])
def test_parts_that_do_not_make_one_checkpoint_are_refused(keys, parts, message):
    with pytest.raises(SnapshotError, match=message):
        merge(parts, {k: (k,) for k in keys}, "here")


def test_a_part_description_round_trips_and_a_torn_one_is_named():
    p = part(1, 2, [rows("w", 2, 2), PartItem("x", "bytes", 5, 9)])
    assert Part.from_json(p.to_json(), "p") == p
    with pytest.raises(SnapshotError, match=r"^where: not a part description \(KeyError"):
        Part.from_json('{"rank": 1}', "where")


# ----- the plan: which commits are written -----------------------------------------------------


def test_which_commits_are_written_depends_on_the_step_alone():
    plan = SnapshotPlan("0123abcd", 3)
    assert [s for s in range(0, 13) if plan.due(s)] == [3, 6, 9, 12]  # never step 0, the state before training
    assert steps_between(60.0, 0.25) == 240 and steps_between(1.0, 5.0) == 1


@pytest.mark.parametrize(("make", "message"), [
    (lambda: SnapshotPlan("ABCD", 1), "token 'ABCD': expected 4 to 32 lowercase hex digits"),
    (lambda: SnapshotPlan("abcd", 0), "every_steps: expected a whole number of steps, 1 or more, got 0"),
    (lambda: steps_between(60.0, 0.0), "seconds_per_step: expected a positive, finite number of seconds, got 0.0"),
    (lambda: steps_between(60.0, float("nan")), "seconds_per_step: expected a positive, finite number"),
])
def test_a_plan_that_cannot_be_followed_is_refused(make, message):
    with pytest.raises(SnapshotError, match=message):
        make()


def test_writers_with_other_clocks_and_a_writer_that_joins_later_decide_alike(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshots.ShardedSnapshotWriter, "_run", lambda self, job: job.part_done.set())  # no disk
    plan = SnapshotPlan("0123abcd", 4)
    settings = SnapshotSettings(tmp_path)
    clocks = [lambda: 0.0, lambda: 1e9, time.monotonic]
    writers = [ShardedSnapshotWriter(settings, r, 3, plan, clock=clocks[r]) for r in range(3)]
    decided: list[list[int]] = [[], [], []]
    for step in range(1, 14):
        if step == 7:  # rank 2 is new in the round: it has seen none of the earlier commits
            writers[2] = ShardedSnapshotWriter(settings, 2, 3, plan, clock=lambda: -5.0)
        for rank, writer in enumerate(writers):
            assert writer.wait(5)
            if writer.offer({"x": 1}, info(step, 3)):
                decided[rank].append(step)
    assert decided == [[4, 8, 12]] * 3


# ----- the writer, ranks simulated in one process ---------------------------------------------


def test_every_ranks_part_and_the_merged_metadata_make_a_dcp_checkpoint_any_world_reads(tmp_path):
    full = full_tree(1)
    writers = write_ranks(tmp_path, full, step=1, world_size=3)
    assert [w.stats for w in writers] == [WriterStats(written=1), WriterStats(), WriterStats()]
    data = "snapshot-step-1-abcd1234.dcp"
    assert sorted(os.listdir(tmp_path)) == ["snapshot-1-step-1.json", data]
    # DCP's layout exactly: one data file per rank and .metadata (the part descriptions are merged and gone).
    assert sorted(os.listdir(tmp_path / data)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    found = files.newest_valid(tmp_path, pytest.fail)
    assert found.path == tmp_path / data and found.manifest.kind == "sharded" and found.manifest.world_size == 3
    assert set(found.manifest.parts) == {".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}
    target = empty_like(full)
    dcp.load(target, checkpoint_id=found.path)  # plain DCP, one process, full tensors
    assert_same(target, full)


def test_a_rank_that_never_writes_leaves_no_snapshot_one_line_and_a_counted_failure(tmp_path, caplog):
    write_ranks(tmp_path, full_tree(1), step=1, world_size=3)
    with caplog.at_level(logging.INFO, logger="lightning_elastic"):
        writers = write_ranks(tmp_path, full_tree(2), step=2, world_size=3, absent=(2,), publish_wait=0.3)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    assert "The sharded snapshot of step 2 in" in lines[0] and "no part from rank(s) 2 within 0.3 s" in lines[0]
    assert_documented(lines[0])
    assert writers[0].stats.failed == 1 and writers[0].stats.last_error == "step 2: no part from rank(s) 2 within 0.3 s"
    assert files.newest_valid(tmp_path, pytest.fail).manifest.step == 1  # the complete one stays the newest
    assert not (tmp_path / "snapshot-step-2-abcd1234.dcp").exists()  # the incomplete parts are removed


def test_a_commit_due_while_this_rank_still_writes_is_skipped_counted_and_the_tensors_are_only_read(tmp_path,
                                                                                                      monkeypatch,
                                                                                                      caplog):
    release = threading.Event()
    real = dcp_format.write_items

    def slow(leaves, rank, sink):  # the disk is slow: the part holds the offered tensors until released
        assert release.wait(10)
        return real(leaves, rank, sink)

    monkeypatch.setattr(snapshots, "write_items", slow)
    full = full_tree(1)
    before = {k: v.clone() for k, v in full["model"].items()}
    writer = ShardedSnapshotWriter(SnapshotSettings(tmp_path), 0, 1, PLAN, publish_wait=5)
    assert writer.offer(tree_of(full, 0, 1), info(1, 1))
    assert writer.writing
    with caplog.at_level(logging.WARNING, logger="lightning_elastic"):
        assert not writer.offer(tree_of(full_tree(2), 0, 1), info(2, 1))  # due, but this rank still writes
    assert writer.stats.failed == 1 and "still writing the part of an earlier snapshot" in writer.stats.last_error
    assert [r.getMessage() for r in caplog.records] == [
        f"Rank 0 could not write its part of a sharded snapshot to {tmp_path} ({writer.stats.last_error}); training "
        "goes on."]
    assert_documented(caplog.records[0].getMessage())
    release.set()
    assert writer.wait(10) and not writer.writing
    assert writer.stats.written == 1
    assert_same(full["model"], before)
    assert not writer.offer(tree_of(full, 0, 1), info(1, 1))  # a step already decided on is not due again


def test_close_is_bounded_and_a_publication_still_waiting_for_parts_then_gives_up(tmp_path):
    writer = ShardedSnapshotWriter(SnapshotSettings(tmp_path), 0, 2, PLAN)  # the default wait: over a minute
    assert writer.offer(tree_of(full_tree(1), 0, 2), info(1))  # rank 1 never writes
    started = time.monotonic()
    writer.close(timeout=0.2)
    assert time.monotonic() - started < 0.2 + snapshots.CLOSE_GRACE
    assert writer.wait(0)
    assert writer.stats.failed == 1 and writer.stats.last_error.startswith("step 1: no part from rank(s) 1 within ")
    assert files.newest_valid(tmp_path, pytest.fail) is None


def test_the_last_k_are_kept_and_a_newer_snapshot_orders_after_older_ones(tmp_path):
    for step in (1, 2, 3):
        write_ranks(tmp_path, full_tree(step), step=step, world_size=2, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["snapshot-2-step-2.json", "snapshot-3-step-3.json",
                                            "snapshot-step-2-abcd1234.dcp", "snapshot-step-3-abcd1234.dcp"]
    # A --no-resume run (another round's token) starting again at step 1 orders after them.
    write_ranks(tmp_path, full_tree(1), step=1, world_size=2, keep=2, plan=SnapshotPlan("feed0001", 1))
    found = files.newest_valid(tmp_path, pytest.fail)
    assert (found.manifest.sequence, found.manifest.step) == (4, 1)
    assert found.path.name == "snapshot-step-1-feed0001.dcp"


def test_a_torn_or_corrupt_part_is_skipped_for_the_previous_snapshot(tmp_path):
    for step in (1, 2):
        write_ranks(tmp_path, full_tree(step), step=step, world_size=2)
    data = tmp_path / "snapshot-step-2-abcd1234.dcp" / "__1_0.distcp"
    content = data.read_bytes()
    data.write_bytes(content[:-1] + bytes([content[-1] ^ 1]))
    warned: list[str] = []
    assert files.newest_valid(tmp_path, warned.append).manifest.step == 1
    assert len(warned) == 1 and "__1_0.distcp: checksum mismatch" in warned[0]
    data.write_bytes(content[:10])
    with pytest.raises(SnapshotError, match=r"__1_0\.distcp: 10 bytes, its manifest says \d+ \(torn or truncated\)"):
        files.check(tmp_path / "snapshot-2-step-2.json", verify=False)


def test_leftovers_go_once_their_writers_are_done_with_them(tmp_path):
    write_ranks(tmp_path, full_tree(1), step=1, world_size=2, keep=5)
    old, recent, ours = ("snapshot-step-7-0badc0de.dcp", "snapshot-step-8-0badc0de.dcp",
                         "snapshot-step-1-abcd1234.dcp")
    for name in (old, recent):  # parts of another round, whose rank 0 never published them
        (tmp_path / name).mkdir()
        (tmp_path / name / "__1_0.distcp").write_bytes(b"x")
    past = time.time() - files.FOREIGN_TEMP_AGE - 60
    for path in (tmp_path / old, tmp_path / old / "__1_0.distcp"):
        os.utime(path, (past, past))
    assert files.remove_sharded_leftovers(tmp_path) == [old]  # untouched for long: gone; the recent one stays
    # The round's own directories up to a published or given-up step go at once, unless a manifest names them.
    (tmp_path / "snapshot-step-2-abcd1234.dcp").mkdir()
    assert files.remove_sharded_leftovers(tmp_path, "abcd1234", 2) == ["snapshot-step-2-abcd1234.dcp"]
    assert sorted(os.listdir(tmp_path)) == ["snapshot-1-step-1.json", ours, recent]


def test_the_resume_plan_finds_it_by_its_directory_and_load_snapshot_says_how_to_read_it(tmp_path):
    write_ranks(tmp_path, full_tree(1), step=1, world_size=2)
    data = tmp_path / "snapshot-step-1-abcd1234.dcp"
    assert ResumePlan(None, tmp_path).locate().path == data  # the newest, as rank 0 searches it
    assert ResumePlan(data, tmp_path).locate().manifest.step == 1  # the driver's choice (LIGHTNING_ELASTIC_RESUME_FROM)
    with pytest.raises(SnapshotError, match=r"a sharded snapshot \(a torch\.distributed\.checkpoint directory\): "
                                            r"load it with torch\.distributed\.checkpoint\.load") as refused:
        le.load_snapshot(tmp_path)
    assert_documented(str(refused.value))
    (tmp_path / "snapshot-1-step-1.json").unlink()  # no manifest: incomplete, never resumed from
    with pytest.raises(SnapshotError, match="no manifest names this sharded snapshot") as incomplete:
        locate(data, verify=False, warn=pytest.fail)
    assert_documented(str(incomplete.value))
    assert files.newest_valid(tmp_path, pytest.fail) is None


def test_a_manifest_naming_a_directory_outside_the_snapshot_directory_is_refused(tmp_path):
    write_ranks(tmp_path, full_tree(1), step=1, world_size=2)
    manifest = tmp_path / "snapshot-1-step-1.json"
    manifest.write_text(manifest.read_text().replace("snapshot-step-1-abcd1234.dcp", "../elsewhere.dcp"))
    with pytest.raises(SnapshotError, match="field data is not a sharded snapshot's directory name"):
        files.check(manifest)


def test_an_fsspec_url_takes_sharded_snapshots_too():
    fsspec = pytest.importorskip("fsspec")
    url = f"memory://sharded-{os.getpid()}-{time.monotonic_ns()}/job"
    try:
        for step in (1, 2, 3):
            write_ranks(url, full_tree(step), step=step, world_size=2)
        found = files.newest_valid(url, pytest.fail)
        assert found.path == f"{url}/snapshot-step-3-abcd1234.dcp"
        assert sorted(files.base_name(n) for n in fsspec.filesystem("memory").ls(url, detail=False)) == [
            "snapshot-2-step-2.json", "snapshot-3-step-3.json",
            "snapshot-step-2-abcd1234.dcp", "snapshot-step-3-abcd1234.dcp"]
        target = empty_like(full_tree(3))
        read_sharded(found.path, target)
        assert_same(target, full_tree(3))
    finally:
        fsspec.filesystem("memory").rm(url.split("/job")[0], recursive=True)


# ----- real ranks: an FSDP2 model written at world 4, read at 2, 1 and 3 ------------------------


def make_model() -> torch.nn.Module:
    layers, width = [], 4
    for rows in ROWS:
        layers += [torch.nn.Linear(width, rows), torch.nn.ReLU()]
        width = rows
    return torch.nn.Sequential(*layers[:-1])


def fsdp_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    torch.manual_seed(seed)
    model = make_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        batch = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + step))
        model(batch).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict  # noqa: PLC0415

    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def gathered(tree: Any) -> Any:
    """Every DTensor of ``tree`` as its full tensor (a collective, in the tree's order)."""
    if hasattr(tree, "full_tensor"):
        return tree.full_tensor()
    if isinstance(tree, dict):
        return {k: gathered(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [gathered(v) for v in tree]
    return tree


def as_pieces(tree: Any, rank: int, world_size: int) -> Any:
    """The offered tree: each DTensor as this rank's rows (``to_local()``), the rest as it is."""
    if hasattr(tree, "to_local"):
        chunk = math.ceil(tree.shape[0] / world_size)
        return ShardPiece(tree.to_local().detach(), tuple(tree.shape), rank * chunk)
    if isinstance(tree, dict):
        return {k: as_pieces(v, rank, world_size) for k, v in tree.items()}
    if isinstance(tree, list):
        return [as_pieces(v, rank, world_size) for v in tree]
    return tree


EXTRA = {"sampler": {"epoch": 1, "consumed": 96}, "note": "world 4"}


def write_at_world_4(directory: str, rank: int, worker: Any) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning_elastic").addHandler(handler)
    model, optimizer = fsdp_model(seed=0)
    train(model, optimizer, steps=2)
    state = state_of(model, optimizer)
    tree = {**as_pieces(state, rank, 4), "extra": EXTRA}
    # Rank 0's seconds per step decides; the others' differ on purpose.
    every_second = SnapshotSettings(directory, every=1.0, keep=10)
    writer = ShardedSnapshotWriter(every_second, rank, 4, snapshots.agree_plan(every_second, [1.0, 0.1, 3.0, 9.0][rank]),
                                   "job-1", clock=lambda: time.monotonic() + rank * 1e6)
    assert writer.offer(tree, info(2, 4))
    assert writer.wait(30) and not writer.writing
    dist.barrier()
    expected = gathered(state)
    dcp.save({**state, "extra": EXTRA}, checkpoint_id=os.path.join(directory, "dcp-save-reference"))

    # (f) Which commits are written: agreed every 3 steps (rank 0's 1 s per step), whatever
    # each rank measured, clocked or saw: rank 2 is replaced by a new writer at step 7.
    every_3s = SnapshotSettings(directory, every=3.0, keep=10)
    plan = snapshots.agree_plan(every_3s, [1.0, 0.5, 2.0, 7.0][rank])
    writer = ShardedSnapshotWriter(every_3s, rank, 4, plan, "job-1")
    decided = []
    for step in range(3, 11):
        if rank == 2 and step == 7:
            writer = ShardedSnapshotWriter(every_3s, rank, 4, plan, "job-1")
        if writer.offer(tree, info(step, 4)):
            decided.append(step)
        assert writer.wait(30)
    dist.barrier()

    # (e) Rank 3 never writes the commit of step 12: rank 0 gives up after 1 s.
    if rank in (1, 2):
        assert writer.offer(tree, info(12, 4)) and writer.wait(30)
    dist.barrier()
    if rank == 0:
        writer = ShardedSnapshotWriter(every_3s, 0, 4, plan, "job-1", publish_wait=1.0)
        assert writer.offer(tree, info(12, 4)) and writer.wait(30)
    dist.barrier()
    return {"expected": expected, "decided": decided, "every_steps": plan.every_steps, "warnings": lines,
            "stats": writer.stats}


@pytest.fixture(scope="module")
def world_4(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("sharded")
    return directory, run_ranks(4, functools.partial(write_at_world_4, str(directory)), timeout=90)


def load_at(world_size: int, directory: str, use_read_sharded: bool, rank: int, worker: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    warnings.filterwarnings("ignore")
    model, optimizer = fsdp_model(seed=world_size)  # other weights than the snapshot's
    target = state_of(model, optimizer)
    if use_read_sharded:
        found = ResumePlan(None, Path(directory)).locate()
        assert found is not None and found.manifest.world_size == 4
        read_sharded(found.path, target)
    else:
        dcp.load(target, checkpoint_id=os.path.join(directory, "snapshot-step-2-" + step_2_token(directory)))
    set_model_state_dict(model, target["model"])
    set_optimizer_state_dict(model, optimizer, target["optimizer"])
    return gathered(state_of(model, optimizer))


def step_2_token(directory: str) -> str:
    return next(n for n in os.listdir(directory) if n.startswith("snapshot-step-2-")).split("-")[-1]


@pytest.mark.timeout(180)
def test_an_fsdp2_state_written_at_world_4_is_what_dcp_saves_at_world_4(world_4):
    directory, results = world_4
    data = directory / ("snapshot-step-2-" + step_2_token(str(directory)))
    ours = pickle.loads((data / ".metadata").read_bytes())
    reference = pickle.loads((directory / "dcp-save-reference" / ".metadata").read_bytes())
    assert set(ours.state_dict_metadata) == set(reference.state_dict_metadata)
    assert ours.planner_data == reference.planner_data
    for key, md in reference.state_dict_metadata.items():
        assert type(ours.state_dict_metadata[key]) is type(md), key
        if hasattr(md, "chunks"):  # the same global size, dtype and chunks, empty ones included
            mine = ours.state_dict_metadata[key]
            assert (mine.size, mine.properties.dtype) == (md.size, md.properties.dtype), key
            assert [(c.offsets, c.sizes) for c in mine.chunks] == [(c.offsets, c.sizes) for c in md.chunks], key
    assert sorted(os.listdir(data)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    assert [r["stats"] for r in results][1:] == [WriterStats()] * 3  # only rank 0 counts a publication


@pytest.mark.timeout(180)
def test_dcp_load_at_world_2_into_a_fresh_fsdp2_model_gives_the_world_4_state_bitwise(world_4):
    directory, results = world_4
    loaded = run_ranks(2, functools.partial(load_at, 2, str(directory), False), timeout=90)
    for state in loaded:
        assert_same(state, results[0]["expected"])


@pytest.mark.timeout(180)
def test_dcp_load_at_world_1_into_plain_full_tensors_gives_the_world_4_state_bitwise(world_4):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # noqa: PLC0415

    directory, results = world_4
    torch.manual_seed(1)
    model = make_model()  # not sharded: plain full tensors
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    target = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer), "extra": {}}
    target["extra"] = {"sampler": {"epoch": 0, "consumed": 0}, "note": ""}
    dcp.load(target, checkpoint_id=directory / ("snapshot-step-2-" + step_2_token(str(directory))))
    assert_same({"model": target["model"], "optimizer": target["optimizer"]}, results[0]["expected"])
    assert target["extra"] == EXTRA


@pytest.mark.timeout(180)
def test_read_sharded_at_world_3_of_the_newest_snapshot_gives_the_world_4_state_bitwise(world_4):
    directory, results = world_4
    loaded = run_ranks(3, functools.partial(load_at, 3, str(directory), True), timeout=90)
    for state in loaded:
        assert_same(state, results[0]["expected"])


@pytest.mark.timeout(180)
def test_every_rank_decides_alike_which_commits_are_written_and_those_alone_are_published(world_4):
    directory, results = world_4
    assert [r["every_steps"] for r in results] == [3] * 4  # rank 0's choice, whatever each rank measured
    assert [r["decided"] for r in results] == [[3, 6, 9]] * 4
    published = sorted(m.step for m in (files.check(p, verify=True).manifest
                                        for _n, p in files.snapshots(directory)))
    assert published == [2, 3, 6, 9]


@pytest.mark.timeout(180)
def test_a_rank_that_never_writes_leaves_no_complete_snapshot_and_rank_0_says_so_once(world_4):
    directory, results = world_4
    rank_0 = results[0]
    assert len(rank_0["warnings"]) == 1, rank_0["warnings"]
    assert "The sharded snapshot of step 12 in" in rank_0["warnings"][0]
    assert "no part from rank(s) 3 within 1.0 s" in rank_0["warnings"][0]
    assert_documented(rank_0["warnings"][0])
    assert rank_0["stats"] == WriterStats(written=0, failed=1, last_error="step 12: no part from rank(s) 3 within 1.0 s")
    assert files.newest_valid(directory, pytest.fail).manifest.step == 9
    assert not any(n.startswith("snapshot-step-12-") for n in os.listdir(directory))
    assert [r["warnings"] for r in results[1:]] == [[]] * 3
