"""HTTP client of the driver's rendezvous service (worker side)."""

from __future__ import annotations

import time
from typing import Any, TypeVar

import requests

from lightning_elastic import protocol as p
from lightning_elastic.errors import RendezvousError

T = TypeVar("T")

CONNECT_TIMEOUT = 5.0
RETRY_FOR = 30.0  # keep retrying a request this long while the driver is unreachable


class DriverClient:
    def __init__(self, url: str, secret: str, worker_id: str) -> None:
        self.worker_id = worker_id
        self._url = url.rstrip("/")
        self._session = requests.Session()
        self._session.headers[p.AUTH_HEADER] = f"{p.AUTH_SCHEME} {secret}"

    def rendezvous(self, after_round: int) -> p.RendezvousReply:
        return self._post(p.PATH_RENDEZVOUS, p.RendezvousRequest(self.worker_id, after_round),
                          p.RendezvousReply, wait=p.RENDEZVOUS_POLL)

    def heartbeat(self, known_generation: int, wait: float) -> p.HeartbeatReply:
        return self._post(p.PATH_HEARTBEAT, p.HeartbeatRequest(self.worker_id, known_generation, wait),
                          p.HeartbeatReply, wait=wait, retry_for=0.0)

    def round_lost(self, round_number: int, wait: float) -> bool:
        reply = self._post(p.PATH_ROUND_LOST, p.RoundLostRequest(self.worker_id, round_number, wait),
                           p.RoundLostReply, wait=wait)
        return reply.lost

    def report(self, round_number: int, outcome: p.Outcome, message: str = "") -> None:
        self._post(p.PATH_REPORT, p.Report(self.worker_id, round_number, outcome, message[:2000]), p.Ack)

    def close(self) -> None:
        self._session.close()

    def _post(self, path: str, message: Any, reply_type: type[T], wait: float = 0.0,
              retry_for: float = RETRY_FOR) -> T:
        deadline = time.monotonic() + retry_for
        while True:
            try:
                response = self._session.post(
                    self._url + path, data=p.to_json(message),
                    headers={"Content-Type": "application/json"},
                    timeout=(CONNECT_TIMEOUT, wait + 30.0),
                )
            except requests.RequestException as err:
                if time.monotonic() >= deadline:
                    raise RendezvousError(f"driver at {self._url} unreachable: {err}") from None
                time.sleep(0.5)
                continue
            if response.status_code != 200:
                raise RendezvousError(
                    f"driver refused {path} ({response.status_code}): {response.text.strip()[:300]}"
                )
            return p.decode(reply_type, response.content)
