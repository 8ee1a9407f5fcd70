"""How the members of a new round agree on the sharded commit to restore: one gather of
what each holds and on which host, then the same pure choice on every member.

Shared by ``le.ShardedState`` and the Lightning strategy (``strategy="elastic_fsdp"``).
"""

from __future__ import annotations

import dataclasses

import torch

from lightning_elastic import protocol as p
from lightning_elastic.commit import collectives
from lightning_elastic.commit.collectives import Wait
from lightning_elastic.errors import ElasticError
from lightning_elastic.sharded.commit import ShardedCommit
from lightning_elastic.sharded.layout import Fresh, Layout, Lost, Restore, choose_commit, holder_shift


@dataclasses.dataclass(frozen=True)
class Agreement:
    """This round's layout (each rank's copy placed on another host when one exists) and
    the commit every member restores (the same on every member)."""

    hosts: tuple[str, ...]  # by rank
    layout: Layout
    choice: Restore | Fresh | Lost


def agree(commit: ShardedCommit, assignment: p.Assignment, device: torch.device, wait: Wait) -> Agreement:
    """Collective over the round: every member's host and ``commit.holding()``, then the choice."""
    mine = (assignment.hostname, commit.holding())
    gathered = collectives.all_gather_object(mine, device, wait) if assignment.size > 1 else [mine]
    hosts = tuple(host for host, _ in gathered)
    layout = Layout(assignment.round, assignment.size, holder_shift(hosts))
    return Agreement(hosts, layout, choose_commit([holding for _, holding in gathered]))


def lost_error(lost: Lost, where: str | None = None) -> ElasticError:
    """The end, in one line: no whole commit in memory, and ``where`` (default: no
    ``--snapshot-dir``) no durable snapshot to resume from."""
    return ElasticError(f"sharded state lost from memory: {lost.reason}; {where or 'no --snapshot-dir'} to resume from")
