"""Starting, signalling and reaping worker processes: locally, over ssh, or as Slurm steps.

``base`` is the contract the driver uses; ``local``, ``ssh`` and ``slurm`` implement it
(``node/supervisor`` is their far end on the worker's machine). With ``--state-dir``,
``detached`` starts local workers under a keeper (``node/keeper``) so that they outlive the
driver, and finds them again; ``warm_start`` starts them through a fork server (``--preload``).
Kept free of heavy imports: the supervisor imports ``spawn``'s package on every remote start.
"""
