"""The worker's membership in the job: ``ElasticWorker`` and what it is made of.

``worker`` is the facade the rest of the package uses. Behind it: ``settings`` (what the
launcher's environment says), ``shared`` (the one object the training thread and the
heartbeat thread both touch, behind one lock), ``rendezvous`` (waiting for the next
round), ``heartbeat`` (the thread that keeps the driver informed and cuts a broken round),
``round_group`` (the round's process group and its connections), ``collective_wait``,
``host_check``, ``stuck_round``, ``group_sockets``, ``process_group`` and ``preemption``;
and the link to the driver: ``client``, ``driver_locator``, ``driver_store``.

Nothing here imports ``lightning_elastic.training`` or the Lightning integration.
"""
