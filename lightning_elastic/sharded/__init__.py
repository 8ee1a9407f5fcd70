"""Elastic FSDP2 training: sharded state, its commits, and its durable snapshots.

``snapshots`` writes every rank's shards to ``--snapshot-dir`` in the background as a
torch.distributed.checkpoint (DCP) directory that ``torch.distributed.checkpoint.load``
reads at any world size; ``dcp_format`` is that directory's file format.
"""
