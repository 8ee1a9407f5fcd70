"""``le.ShardedState``: an FSDP2 model, its optimizer and plain values, elastic at rank granularity.

A sharded model exists only as its ranks' rows: no rank can hand the whole state to the
others, as rank 0 does for a ``TorchState``. So a commit keeps, on every rank, its own rows
(``rows.RankRows``, one host buffer) plus a copy of one other rank's rows, sent point to
point as part of the commit (``layout``: the copy lives on another host when there is
one), in two phases so that a rank lost inside a commit leaves the one before whole
(``commit``: three host buffers per rank). The rest of the state (plain values, buffers, the optimizer's step counts and
hyperparameters, schedulers, samplers) is the same on every rank and committed by each.

The model is built by the runtime, on every new process group, from the user's own FSDP2
code: ``model()`` builds the module (under ``torch.device("meta")`` when its weights come from
a commit), ``shard(model, mesh)`` applies ``fully_shard`` on this round's 1-D mesh, and
``optimizer(params)`` makes the optimizer. At a reset the members gather what they hold,
choose the newest commit still whole among them (``layout.choose_commit``) and move its rows
straight into the new model's and optimizer's local tensors (``exchange.run_transfers``):
the whole model is never materialised on any rank. Training then resumes from that commit
(a lost peer) or from the live state committed when the hosts changed.

When a rank and the holder of its copy are lost together, the rows are gone from memory:
the state resumes from the newest durable snapshot (``--snapshot-dir``), or the job stops
with one line saying so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_elastic.commit import collectives
from lightning_elastic.durable import files
from lightning_elastic.durable.files import Found
from lightning_elastic.errors import ElasticError
from lightning_elastic.membership.worker import ElasticWorker
from lightning_elastic.sharded import parts, snapshot_tree
from lightning_elastic.sharded.commit import ShardedCommit
from lightning_elastic.sharded.agreement import agree
from lightning_elastic.sharded.layout import Fresh, Layout, Lost, Restore, describe_coverage
from lightning_elastic.sharded.round_writers import RoundWriters
from lightning_elastic.sharded.rows import Entry
from lightning_elastic.training.state import State, _is_stateful, info_of_state

log = logging.getLogger(__name__)

ModelFactory = Callable[[], torch.nn.Module]
ShardFunction = Callable[[torch.nn.Module, Any], Any]
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


class ShardedState(State):
    """``le.ShardedState(model, shard, optimizer, epoch=0, batch=0)``.

    * ``model()``: builds the module (your model's constructor);
    * ``shard(model, mesh)``: your FSDP2 code, e.g. ``fully_shard`` on each block, then on the
      model, with ``mesh=mesh`` (a 1-D ``DeviceMesh`` over this round's ranks);
    * ``optimizer(params)``: builds the optimizer, e.g. ``lambda p: torch.optim.AdamW(p, lr=3e-4)``;
    * ``init_weights(model)`` (optional): for a model too large to build whole on one device:
      the model is then built on the meta device, sharded, and ``init_weights`` fills the
      local shards at the first start. Without it the first start builds ``model()`` for
      real on every rank and shards it, as FSDP2 does (seed the same on every rank);
    * ``scheduler(optimizer)`` (optional): builds an LR scheduler;
    * other keyword arguments: plain values (``state.epoch += 1``) and objects with a
      ``state_dict`` (an ``le.ElasticSampler``), the same on every rank.

    ``state.model``, ``state.optimizer``, ``state.scheduler`` and ``state.mesh`` are rebuilt at
    every reset: read them at the top of the training function, not before ``@le.run``.
    Reset callbacks run after the state is restored (they see the new optimizer).
    """

    def __init__(self, model: ModelFactory, shard: ShardFunction, optimizer: OptimizerFactory, *,
                 init_weights: Callable[[torch.nn.Module], None] | None = None,
                 scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                 worker: ElasticWorker | None = None, **values: Any) -> None:
        super().__init__(worker)
        for name, fn in (("model", model), ("shard", shard), ("optimizer", optimizer)):
            if not callable(fn):
                raise TypeError(f"ShardedState: {name} must be a function (see help(le.ShardedState)), "
                                f"got {type(fn).__name__}")
        put = object.__setattr__
        put(self, "_factories", (model, shard, optimizer, init_weights, scheduler))
        put(self, "_names", list(values))
        for name, value in values.items():
            put(self, name, value)
        put(self, "_live", None)  # (model, optimizer, scheduler, mesh) of this round
        put(self, "_layout", None)  # this round's Layout
        put(self, "_committed_live", False)  # the live state is the newest commit
        put(self, "_callbacks_due", False)
        put(self, "_commit", ShardedCommit())  # own rows, the rest, the copy held for a peer
        put(self, "_said_coverage", None)
        put(self, "_snapshots", RoundWriters())  # durable snapshots of the commits (--snapshot-dir)

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and name not in self._names:
            self._names.append(name)
        object.__setattr__(self, name, value)

    # ----- what the training function uses ------------------------------------------------

    def _built(self) -> tuple[Any, ...]:
        if self._live is None:
            raise RuntimeError("ShardedState: the model is built when the training function starts (@le.run) and "
                               "rebuilt at every reset: read state.model inside the function")
        return self._live

    @property
    def model(self) -> torch.nn.Module:
        return self._built()[0]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._built()[1]

    @property
    def scheduler(self) -> Any:
        return self._built()[2]

    @property
    def mesh(self) -> Any:
        return self._built()[3]

    @property
    def committed_bytes(self) -> int:
        """Host bytes of this rank's commits: its own rows, the copy it holds for a peer and the
        buffer the next copy arrives in (plus, until the first commit after a reset settles,
        the restored commit's)."""
        return self._commit.nbytes

    # ----- commit --------------------------------------------------------------------------

    def commit(self) -> None:
        self.save()
        self.worker.note_commit()
        self.offer_snapshot()
        self.worker.check_host_updates()  # if it raises, the live state is this commit

    def check_host_updates(self) -> None:
        object.__setattr__(self, "_committed_live", False)  # the live state may be past the commit
        super().check_host_updates()

    def save(self) -> None:
        """Commit: this rank's rows into its host buffer, then the copy for its holder."""
        worker = self.worker
        entries, tensors, rest = self._split_live()
        self._commit.save(entries, tensors, rest, self._layout, worker.assignment.rank, worker.device,
                          worker.wait_collective, keep_own=not self._snapshots.writing)
        object.__setattr__(self, "_committed_live", True)

    def offer_snapshot(self) -> None:
        """Every rank: its rows of this commit to the round's sharded snapshot writer
        (``--snapshot-dir``), which writes them in the background when the commit is due."""
        worker = self.worker
        settings = getattr(worker.snapshot_writer, "settings", None)
        own = self._commit.own
        if settings is None or own is None:
            return
        a = worker.assignment
        values = {n: getattr(self, n) for n in self._names if not _is_stateful(getattr(self, n))}
        stateful = {n: getattr(self, n) for n in self._names if _is_stateful(getattr(self, n))}
        info = info_of_state(values, stateful, worker.commits_total, a.round, a.size, "sharded")
        self._snapshots.offer(worker, lambda: snapshot_tree.written(own.rows, own.rest), info)

    def keep_live(self) -> None:
        """Hosts changed: every rank stopped at the same step, so the live state is committed
        (if it is newer than the commit) on the old group, then rebuilt on the new one."""
        if not self._committed_live:
            try:
                self.save()
            except Exception as err:  # a peer lost now: the newest whole commit is used instead
                log.warning("Rank %d: committing the live state at the host change failed (%s); the newest "
                            "whole commit is restored instead.", self.worker.assignment.rank, err)
        self._drop_live()

    def restore(self) -> None:
        """A peer was lost: the live state goes; the commit is restored when the new round forms."""
        self._drop_live()

    def _drop_live(self) -> None:
        if self._live is not None:
            _release(self._live[0], self._live[1], self.worker.assignment.rank)
        object.__setattr__(self, "_live", None)
        object.__setattr__(self, "_committed_live", False)

    def _split_live(self) -> tuple[list[Entry], list[torch.Tensor], dict[str, Any]]:
        """The sharded tensors (entries and local rows) and the rest of the state."""
        model, optimizer, scheduler, _ = self._built()
        entries, tensors, rest = parts.split(model, optimizer)
        rest["scheduler"] = scheduler.state_dict() if scheduler is not None else None
        rest["values"] = {n: getattr(self, n) for n in self._names if not _is_stateful(getattr(self, n))}
        rest["stateful"] = {n: getattr(self, n).state_dict() for n in self._names if _is_stateful(getattr(self, n))}
        return entries, tensors, rest

    # ----- a new round ----------------------------------------------------------------------

    def on_reset(self) -> None:
        # Called before sync; the callbacks need the rebuilt optimizer: run at sync's end.
        object.__setattr__(self, "_callbacks_due", True)

    def sync(self) -> None:
        """Every member: say what it holds, agree on a commit, build the model on this round's
        mesh and move that commit's rows into it (or start fresh, or fall back to a snapshot)."""
        worker = self.worker
        agreed = agree(self._commit, worker.assignment, worker.device, worker.wait_collective)
        object.__setattr__(self, "_layout", agreed.layout)
        choice = agreed.choice
        if isinstance(choice, Restore):
            self._restore(choice)
            # The restored commit's rows were spread over the old world's buffers; until a
            # commit in this world settles, some exist once, so commit now (as a resume
            # from a snapshot does) and a loss right after the restore does not start over.
            self.save()
        elif isinstance(choice, Lost):
            self._restore_lost(choice)
        else:
            assert isinstance(choice, Fresh)
            self._commit.clear()  # nothing whole anywhere: what this rank holds is torn
            plan = worker.resume_from  # the job's first round only: cleared once a round synced
            found = self._agree_on_snapshot(plan.locate if plan is not None else None)
            if found is None:
                self._build(fresh=True)
            else:
                self._resume_from(found)
        self._say_coverage(agreed.hosts, agreed.layout)
        step = self._values().get("step")
        a = worker.assignment
        self._snapshots.round_started(a.round, step if isinstance(step, int) else 0)
        if self._callbacks_due:
            object.__setattr__(self, "_callbacks_due", False)
            super().on_reset()

    def _build(self, fresh: bool) -> None:
        """This round's model, optimizer and scheduler: real weights only when ``fresh`` and no
        ``init_weights`` was given; else on the meta device, then allocated shard by shard."""
        from torch.distributed.device_mesh import init_device_mesh

        make_model, shard, make_optimizer, init_weights, make_scheduler = self._factories
        worker = self.worker
        self._drop_live()
        mesh = init_device_mesh(worker.device.type, (worker.assignment.size,), mesh_dim_names=("dp",))
        if fresh and init_weights is None:
            # Every rank keeps its own rows of the model it builds: they must all build the
            # same one. A joiner's generator is not where the others' are (they trained
            # since le.init), so all build from rank 0's, without moving anyone's own.
            a = worker.assignment
            rng = torch.get_rng_state()
            if a.size > 1:
                rng = collectives.broadcast_object(rng, a.rank, 0, worker.device, worker.wait_collective)
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(rng)
                model = make_model()
        else:
            with torch.device("meta"):
                model = make_model()
        shard(model, mesh)
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            model.to_empty(device=worker.device)
            if fresh and init_weights is not None:
                with torch.no_grad():
                    init_weights(model)
        optimizer = make_optimizer(model.parameters())
        scheduler = make_scheduler(optimizer) if make_scheduler is not None else None
        object.__setattr__(self, "_live", (model, optimizer, scheduler, mesh))
        if fresh:
            self._commit.version = 0

    def _restore(self, choice: Restore) -> None:
        worker = self.worker
        a = worker.assignment
        started = time.monotonic()
        rebuilt: list[float] = []  # when the rebuild began and ended

        def rebuild(entries: tuple[Entry, ...], rest: Any) -> dict[int, torch.Tensor]:
            rebuilt.append(time.monotonic())
            self._build(fresh=False)
            model, optimizer, _, _ = self._built()
            local = parts.allocate(model, optimizer, entries)
            rebuilt.append(time.monotonic())
            return local

        rest, received = self._commit.restore(choice, a.rank, a.size, worker.device, worker.wait_collective, rebuild)
        moved = time.monotonic()  # the rest came first (a broadcast), then the rebuild, then the rows
        self._load_rest(rest)
        log.info("Rank %d: restored commit %d (world size %d -> %d); %.1f MB received from peers in %.2f s "
                 "(whole restore %.2f s, of which model and optimizer rebuilt in %.2f s).",
                 a.rank, choice.version, choice.layout.world, a.size, received / 1e6, moved - rebuilt[1],
                 time.monotonic() - started, rebuilt[1] - rebuilt[0])

    def _restore_lost(self, lost: Lost) -> None:
        """No whole commit among the members: the newest durable snapshot, or the end."""
        worker = self.worker
        settings = getattr(worker.snapshot_writer, "settings", None)

        def newest() -> Found | None:
            return files.newest_valid(settings.directory, log.warning) if settings is not None else None

        self._commit.clear()  # its pieces are no use without the rows lost with them
        found = self._agree_on_snapshot(newest)
        if found is None:
            where = "no valid snapshot in --snapshot-dir" if settings is not None else "no --snapshot-dir"
            raise ElasticError(f"sharded state lost from memory: {lost.reason}; {where} to resume from")
        if worker.assignment.rank == 0:
            log.warning("Sharded state lost from memory: %s; resuming from snapshot %s (step %d).", lost.reason,
                        files.base_name(found.path), found.manifest.step)
        self._resume_from(found)

    def _agree_on_snapshot(self, locate: Any) -> Found | None:
        """Rank 0 looks (``locate()``, or nothing when None); every rank gets what it found."""
        worker = self.worker
        a = worker.assignment
        found = locate() if a.rank == 0 and locate is not None else None
        if a.size > 1:
            found = collectives.broadcast_object(found, a.rank, 0, worker.device, worker.wait_collective)
        return found

    def _resume_from(self, found: Found) -> None:
        """Every rank reads its rows of ``found`` (any world size) into the rebuilt model,
        then commits, so that a loss before the next commit does not start over."""
        from lightning_elastic.sharded.snapshots import read_sharded, saved_tensors

        if found.manifest.kind != "sharded":
            raise ElasticError(f"{files.base_name(found.path)}: a {found.manifest.kind!r} snapshot, not the "
                               "state of a ShardedState (to start over: --no-resume, or another --snapshot-dir)")
        shapes = saved_tensors(found.path)
        if snapshot_tree.written_by_a_fit(list(shapes)):
            raise ElasticError(f'{files.base_name(found.path)}: a sharded snapshot of a strategy="elastic_fsdp" fit, '
                               "not of a le.ShardedState (to start over: --no-resume, or another --snapshot-dir)")
        self._build(fresh=False)
        model, optimizer, scheduler, _ = self._built()
        extra = {"values": self._values(), "stateful": {n: o.state_dict() for n, o in self._stateful().items()},
                 "scheduler": scheduler.state_dict() if scheduler is not None else None}
        target = snapshot_tree.read_target(model, optimizer, list(shapes),
                                           {k: v for k, v in shapes.items() if v is not None}, extra)
        read_sharded(found.path, target)
        for group, saved in zip(optimizer.param_groups, target["optimizer"]["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        saved_extra = target["extra"]
        for name, value in saved_extra["values"].items():
            object.__setattr__(self, name, value)
        for name, value in saved_extra["stateful"].items():
            getattr(self, name).load_state_dict(value)
        if scheduler is not None and saved_extra["scheduler"] is not None:
            scheduler.load_state_dict(saved_extra["scheduler"])
        a = self.worker.assignment
        if a.rank == 0:
            log.info("Resumed from snapshot %s: step %d, written at world size %d (now %d).",
                     files.base_name(found.path), found.manifest.step, found.manifest.world_size, a.size)
        object.__setattr__(self, "_callbacks_due", True)  # the world may differ from the one that wrote it
        self.save()

    def _values(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in self._names if not _is_stateful(getattr(self, n))}

    def _stateful(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in self._names if _is_stateful(getattr(self, n))}

    def _load_rest(self, rest: dict[str, Any]) -> None:
        model, optimizer, scheduler, _ = self._built()
        parts.load_rest(model, optimizer, rest)
        if scheduler is not None and rest["scheduler"] is not None:
            scheduler.load_state_dict(rest["scheduler"])
        for name, value in rest["values"].items():
            object.__setattr__(self, name, value)
            if name not in self._names:
                self._names.append(name)
        for name, saved in rest["stateful"].items():
            getattr(self, name).load_state_dict(saved)

    def _say_coverage(self, hosts: tuple[str, ...], layout: Layout) -> None:
        said = (len(hosts), len(set(hosts)), layout.shift)
        if self.worker.assignment.rank != 0 or self._said_coverage == said:
            return
        object.__setattr__(self, "_said_coverage", said)
        log.info("%s", describe_coverage(hosts, layout.shift))


def _release(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    """Free a dropped model's large tensors now, not when the cyclic garbage collector runs.

    FSDP2's modules reference themselves through their hooks, so a dropped model and its
    optimizer are freed only by a full collection, which Python starts by itself only once
    tens of thousands of new objects have outlived younger collections (many resets, each
    leaving a model behind), and which costs ~0.3 s with torch imported (~300k objects): too
    slow to run at every reset. The unsharded parameters (still gathered when a step was
    interrupted between forward and backward), the gradients and the optimizer's moments go
    at once here, so the next model reuses their memory; the sharded parameters and the
    small rest wait for the collector. Called only once the live state is committed or given up.
    """
    from torch.distributed.fsdp import FSDPModule

    try:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        model.zero_grad(set_to_none=True)
        optimizer.state.clear()
    except Exception as err:  # the next round must form regardless: the collector frees it later
        log.warning("Rank %d: freeing the previous round's model early failed (%s: %s); it is freed by the "
                    "garbage collector instead.", rank, type(err).__name__, err)
