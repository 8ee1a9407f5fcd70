"""Starting, signalling and reaping worker processes: locally, over ssh, or as Slurm steps.

``base`` is the contract the driver uses; ``local``, ``ssh`` and ``slurm`` implement it;
``supervisor`` runs on the remote host under ssh, or in the srun step. With ``--state-dir``,
``detached`` starts local workers under a ``keeper`` so that they outlive the driver, and
finds them again. Kept free of heavy imports: the supervisor imports
this package on every remote start.
"""
