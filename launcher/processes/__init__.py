"""Starting, signalling and reaping worker processes: locally or on other machines over ssh.

``base`` is the contract the driver uses; ``local`` and ``ssh`` implement it; ``supervisor``
runs on the remote host under ssh. With ``--state-dir``, ``detached`` starts local workers
under a ``keeper`` so that they outlive the driver, and finds them again. Kept free of heavy imports: the supervisor imports
this package on every remote start.
"""
