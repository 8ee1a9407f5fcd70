"""A state tree's copy in host memory: buffers allocated once and reused, never torn.

A *tree* is what ``state_dict()`` returns, or a Lightning checkpoint: dicts, lists and
tuples whose leaves are tensors and small Python values. A commit splits it into a
*skeleton* (the tree with every tensor replaced by a ``TensorSlot``, its other leaves
copied) and the tensors, which are copied with ``copy_`` into host tensors allocated at
the first commit and reused by the next ones: fresh memory costs a page fault per 4 KiB
on every commit (what that cost: docs/performance.md).

Two sets of buffers alternate. A commit is written into the spare set and becomes the
committed one only when every byte is there, so a failure part-way (an exception, a CUDA
error, a source lost during a transfer) leaves the previous commit whole: a commit is
never torn. On CUDA the device-to-host copy runs on a side stream into pinned memory and
the commit is promoted when its event has completed; the training stream waits for that
event before it can change the tensors being copied, the host does not wait at all.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

# Leaves that need no copy: nobody can change them in place.
_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size, range)
# The same as a set of exact types, for the common case checked first (a commit visits
# every leaf of a state: Lightning's loop progress alone has over a hundred).
_SCALARS = frozenset({int, float, bool, str, type(None)})


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """Where tensor number ``index`` of a commit sits in its skeleton."""

    index: int


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype of a committed tensor: what a receiver allocates to hold it."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.dtype.itemsize


def split(tree: Any, tensors: list[torch.Tensor] | None = None) -> tuple[Any, list[torch.Tensor]]:
    """``(skeleton, tensors)``: the tree's tensors in order, the rest copied.

    Only dense tensors are taken out; a sparse or quantized tensor (rare in a state) stays
    in the skeleton as a fresh host copy. Given ``tensors``, the tree's are appended to it
    (their slots numbered after the ones already there): several parts, one commit.
    """
    if tensors is None:
        tensors = []

    def visit(value: Any) -> Any:
        if type(value) in _SCALARS:
            return value
        if isinstance(value, torch.Tensor):
            if _bufferable(value):
                tensors.append(value.detach())
                return TensorSlot(len(tensors) - 1)
            return value.detach().to("cpu", copy=True)
        return _rebuild(value, visit)

    return visit(tree), tensors


def join(skeleton: Any, tensors: Sequence[torch.Tensor], clone: bool) -> Any:
    """The tree again, with ``tensors`` in their slots (cloned if ``clone``), the rest copied."""

    def visit(value: Any) -> Any:
        if type(value) in _SCALARS:
            return value
        if isinstance(value, TensorSlot):
            tensor = tensors[value.index]
            return tensor.clone() if clone else tensor
        if isinstance(value, torch.Tensor):
            return value.clone()
        return _rebuild(value, visit)

    return visit(skeleton)


def _bufferable(tensor: torch.Tensor) -> bool:
    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided
            and not tensor.is_quantized and tensor.device.type != "meta")


def _rebuild(value: Any, visit: Any) -> Any:
    """A copy of one container level, ``visit`` applied to its items; other leaves copied."""
    kind = type(value)
    if kind is dict:
        return {k: visit(v) for k, v in value.items()}
    if kind is list:
        return [visit(v) for v in value]
    if kind is tuple:
        if all(type(v) in _SCALARS for v in value):
            return value  # immutable all the way down (an RNG state: 625 ints)
        return tuple(visit(v) for v in value)
    if isinstance(value, _IMMUTABLE):
        return value
    if isinstance(value, dict):
        # A shallow copy keeps what the constructor would need (an OrderedDict's metadata
        # attribute, a defaultdict's factory).
        result = copy.copy(value)
        result.clear()
        result.update((k, visit(v)) for k, v in value.items())
        return result
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return kind._make(visit(v) for v in value)
    if isinstance(value, (list, tuple)):
        return kind(visit(v) for v in value)
    return copy.deepcopy(value)


def specs_of(tensors: Sequence[torch.Tensor]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(tuple(t.shape), t.dtype) for t in tensors)


def allocate(specs: Sequence[TensorSpec], pinned: bool = False) -> list[torch.Tensor]:
    """Host tensors for ``specs``, contiguous (a transfer sends them as flat bytes)."""
    return [torch.empty(s.shape, dtype=s.dtype, device="cpu", pin_memory=pinned) for s in specs]


class PendingCopy(Protocol):
    """A copy still running (a CUDA event): ``done()`` polls, ``wait()`` blocks or raises."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class Copier(Protocol):
    """Copies live tensors into host buffers; returns None when the copy is already complete."""

    pinned: bool

    def copy(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> PendingCopy | None: ...


class HostCopier:
    """Synchronous ``copy_`` (CPU tensors, or any tensor when no side stream is wanted)."""

    pinned = False

    def copy(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> PendingCopy | None:
        with torch.no_grad():
            for destination, source in zip(destinations, sources):
                destination.copy_(source)
        return None


class _CudaEvent:
    def __init__(self, event: Any) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> None:
        self._event.synchronize()


class CudaCopier:
    """Device-to-host copies on a side stream into pinned memory.

    The side stream first waits for the training stream (the copy sees the values of this
    step); the training stream then waits for the copy's event, so a later kernel (a
    BatchNorm update in the next forward, the next optimizer step) cannot change a tensor
    before it is copied. The host thread never blocks.
    """

    pinned = True

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device=device)

    def copy(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> PendingCopy | None:
        current = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(current)
        with torch.no_grad(), torch.cuda.stream(self._stream):
            for destination, source in zip(destinations, sources):
                destination.copy_(source, non_blocking=True)
                # A source the state_dict made for the occasion may be freed before the copy
                # ran: the caching allocator must not hand its memory out until it has.
                source.record_stream(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        current.wait_event(event)
        return _CudaEvent(event)


def copier_for(device: torch.device) -> Copier:
    return CudaCopier(device) if device.type == "cuda" else HostCopier()


@dataclasses.dataclass
class _Commit:
    skeleton: Any
    meta: Any
    specs: tuple[TensorSpec, ...]
    tensors: list[torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Committed:
    """A complete commit, read-only by contract: its tensors are the snapshot's buffers."""

    skeleton: Any
    meta: Any
    specs: tuple[TensorSpec, ...]
    tensors: Sequence[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def tree(self, clone: bool = True) -> Any:
        """The committed tree; ``clone=False`` hands out the buffers themselves, for a
        consumer that only copies out of them."""
        return join(self.skeleton, self.tensors, clone)


class HostSnapshot:
    """The last complete commit of a tree, in host buffers that are reused (see the module doc).

    ``meta`` is small Python data kept with a commit (a step number, a world size), kept as
    given: it must not be changed afterwards (a frozen dataclass, fresh values).
    """

    def __init__(self, copier: Copier | None = None) -> None:
        # None: chosen by where the tensors are (a side stream for CUDA tensors).
        self._fixed_copier = copier
        self._copier: Copier = copier or HostCopier()
        self._copier_device = torch.device("cpu")
        self._committed: _Commit | None = None
        self._pending: tuple[_Commit, PendingCopy] | None = None
        self._spare: list[torch.Tensor] | None = None
        # A commit being written to disk (``lease``): its buffers are never reused while
        # leased. A commit made meanwhile then writes into a third set, allocated once and
        # kept as ``_reserve`` after the lease ends: with snapshots on, host memory holds at
        # most three copies of the state (committed, spare, being written), never more.
        self._leased: list[torch.Tensor] | None = None
        self._reserve: list[torch.Tensor] | None = None

    def _choose_copier(self, sources: Sequence[torch.Tensor]) -> None:
        if self._fixed_copier is not None:
            return
        device = next((t.device for t in sources if t.device.type == "cuda"), torch.device("cpu"))
        if device != self._copier_device:
            copier = copier_for(device)
            if copier.pinned != self._copier.pinned:
                self._spare = None  # buffers of the other kind of memory
            self._copier, self._copier_device = copier, device

    # ----- writing ----------------------------------------------------------------------

    def capture(self, tree: Any, meta: Any = None) -> None:
        """Commit ``tree``: its tensors copied into the spare buffers, then promoted."""
        skeleton, sources = split(tree)
        self.capture_split(skeleton, sources, meta)

    def capture_split(self, skeleton: Any, sources: Sequence[torch.Tensor], meta: Any = None) -> None:
        """Commit a tree already split: ``skeleton`` (kept as given: it must not change
        afterwards) with ``sources`` copied into its slots."""
        specs = specs_of(sources)
        self._settle()
        self._choose_copier(sources)
        buffers = self.buffers_for(specs)
        self._spare = None  # being written: until promoted it is neither spare nor committed
        try:
            pending = self._copier.copy(buffers, sources)
        except BaseException:
            self._spare = buffers  # half written, but still good for the next attempt
            raise
        commit = _Commit(skeleton, meta, specs, buffers)
        if pending is None:
            self._promote(commit)
        else:
            self._pending = (commit, pending)

    def has_spare_for(self, specs: tuple[TensorSpec, ...]) -> bool:
        """Whether ``buffers_for(specs)`` reuses buffers (else it allocates new memory)."""
        return self._spare is not None and specs_of(self._spare) == specs

    def buffers_for(self, specs: tuple[TensorSpec, ...]) -> list[torch.Tensor]:
        """Buffers to write a commit of ``specs`` into: the spare set when it fits, else new.

        A commit of another shape (an optimizer that gained state at its first step) gets
        new buffers once; the old ones are dropped.
        """
        if self.has_spare_for(specs):
            assert self._spare is not None
            return self._spare
        reserve, self._reserve = self._reserve, None
        if reserve is not None and specs_of(reserve) == specs and reserve is not self._leased:
            return reserve
        return allocate(specs, self._copier.pinned)

    def receive(self, skeleton: Any, meta: Any, specs: tuple[TensorSpec, ...], buffers: list[torch.Tensor]) -> None:
        """Promote buffers that were filled elsewhere (a transfer from another rank)."""
        self._settle()
        if buffers is self._spare:
            self._spare = None
        self._promote(_Commit(skeleton, meta, specs, buffers))

    def _promote(self, commit: _Commit) -> None:
        previous = self._committed
        self._committed = commit
        if previous is not None and previous.tensors is not commit.tensors:
            # Leased buffers are being written to disk: not spare until the lease ends.
            self._spare = None if previous.tensors is self._leased else previous.tensors

    # ----- leasing (the background snapshot writer) -------------------------------------

    def lease(self) -> Committed | None:
        """The newest commit, its buffers kept from reuse until ``release()``: a reader on
        another thread (the snapshot writer) may read them meanwhile. One lease at a time."""
        if self._leased is not None:
            raise RuntimeError("HostSnapshot.lease: the previous lease was not released")
        committed = self.committed()
        if committed is not None:
            self._leased = self._committed.tensors if self._committed is not None else None
        return committed

    def release(self) -> None:
        """End the lease: its buffers become the spare (or the reserve) set, or are dropped
        when neither is free (a fourth set would exceed the bound)."""
        leased, self._leased = self._leased, None
        if leased is None or (self._committed is not None and leased is self._committed.tensors):
            return
        if self._spare is None:
            self._spare = leased
        elif self._reserve is None:
            self._reserve = leased

    def _settle(self) -> None:
        """Wait for a copy still running, then promote it; a failed copy is dropped."""
        if self._pending is None:
            return
        commit, pending = self._pending
        self._pending = None
        try:
            pending.wait()
        except Exception as err:  # noqa: BLE001 - the previous commit stays the valid one
            log.warning("A commit's copy to host memory failed (%s); the previous commit stays.", err)
            return
        self._promote(commit)

    # ----- reading ----------------------------------------------------------------------

    def committed(self) -> Committed | None:
        """The newest complete commit (waits for a copy still running), or None."""
        self._settle()
        c = self._committed
        return None if c is None else Committed(c.skeleton, c.meta, c.specs, c.tensors)

    def clear(self) -> None:
        """Drop the commit and free the buffers."""
        self._settle()
        self._committed = None
        self._spare = None
        self._reserve = None
