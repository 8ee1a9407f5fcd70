"""Other fault-tolerant training tools, measured the same way as lightning-elastic.

Each peer runs the suite's plain training loop (workloads/loop.py: same model, data, batch size, gradient
sync) written the way that tool's own docs do it, and exposes ``measure(repeats, workdir)``.
A peer whose package is missing raises ``PeerUnavailable`` from ``measure``; the suite
prints ``<tool>: skipped (<message>)`` and goes on.
"""


class PeerUnavailable(RuntimeError):
    """The peer tool cannot run in this interpreter (not installed, not importable)."""
