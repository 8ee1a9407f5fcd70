"""``lightning-elastic agent``: capacity that joins a job by itself (see ``run.py``)."""
