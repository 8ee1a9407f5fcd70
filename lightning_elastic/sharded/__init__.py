"""Elastic sharded (FSDP2) training: commits of each rank's rows with a copy on a peer,
re-sharded point to point to the new world at a reset (``state``), and durable snapshots
in torch.distributed.checkpoint's format."""
