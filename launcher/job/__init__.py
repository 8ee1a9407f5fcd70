"""The job's core: its state and the rules that decide over it.

Nothing in this package performs I/O, starts a thread or a process, or reads a clock: time
comes in as ``now``, and what the rules want done (start a worker, signal one, wake a
request, write an event, save the state, end the job) goes out as data for the shell
(``launcher/driver``) to perform. Tested by tables, without processes or sockets.
"""
