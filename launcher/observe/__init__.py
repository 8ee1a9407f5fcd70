"""What people read: the timeline (``events.jsonl``) and its picture, and the driver's own
log lines, each written by a thread of its own so that a stalled disk or terminal never
stalls a decision."""
