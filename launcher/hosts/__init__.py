"""Where the hosts come from and whether the driver can use them: discovery (a script, a
fixed list, a Slurm allocation), and the network (which hosts are this machine, which names
resolve, the address the workers reach the driver at)."""
