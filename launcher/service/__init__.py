"""The rendezvous service: one asyncio loop serving signed HTTP requests (rendezvous,
heartbeats as long polls, reports, leaves) and the process-group store. It records what
workers say into the job's state under the job's lock; decisions stay with the core."""
