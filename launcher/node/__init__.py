"""What runs on each worker's machine, beside the workers: the ssh/Slurm supervisor, the
keeper that lets a worker outlive the driver (``--state-dir``), the fork server and its
client (``--preload``), and the one way a worker process is started there (``spawn``).

Kept free of heavy imports (no torch): these start on every remote start.
"""
