"""Elastic FSDP2 training: sharded state, its commits, and its durable snapshots.

``state`` (``le.ShardedState``) commits each rank's rows with a copy on a peer and
re-shards them point to point to the new world at a reset (``layout``, ``rows``,
``exchange``, ``parts``, ``commit``). ``snapshots`` writes every rank's rows to
``--snapshot-dir`` in the background as a torch.distributed.checkpoint (DCP) directory that
``torch.distributed.checkpoint.load`` reads at any world size; ``dcp_format`` is that
directory's file format.
"""
