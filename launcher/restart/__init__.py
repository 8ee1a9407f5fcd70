"""What lets the job outlive a process: the ``--state-dir`` files (the job's state saved as
it is, the secret, where the driver serves), the adoption of running workers by a
restarted driver, and the choice of the durable snapshot a new launch resumes from."""
