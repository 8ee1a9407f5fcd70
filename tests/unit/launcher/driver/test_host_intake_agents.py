"""launcher/driver/host_intake.py with --agents beside a host source: one host, one source.

The host source's hosts reach the board (an agent for one of them is refused at its join);
an agent connected before discovery listed its host keeps it, and the listing is ignored
(said once): the driver never plans that host's workers from both."""

from __future__ import annotations

import logging

import pytest

from lightning_elastic import protocol as p
from lightning_elastic.launcher.driver.host_intake import HostIntake
from lightning_elastic.launcher.hosts.discovery import DiscoveryResult
from lightning_elastic.launcher.job.slots import HostSlots
from lightning_elastic.launcher.service.agent_board import AgentBoard
from tests.troubleshooting_rows import assert_documented

pytestmark = pytest.mark.timeout(30)


class Discovery:
    def __init__(self) -> None:
        self.result: DiscoveryResult | None = None

    def show(self, *hosts: str) -> None:
        sequence = self.result.sequence + 1 if self.result else 1
        self.result = DiscoveryResult([HostSlots(h, 1) for h in hosts], None, sequence)

    def latest(self) -> DiscoveryResult | None:
        return self.result


class Intake(HostIntake):
    """The attributes of ``Driver`` that ``HostIntake`` reads."""

    def __init__(self, board: AgentBoard) -> None:
        self._discovery = Discovery()
        self._agents = board
        self._agents_version = 0
        self._discovery_seq = 0
        self._discovered: list[HostSlots] = []
        self._refused_hosts: set[str] = set()
        self._address = "10.0.0.1"
        self._resolves = None
        self._config = None
        self._is_local = lambda host: False


def names(listed) -> list[str]:
    return [h.host for h in listed.hosts]


def test_a_listed_host_is_the_host_sources_and_an_agent_for_it_is_refused():
    board = AgentBoard(8, heartbeat_timeout=4.0, poll_seconds=1.0)
    intake = Intake(board)
    intake._discovery.show("node-1", "node-2")
    assert names(intake._take_discovery()) == ["node-1", "node-2"]
    refused = board.join(p.AgentJoin("1" * 32, "node-1", 1))
    assert not refused.accepted and "in the job's host list" in refused.reason
    assert board.join(p.AgentJoin("2" * 32, "pod-a", 1)).accepted
    assert names(intake._take_discovery()) == ["node-1", "node-2", "pod-a"]


def test_an_agent_connected_before_discovery_listed_its_host_keeps_it_said_once(caplog):
    caplog.set_level(logging.ERROR)
    board = AgentBoard(8, heartbeat_timeout=4.0, poll_seconds=1.0)
    intake = Intake(board)
    intake._discovery.show("node-1")
    intake._take_discovery()
    assert board.join(p.AgentJoin("1" * 32, "pod-a", 2)).accepted
    intake._discovery.show("node-1", "pod-a")  # discovery lists the agent's host later
    listed = intake._take_discovery()
    assert listed.hosts == (HostSlots("node-1", 1), HostSlots("pod-a", 2))  # once: the agent's
    assert board.serves("pod-a")  # its workers go through the agent
    intake._discovery.show("node-1", "pod-a")
    intake._take_discovery()
    said = [r.getMessage() for r in caplog.records if "pod-a" in r.getMessage()]
    assert len(said) == 1 and "an agent connected for it before the host source listed it" in said[0]
    assert_documented(said[0])
