"""``le.ShardedState``: an FSDP2 model, its optimizer and plain values, elastic at rank granularity.

A sharded model exists only as its ranks' rows: no rank can hand the whole state to the
others, as rank 0 does for a ``TorchState``. So a commit keeps, on every rank, its own rows
(``rows.RankRows``, one host buffer) plus a copy of one other rank's rows, sent point to
point as part of the commit (``layout``: the copy lives on another host when there is
one). The rest of the state (plain values, buffers, the optimizer's step counts and
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
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_elastic.commit import collectives
from lightning_elastic.membership.worker import ElasticWorker
from lightning_elastic.sharded import parts
from lightning_elastic.sharded.commit import ShardedCommit
from lightning_elastic.sharded.agreement import agree, lost_error
from lightning_elastic.sharded.layout import Fresh, Layout, Lost, Restore, describe_coverage
from lightning_elastic.sharded.rows import Entry
from lightning_elastic.training.state import State, _is_stateful

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
        """Host bytes of this rank's commit: its own rows plus the copy it holds."""
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
        self._commit.save(entries, tensors, rest, self._layout, worker.assignment.rank, worker.device)
        object.__setattr__(self, "_committed_live", True)

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
        elif isinstance(choice, Lost):
            self._restore_lost(choice)
        else:
            assert isinstance(choice, Fresh)
            self._build(fresh=True)
        self._say_coverage(agreed.hosts, agreed.layout)
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

        def rebuild(entries: tuple[Entry, ...], rest: Any) -> dict[int, torch.Tensor]:
            self._build(fresh=False)
            model, optimizer, _, _ = self._built()
            return parts.allocate(model, optimizer, entries)

        rest, received = self._commit.restore(choice, a.rank, a.size, worker.device, worker.wait_collective, rebuild)
        self._load_rest(rest)
        log.info("Rank %d: restored commit %d (world size %d -> %d); %.1f MB received from peers.",
                 a.rank, choice.version, choice.layout.world, a.size, received / 1e6)

    def _restore_lost(self, lost: Lost) -> None:
        raise lost_error(lost)

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
