"""The in-memory commit and the sync after a reset: host buffers, rank 0's state to every rank.

``buffers`` keeps a state tree's copy in host memory (allocated once, never torn);
``transfer`` sends rank 0's committed tensors to every rank in place; ``prefault``
touches new buffers' pages ahead of time; ``collectives`` holds the small object
broadcasts; ``init_sync`` remembers which modules a round's sync already made equal.

Nothing here reaches the driver or the disk: durable snapshots are ``lightning_elastic.durable``.
"""
