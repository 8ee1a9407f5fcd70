"""Starting, signalling and reaping worker processes: locally, over ssh, or as Slurm steps.

``base`` is the contract the driver uses; ``local``, ``ssh`` and ``slurm`` implement it;
``supervisor`` runs on the remote host under ssh, or in the srun step. Kept free of heavy imports: the supervisor imports
this package on every remote start.
"""
