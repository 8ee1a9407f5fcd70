"""Training state that survives resets: committed in host memory, synced from rank 0.

``commit()`` copies the state into host memory (``lightning_elastic.commit.buffers``: buffers
allocated once, never a torn commit) and checks for host changes. After a failure ``@run``
restores the last commit; after an announced host change it keeps the live state. Either
way, after the new round is formed every rank takes rank 0's state
(``lightning_elastic.commit.transfer``: tensors sent in place, in chunks, never pickled).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_elastic.commit import collectives, transfer
from lightning_elastic.commit.buffers import Committed, HostSnapshot, join
from lightning_elastic.durable import store as snapshot_store
from lightning_elastic.durable.store import SnapshotInfo
from lightning_elastic.membership.worker import ElasticWorker
from lightning_elastic.training.sampler import ElasticSampler


log = logging.getLogger(__name__)


def _current_worker() -> ElasticWorker:
    from lightning_elastic.api import current_worker

    return current_worker()


def to_host(value: Any) -> Any:
    """A deep copy with every tensor copied to CPU memory (a commit must not cost GPU memory)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        # A shallow copy keeps what the constructor would need (a defaultdict's factory).
        result = copy.copy(value)
        result.clear()
        result.update((k, to_host(v)) for k, v in value.items())
        return result
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_host(v) for v in value)
    return copy.deepcopy(value)


def broadcast_object(value: Any, worker: ElasticWorker, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` on every rank (tensors travel on CPU, pickled)."""
    if worker.assignment.size == 1:
        return value
    rank = worker.assignment.rank
    device = worker.device if worker.backend == "nccl" else torch.device("cpu")
    return collectives.broadcast_object(to_host(value) if rank == src else None, rank, src, device,
                                        worker.wait_collective)


def info_of_state(values: dict[str, Any], stateful: dict[str, Any], commits: int, round_: int,
                  world_size: int, kind: str = "state") -> SnapshotInfo:
    """The manifest's numbers for a ``TorchState``/``ObjectState`` tree: its ``step`` and
    ``epoch`` values when it has them (else the commits in the state's history, a resumed
    job's counted from its snapshot's step, and 0), and the position of an
    ``ElasticSampler`` among its objects."""
    step = values.get("step")
    epoch = values.get("epoch")
    sampler = next((obj.state_dict() for obj in stateful.values() if isinstance(obj, ElasticSampler)), None)
    return SnapshotInfo(
        round=round_,
        step=step if isinstance(step, int) and not isinstance(step, bool) else commits,
        epoch=epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else 0,
        world_size=world_size,
        sampler=sampler,
        kind=kind,
    )


class State:
    """Base of every elastic state: subclasses define save, restore and sync."""

    def __init__(self, worker: ElasticWorker | None = None) -> None:
        object.__setattr__(self, "_worker", worker)
        object.__setattr__(self, "_reset_callbacks", [])

    @property
    def worker(self) -> ElasticWorker:
        return self._worker if self._worker is not None else _current_worker()

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Callbacks run after every re-rendezvous, before the state is synced."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save a copy in host memory, then check for host changes (may raise the interrupt)."""
        self.save()
        self.worker.note_commit()
        self.offer_snapshot()
        self.check_host_updates()

    def offer_snapshot(self) -> None:
        """Rank 0 hands its newest commit to the background snapshot writer, when one is
        due (``--snapshot-dir``); never waits for the disk."""

    def resume_from_snapshot(self) -> str | None:
        """Until a round has synced: rank 0 loads the snapshot the job resumes from into
        its live state (and commit). Returns its name on every rank when the job resumes
        (every rank then runs the reset callbacks), else None."""
        return None

    def check_host_updates(self) -> None:
        """Raises ``HostsUpdatedInterrupt`` on every rank at the same step if hosts changed."""
        self.worker.check_host_updates()

    def save(self) -> None:
        raise NotImplementedError

    def keep_live(self) -> None:
        """Hosts changed (every rank stopped at the same step): the live state becomes the
        rollback point."""
        self.save()

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        """Make rank 0's live state every rank's live state and commit."""
        raise NotImplementedError


class ObjectState(State):
    """Plain Python values, kept as attributes: ``state.epoch += 1``."""

    # How a durable snapshot lays the tree out (durable.store): "state" keeps
    # {"values", "stateful"}; "fabric" writes one flat dict, as fabric.save does.
    _snapshot_kind = "state"

    def __init__(self, worker: ElasticWorker | None = None, **values: Any) -> None:
        super().__init__(worker)
        object.__setattr__(self, "_names", list(values))
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_snapshot", HostSnapshot())
        # Commits in the state's history, the job's whole (kept with each commit, so a rank
        # restored or synced takes it too, and a resumed job goes on from its snapshot's):
        # the step of a durable snapshot of a state without a ``step`` value of its own.
        object.__setattr__(self, "_commits", 0)
        # The constructor's plain values are the first commit; objects with a state_dict are
        # committed from the first save on (a joiner's fresh model would only cost memory).
        self._snapshot.capture(self._tree(with_stateful=False))

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and name not in self._names:
            self._names.append(name)
        object.__setattr__(self, name, value)

    def _plain_values(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in self._names if not _is_stateful(getattr(self, n))}

    def _tree(self, with_stateful: bool = True) -> dict[str, Any]:
        return {"values": self._plain_values()}

    def _load(self, committed: Committed) -> None:
        for name, value in join(committed.skeleton["values"], committed.tensors, clone=True).items():
            object.__setattr__(self, name, value)
        if isinstance(committed.meta, int):
            object.__setattr__(self, "_commits", committed.meta)

    def commit(self) -> None:
        object.__setattr__(self, "_commits", self._commits + 1)
        super().commit()

    def save(self) -> None:
        self._snapshot.capture(self._tree(), self._commits)

    def offer_snapshot(self) -> None:
        worker = self.worker
        writer = worker.snapshot_writer
        if writer is None:
            return
        a = worker.assignment
        info = info_of_state(self._plain_values(), self._stateful_objects(), self._commits, a.round, a.size,
                             self._snapshot_kind)
        writer.offer(self._snapshot, info, may_start=a.rank == 0)

    def _stateful_objects(self) -> dict[str, Any]:
        return {}

    def resume_from_snapshot(self) -> str | None:
        worker = self.worker
        plan = worker.resume_from  # cleared by @run once a round has synced
        if plan is None:
            return None
        if worker.assignment.rank != 0:
            # Rank 0 decides; its state reaches this rank in the sync that follows.
            return snapshot_store.files.base_name(plan.path) if plan.path is not None else "a snapshot"
        found = plan.locate()
        if found is None:
            return None
        tree = snapshot_store.read_tree(found.path)
        # The job cannot go on from a snapshot that does not fit: say how to start over
        # (before the details, which the driver's one line may cut short).
        self.load_tree(tree, str(found.path),
                       hint="to start over instead: --no-resume (or resume=False), or another --snapshot-dir")
        m = found.manifest
        # The commits go on from the snapshot's step (its commit count, when the state has no
        # step of its own): the next snapshot is not numbered from 1 again. The sync that
        # follows gives every rank this count with the state.
        object.__setattr__(self, "_commits", m.step)
        log.info("Resuming from snapshot %s: step %d, epoch %d, written at world size %d (now %d).",
                 found.path, m.step, m.epoch, m.world_size, worker.assignment.size)
        return found.name

    def load_tree(self, tree: Any, where: str = "the snapshot", hint: str = "") -> None:
        """Make ``tree`` (what ``le.load_snapshot`` returns) the live state and the commit;
        ``hint``: what to do instead, said in the error if it does not fit."""
        if self._snapshot_kind == "fabric" and isinstance(tree, dict) and "values" not in tree:
            tree = snapshot_store.unflatten(tree, set(self._stateful_objects()))
        if not isinstance(tree, dict) or not isinstance(tree.get("values"), dict):
            kind = "a Lightning checkpoint" if isinstance(tree, dict) and "state_dict" in tree else type(tree).__name__
            raise snapshot_store.SnapshotError(
                f"{where}: holds {kind}, not the state of a {type(self).__name__} (snapshots of an elastic_hvd "
                "Trainer resume through the Trainer)")
        previous = self._snapshot.committed()
        self._snapshot.capture(tree)
        try:
            self.restore()
        except (RuntimeError, ValueError, KeyError) as err:
            # load_state_dict's size mismatch is many lines: the first names the module.
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            detail = " ".join(line.strip() for line in str(err).splitlines()[1:3])
            if previous is not None:  # load_state_dict copies what fits before it raises
                self._snapshot.capture(previous.tree())
                self.restore()
            said = f"{where}: does not fit this state (another model?{'; ' + hint if hint else ''})"
            raise snapshot_store.SnapshotError(f"{said}: {first} {detail}".strip()) from None

    def restore(self) -> None:
        committed = self._snapshot.committed()
        if committed is not None:
            self._load(committed)

    def sync(self) -> None:
        worker = self.worker
        a = worker.assignment
        if a.rank == 0:
            self.save()
        if a.size == 1:
            return
        committed = transfer.broadcast_commit(self._snapshot, a.rank, a.size, 0, worker.device,
                                               wait=worker.wait_collective)
        if a.rank != 0:
            self._load(committed)

    @property
    def committed_bytes(self) -> int:
        """Bytes of tensors in the last commit (host memory holds up to twice that)."""
        committed = self._snapshot.committed()
        return committed.nbytes if committed is not None else 0


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


class TorchState(ObjectState):
    """Modules, optimizers, LR schedulers (anything with ``state_dict``) plus plain values.

    ``le.TorchState(model, optimizer, epoch=0, batch=0)``: objects with ``state_dict()`` are
    saved and restored through it; other values as objects.
    """

    def __init__(
        self, model: Any = None, optimizer: Any = None, worker: ElasticWorker | None = None, **values: Any
    ) -> None:
        named = {k: v for k, v in (("model", model), ("optimizer", optimizer)) if v is not None}
        super().__init__(worker, **named, **values)

    def _stateful(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in self._names if _is_stateful(getattr(self, n))}

    def _stateful_objects(self) -> dict[str, Any]:
        return self._stateful()

    def _tree(self, with_stateful: bool = True) -> dict[str, Any]:
        stateful = {n: v.state_dict() for n, v in self._stateful().items()} if with_stateful else {}
        return {"values": self._plain_values(), "stateful": stateful}

    def sync(self) -> None:
        super().sync()
        # Every rank's modules now hold rank 0's weights: the torch DDP built next on this
        # round's group need not broadcast them again (lightning_elastic.commit.init_sync).
        modules = [obj for obj in self._stateful().values() if isinstance(obj, torch.nn.Module)]
        self.worker.synced_modules.note(self.worker.assignment.round, modules)

    def _load(self, committed: Committed) -> None:
        super()._load(committed)
        saved = committed.skeleton.get("stateful", {})
        for name, obj in self._stateful().items():
            if name in saved:
                # A module copies into its own parameters; an optimizer adopts the tensors it
                # is given (its next step would overwrite the commit in place): it gets copies.
                clone = not isinstance(obj, torch.nn.Module)
                obj.load_state_dict(join(saved[name], committed.tensors, clone=clone))
