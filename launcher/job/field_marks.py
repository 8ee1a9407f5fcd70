"""How a field of the job's state is saved (``--state-dir``): marks carried in its metadata.

The codec (``launcher/restart/state_codec.py``) reads them, with each field's type hint, to
save ``JobState`` as it is:

- ``transient``: left out of a save; a restarted driver has the field's default. For what
  it learns again at once (pending requests, heartbeat ages, the hosts discovery lists),
  what only bounds a wait, and what is no data (locks, signals, the host manager).
- ``clock``: every ``float`` in the field's value is a time on the driver's clock
  (``time.monotonic``), which means nothing in another process or on another machine. A
  save holds it as seconds from the save; a restarted driver puts it back as as many
  seconds from its own now, so that the outage does not count and no wait is cut short.
"""

from __future__ import annotations

import dataclasses

TRANSIENT = {"transient": True}
CLOCK = {"clock": True}


def transient(**kwargs):  # noqa: ANN003, ANN201 - dataclasses.field's own signature
    return dataclasses.field(metadata=TRANSIENT, **kwargs)


def clock(**kwargs):  # noqa: ANN003, ANN201 - dataclasses.field's own signature
    return dataclasses.field(metadata=CLOCK, **kwargs)


def is_transient(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get("transient"))


def is_clock(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get("clock"))
