"""Faulting in new host buffers on a helper thread while the main thread fills them.

A joiner receives a commit into buffers it has just allocated: every 4 KiB page of them
faults on first touch, and the kernel's work there (finding and zeroing a page) roughly
doubled the time of receiving a large commit. ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14)
does that work ahead of the writes; run on a helper thread, it overlaps with the network
receive, which leaves the CPU mostly waiting. Nothing depends on it for correctness: a page
the receive reaches first simply faults as it would have, a populated page is written in
place. Where the call is missing (another OS, an older kernel) this does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # linux/mman.h; not exposed by the mmap module before Python 3.13
_SLICE_BYTES = 16 << 20  # one madvise call per slice: stopping early waits for one at most


def _madvise() -> Callable[[int, int, int], int] | None:
    if os.uname().sysname != "Linux":
        return None
    # The interpreter's own symbols include the C library's; a CDLL call releases the GIL.
    fn = getattr(ctypes.CDLL(None, use_errno=True), "madvise", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def page_ranges(start: int, nbytes: int, page: int, slice_bytes: int) -> list[tuple[int, int]]:
    """The whole pages inside ``[start, start + nbytes)``, as ``(address, length)`` slices.

    madvise takes page-aligned ranges; the partial pages at either end are left to fault.
    """
    first = -(-start // page) * page
    last = (start + nbytes) // page * page
    return [(a, min(slice_bytes, last - a)) for a in range(first, last, slice_bytes)]


class Prefaulter:
    """Populates the pages of host tensors on a daemon thread until done or stopped.

    Use as a context manager around the code that fills the tensors; leaving it stops the
    thread after the slice it is in.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = [t for t in tensors if t.device.type == "cpu" and not t.is_pinned() and t.numel()]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Prefaulter:
        madvise = _madvise() if self._tensors else None
        if madvise is not None:
            self._thread = threading.Thread(target=self._run, args=(madvise,), name="prefault", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self, madvise: Callable[[int, int, int], int]) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        for tensor in self._tensors:
            for address, length in page_ranges(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                                               page, _SLICE_BYTES):
                if self._stop.is_set():
                    return
                if madvise(address, length, _MADV_POPULATE_WRITE) != 0:
                    # EINVAL: a kernel older than 5.14; nothing to gain from retrying.
                    log.debug("madvise(MADV_POPULATE_WRITE) failed: %s", os.strerror(ctypes.get_errno()))
                    return
