"""A worker's start-up at low CPU priority: standing in for another machine's cores.

On this 2-core box every "host" shares the survivors' cores, so a replacement worker's
start-up (interpreter, torch and Lightning imports: seconds of a core) slows the survivors
it is about to join, which on separate machines it would not. With
``BENCH_STARTUP_NICE=N`` in the environment, a workload lowers its priority to nice ``N``
before its heavy imports (``lower()``, called first thing) and takes normal priority back
once it has joined the job (``restore()``): every thread of the process, since Linux keeps
a nice value per thread and the threads started meanwhile inherited the low one. Raising
the priority again needs root (as on this benchmark machine); elsewhere it stays low.
Standard library only: it runs before anything else is imported.
"""

from __future__ import annotations

import os

VARIABLE = "BENCH_STARTUP_NICE"


def lower() -> None:
    value = os.environ.get(VARIABLE)
    if value:
        os.nice(int(value))


def restore() -> None:
    if not os.environ.get(VARIABLE):
        return
    for task in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(task), 0)
        except OSError:
            pass  # a thread that ended, or no right to raise a priority: stays low
