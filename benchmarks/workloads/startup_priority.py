"""A worker's start-up at low CPU priority: standing in for another machine's cores.

On this 2-core box every "host" shares the survivors' cores, so a replacement worker's
start-up (interpreter, torch and Lightning imports: seconds of a core) slows the survivors
it is about to join, which on separate machines it would not. With
``BENCH_STARTUP_NICE=N`` in the environment, a workload lowers its priority to nice ``N``
before its heavy imports (``lower()``, called first thing) and takes normal priority back
once it has joined the job (``restore()``).

Two settings, because the launcher starts every worker in a session of its own: with the
kernel's autogroups on (``/proc/sys/kernel/sched_autogroup_enabled``, the default here), a
session is a scheduling group, the groups share the CPUs by their own nice value, and a
thread's nice only ranks it against the threads of its own group. So the process's nice
alone changes nothing against the survivors (each alone in its own session): the group's
nice (``/proc/self/autogroup``) is set too, when this process leads its session (never a
session it merely belongs to, such as a login shell's). The thread nice covers autogroups
off. Restoring sets both back: every thread, since Linux keeps a nice value per thread and
the threads started meanwhile inherited the low one. Raising a priority again needs root
(as on this benchmark machine); elsewhere it stays low. Standard library only: it runs
before anything else is imported.
"""

from __future__ import annotations

import os

VARIABLE = "BENCH_STARTUP_NICE"
AUTOGROUP = "/proc/self/autogroup"


def lower() -> None:
    value = os.environ.get(VARIABLE)
    if value:
        os.nice(int(value))
        _set_autogroup_nice(int(value))


def restore() -> None:
    if not os.environ.get(VARIABLE):
        return
    _set_autogroup_nice(0)
    for task in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(task), 0)
        except OSError:
            pass  # a thread that ended, or no right to raise a priority: stays low


def _set_autogroup_nice(nice: int) -> None:
    """This session's scheduling group at ``nice``, if this process leads the session."""
    if os.getsid(0) != os.getpid():
        return
    try:
        with open(AUTOGROUP, "w") as f:
            f.write(str(nice))
    except OSError:
        pass  # no autogroups (not Linux, or CONFIG_SCHED_AUTOGROUP off), or no right to raise it
