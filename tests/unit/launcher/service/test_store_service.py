"""launcher/service/store_service.py and lightning_elastic/membership/driver_store.py: the signed process-group store.

The driver side is tested directly; the worker side against the real rendezvous service on
loopback, including a real gloo group formed through it.
"""

from __future__ import annotations

import base64
import datetime
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import requests
from lightning_elastic.launcher.service.registry import Registry
from lightning_elastic.launcher.service.rendezvous_server import RendezvousServer
from lightning_elastic.launcher.service.long_poll import LongPoll
from lightning_elastic.launcher.service.store_service import MAX_KEYS, MAX_REMEMBERED, KeyValueStore
from lightning_elastic import protocol as p
from lightning_elastic.membership.client import DriverClient
from lightning_elastic.membership.driver_store import DriverStore
from lightning_elastic.errors import CollectiveError, RendezvousError

SECRET = "ab" * 32
W = "127.0.0.1[0]#0"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def req(op: p.StoreOp, key: str = "", **fields: object) -> p.StoreRequest:
    return p.StoreRequest(W, op, key, **fields)  # type: ignore[arg-type]


# ----- driver side -------------------------------------------------------------------


def test_set_then_get_returns_the_bytes():
    kv = KeyValueStore()
    assert kv.handle(req(p.StoreOp.SET, "k", value=b64(b"\x00\xffv"))).found
    reply = kv.handle(req(p.StoreOp.GET, "k"))
    assert reply.found and base64.b64decode(reply.value) == b"\x00\xffv"


def test_get_of_a_missing_key_answers_not_found_after_its_wait():
    now = [0.0]
    kv = KeyValueStore(clock=lambda: now[0])
    assert kv.handle(req(p.StoreOp.GET, "missing", wait_seconds=0.0)) == p.StoreReply(False)


def test_get_waits_for_a_key_set_meanwhile():
    kv = KeyValueStore()
    replies: list[p.StoreReply] = []
    waiter = threading.Thread(target=lambda: replies.append(kv.handle(req(p.StoreOp.GET, "late", wait_seconds=5.0))))
    waiter.start()
    kv.handle(req(p.StoreOp.SET, "late", value=b64(b"here")))
    waiter.join(5)
    assert replies and replies[0].found and base64.b64decode(replies[0].value) == b"here"


def test_add_counts_in_decimal_text_and_accepts_negative_amounts():
    kv = KeyValueStore()
    assert base64.b64decode(kv.handle(req(p.StoreOp.ADD, "c", amount="5")).value) == b"5"
    assert base64.b64decode(kv.handle(req(p.StoreOp.ADD, "c", amount="-2")).value) == b"3"
    assert base64.b64decode(kv.handle(req(p.StoreOp.GET, "c")).value) == b"3"


def test_add_refuses_a_non_integer_amount():
    with pytest.raises(p.ProtocolError, match="amount: expected an integer, got 'x'"):
        KeyValueStore().handle(req(p.StoreOp.ADD, "c", amount="x"))


def test_bad_base64_is_a_protocol_error():
    with pytest.raises(p.ProtocolError, match="value: expected base64"):
        KeyValueStore().handle(req(p.StoreOp.SET, "k", value="not base64!"))


def test_check_delete_append_and_num_keys():
    kv = KeyValueStore()
    assert not kv.handle(req(p.StoreOp.CHECK, "a")).found
    kv.handle(req(p.StoreOp.APPEND, "a", value=b64(b"x")))
    kv.handle(req(p.StoreOp.APPEND, "a", value=b64(b"y")))
    assert base64.b64decode(kv.handle(req(p.StoreOp.GET, "a")).value) == b"xy"
    kv.handle(req(p.StoreOp.SET, "b", value=b64(b"1")))
    assert kv.handle(req(p.StoreOp.NUM_KEYS)).count == 2
    assert kv.handle(req(p.StoreOp.DELETE, "a")).found
    assert not kv.handle(req(p.StoreOp.DELETE, "a")).found
    assert kv.handle(req(p.StoreOp.NUM_KEYS)).count == 1


def test_compare_set_sets_only_on_the_expected_value():
    kv = KeyValueStore()
    first = kv.handle(req(p.StoreOp.COMPARE_SET, "k", expected="", value=b64(b"one")))
    assert base64.b64decode(first.value) == b"one"  # missing and nothing expected: set
    wrong = kv.handle(req(p.StoreOp.COMPARE_SET, "k", expected=b64(b"zzz"), value=b64(b"two")))
    assert base64.b64decode(wrong.value) == b"one"
    right = kv.handle(req(p.StoreOp.COMPARE_SET, "k", expected=b64(b"one"), value=b64(b"two")))
    assert base64.b64decode(right.value) == b"two"


def test_multi_get_answers_every_value_in_order_once_the_last_key_is_written():
    kv = KeyValueStore()
    kv.handle(req(p.StoreOp.SET, "b", value=b64(b"2")))
    replies: list[p.StoreReply] = []
    waiter = threading.Thread(target=lambda: replies.append(
        kv.handle(req(p.StoreOp.MULTI_GET, keys=("a", "b", "c"), wait_seconds=5.0))))
    waiter.start()
    kv.handle(req(p.StoreOp.SET, "a", value=b64(b"1")))
    kv.handle(req(p.StoreOp.SET, "c", value=b64(b"3")))
    waiter.join(5)
    assert replies and replies[0].found
    assert [base64.b64decode(v) for v in replies[0].values] == [b"1", b"2", b"3"]


def test_multi_get_with_a_key_missing_is_not_found_after_its_wait():
    kv = KeyValueStore()
    kv.handle(req(p.StoreOp.SET, "a", value=b64(b"1")))
    assert kv.handle(req(p.StoreOp.MULTI_GET, keys=("a", "z"), wait_seconds=0.0)) == p.StoreReply(False)


def test_multi_get_of_too_many_keys_is_a_protocol_error():
    keys = tuple(f"k{i}" for i in range(MAX_KEYS + 1))
    with pytest.raises(p.ProtocolError, match=f"keys: at most {MAX_KEYS} keys, got {MAX_KEYS + 1}"):
        KeyValueStore().handle(req(p.StoreOp.MULTI_GET, keys=keys))


def test_a_write_wakes_only_the_gets_waiting_for_its_key():
    kv = KeyValueStore()
    polls = [kv.poll(req(p.StoreOp.GET, key, wait_seconds=5.0)) for key in ("a", "b")]
    woken: list[str] = []
    with kv._lock:
        kv._signal_of_missing(("a",)).subscribe(lambda: woken.append("a"))
        kv._signal_of_missing(("b",)).subscribe(lambda: woken.append("b"))
    kv.handle(req(p.StoreOp.SET, "a", value=b64(b"1")))
    assert woken == ["a"]
    assert all(isinstance(poll, LongPoll) for poll in polls)


def test_a_write_sent_again_with_its_request_id_is_answered_not_applied_again():
    # A retry after a lost reply: the same ADD or APPEND must count once.
    kv = KeyValueStore()
    add = req(p.StoreOp.ADD, "c", amount="1", request_id="r1")
    assert kv.handle(add) == kv.handle(add) == p.StoreReply(True, b64(b"1"))
    append = req(p.StoreOp.APPEND, "a", value=b64(b"x"), request_id="r2")
    kv.handle(append)
    kv.handle(append)
    assert base64.b64decode(kv.handle(req(p.StoreOp.GET, "a")).value) == b"x"
    # A new id is a new operation; another worker's id is its own.
    kv.handle(req(p.StoreOp.ADD, "c", amount="1", request_id="r3"))
    kv.handle(p.StoreRequest("other", p.StoreOp.ADD, "c", amount="1", request_id="r3"))
    assert base64.b64decode(kv.handle(req(p.StoreOp.GET, "c")).value) == b"3"


def test_remembered_replies_are_bounded_by_the_number_of_workers():
    kv = KeyValueStore()
    for n in range(MAX_REMEMBERED + 10):
        kv.handle(p.StoreRequest(f"w{n}", p.StoreOp.SET, "k", value=b64(b"v"), request_id="r"))
    assert len(kv._answered) == MAX_REMEMBERED and "w0" not in kv._answered


def test_the_keys_of_rounds_two_behind_the_newest_are_deleted():
    kv = KeyValueStore()
    for round_number in (1, 2, 3):
        for rank in range(2):
            kv.handle(req(p.StoreOp.SET, f"{p.STORE_ROUND_PREFIX}{round_number}/{rank}", value=b64(b"addr")))
    kv.handle(req(p.StoreOp.SET, "unrelated", value=b64(b"kept")))
    present = {k for k in kv._data}
    assert present == {"lightning_elastic/round/2/0", "lightning_elastic/round/2/1",
                       "lightning_elastic/round/3/0", "lightning_elastic/round/3/1", "unrelated"}
    # A straggler writing into a forgotten round is kept only until the next round forms.
    kv.handle(req(p.StoreOp.SET, f"{p.STORE_ROUND_PREFIX}1/0", value=b64(b"late")))
    kv.handle(req(p.StoreOp.ADD, f"{p.STORE_ROUND_PREFIX}4/n", amount="1"))
    assert kv.size == 4 and set(kv._data) == {"lightning_elastic/round/3/0", "lightning_elastic/round/3/1",
                                              "lightning_elastic/round/4/n", "unrelated"}


# ----- worker side, through the real signed service ----------------------------------


@pytest.fixture
def service() -> Iterator[RendezvousServer]:
    server = RendezvousServer(Registry(), SECRET)
    server.start()
    yield server
    server.close()


def store_for(service: RendezvousServer, secret: str = SECRET, seconds: float = 5.0) -> DriverStore:
    return DriverStore(DriverClient(service.url, secret, W), datetime.timedelta(seconds=seconds))


def test_driver_store_speaks_torch_store_api(service):
    store = store_for(service)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.check(["k", "n"]) and not store.check(["k", "absent"])
    assert store.compare_set("k", b"v", b"w") == b"w"
    assert store.num_keys() == 2
    assert store.delete_key("k") and not store.check(["k"])
    store.wait(["n"])
    store.set("m", b"x")
    assert store.multi_get(["m", "n"]) == [b"x", b"5"]


class LosesFirstReply:
    """The real session, but the first reply is lost after the driver applied the request
    (as a reset connection or a read timeout loses it)."""

    def __init__(self, session: requests.Session) -> None:
        self._session = session
        self.lost = 0

    def post(self, *args: object, **kwargs: object) -> requests.Response:
        response = self._session.post(*args, **kwargs)  # type: ignore[arg-type]
        if self.lost == 0:
            self.lost += 1
            raise requests.ConnectionError("connection reset by peer")
        return response

    def close(self) -> None:
        self._session.close()


@pytest.mark.parametrize("op", ["add", "append"])
def test_a_write_retried_after_a_lost_reply_applies_once(service, op):
    store = store_for(service)
    lossy = LosesFirstReply(store._client._session)
    store._client._session = lossy  # type: ignore[assignment]
    if op == "add":
        assert store.add("n", 5) == 5
    else:
        store.append("n", b"x")
    assert lossy.lost == 1
    assert store_for(service).get("n") == (b"5" if op == "add" else b"x")


def test_multi_get_waits_for_a_peer_and_wait_of_a_missing_key_fails_as_a_collective_error(service):
    late = threading.Timer(0.2, lambda: store_for(service).set("late", b"here"))
    late.start()
    try:
        assert store_for(service).multi_get(["late"]) == [b"here"]
    finally:
        late.join(5)
    with pytest.raises(CollectiveError, match=r"store keys 'late', 'never'... did not appear within 0.3 s"):
        store_for(service, seconds=0.3).wait(["late", "never"])


def test_get_of_a_key_that_never_appears_fails_at_the_store_timeout_as_a_collective_error(service):
    # A formation whose peer never publishes is re-formed like a failed collective, not fatal.
    store = store_for(service, seconds=0.3)
    with pytest.raises(CollectiveError, match="store key 'never' did not appear within 0.3 s"):
        store.get("never")


def test_a_store_without_the_secret_is_refused_and_changes_nothing(service):
    store_for(service).set("round/2/0", b"genuine")
    intruder = store_for(service, secret="cd" * 32)
    with pytest.raises(RendezvousError, match=r"\(401\)|failed authentication"):
        intruder.set("round/2/0", b"poison")
    assert store_for(service).get("round/2/0") == b"genuine"
    assert service.rejected == 1


RANK_SCRIPT = """
import datetime, sys, torch, torch.distributed as dist
from lightning_elastic.membership.client import DriverClient
from lightning_elastic.membership.driver_store import DriverStore
url, secret, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = DriverStore(DriverClient(url, secret, f"w{rank}"), datetime.timedelta(seconds=20))
dist.init_process_group("gloo", store=dist.PrefixStore("lightning_elastic/round/1", store), rank=rank, world_size=2)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(t.item())
# As a worker does at its end: a group left to interpreter shutdown can abort the process
# ("terminate called without an active exception") while gloo still holds the Python store.
dist.destroy_process_group()
"""


def test_a_gloo_group_forms_through_the_signed_store(service):
    procs = [
        subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, service.url, SECRET, str(r)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outputs = [proc.communicate(timeout=60) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert [out.strip() for out, _ in outputs] == ["3.0", "3.0"]
    assert service.rejected == 0
