"""lightning_elastic/protocol.py: every message round-trips; decode refuses what does not fit."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import time
from http import HTTPStatus

import pytest

from lightning_elastic import protocol as p

ASSIGNMENT = p.Assignment(
    round=3, rank=1, size=4, local_rank=1, local_size=2, cross_rank=0, cross_size=2,
    hostname="127.0.0.2", store_host="127.0.0.1", store_port=29500, generation=5,
)

MESSAGES = [
    p.RendezvousRequest("127.0.0.1[0]#0", 0),
    p.RendezvousRequest("w", 7),
    ASSIGNMENT,
    p.RendezvousReply(p.RendezvousStatus.ASSIGNED, ASSIGNMENT),
    p.RendezvousReply(p.RendezvousStatus.WAIT),
    p.RendezvousReply(p.RendezvousStatus.EXIT, None),
    p.HeartbeatRequest("w", 2, 1, 1.5),
    p.HeartbeatReply(4, 3),
    p.RoundLostRequest("w", 2, 5.0),
    p.RoundLostReply(True),
    p.RoundLostReply(False),
    p.RoundLostRequest("w", 3, 5.0, collective=True, error="DistBackendError: timed out", commits=2),
    p.RoundLostReply(False, "the same collective error ended 3 consecutive rounds"),
    p.LeaveRequest("w", "SIGTERM (preemption notice)"),
    p.LeaveReply(True),
    p.LeaveReply(False),
    p.Report("w", 1, p.Outcome.DONE),
    p.Report("w", 2, p.Outcome.FAILED, "ValueError: bad ünïcode ✓"),
    p.Report("w", 0, p.Outcome.REMOVED, ""),
    p.Ack(),
    p.Ack(False),
    p.ErrorReply("no such path /x"),
    p.StoreRequest("w", p.StoreOp.SET, "lightning_elastic/round/1/0", value="AAE="),
    p.StoreRequest("w", p.StoreOp.GET, "k", wait_seconds=2.0),
    p.StoreRequest("w", p.StoreOp.ADD, "counter", amount="-3"),
    p.StoreRequest("w", p.StoreOp.COMPARE_SET, "k", value="Yg==", expected="YQ=="),
    p.StoreRequest("w", p.StoreOp.NUM_KEYS),
    p.StoreReply(True, "AAE="),
    p.StoreReply(False),
    p.StoreReply(True, count=7),
    p.AgentJoin("0" * 32, "pod-a", 2),
    p.AgentJoinReply(True, poll_seconds=2.5, heartbeat_timeout=10.0),
    p.AgentWorker("pod-a[0]#3", 4242, running=False, status=1),
    p.AgentJoin("0" * 32, "pod-a", 2, (p.AgentWorker("pod-a[0]#3", 4242),
                                       p.AgentWorker("pod-a[1]#4", 4243, running=False, signal=9))),
    p.AgentJoinReply(True, poll_seconds=2.5, heartbeat_timeout=10.0, patience=120.0, adopted=("pod-a[0]#3",)),
    p.AgentJoinReply(False, "another agent is connected for host pod-a"),
    p.AgentPoll("0" * 32, 2.5, 7),
    p.AgentPollReply((p.AgentOrder(8, p.AgentOrderKind.START, "pod-a[0]#3", ("python", "t.py"), ("RANK=0",), "/w"),
                      p.AgentOrder(9, p.AgentOrderKind.SIGNAL, "pod-a[0]#3", signal=15))),
    p.AgentPollReply(dropped=True, reason="the job ended", ended=True),
    p.AgentPollReply(dropped=True, reason="the driver does not know this agent", unknown=True),
    p.AgentReport("0" * 32, (p.AgentEvent(1, p.AgentEventKind.STARTED, "w", pid=42),
                             p.AgentEvent(2, p.AgentEventKind.OUTPUT, "w", output="ünï ✓\r"),
                             p.AgentEvent(3, p.AgentEventKind.EXITED, "w", signal=9))),
    p.AgentReportReply(3),
    p.AgentOrder(1, p.AgentOrderKind.SIGNAL, "w", signal=10),
    p.AgentEvent(4, p.AgentEventKind.NOT_STARTED, "w", detail="cannot start 'python': No such file"),
    p.AgentLeave("0" * 32, gone=True),
]


# Every HeartbeatRequest field but wait_seconds, for bodies that vary that one.
HB_FIELDS = '"worker_id": "w", "known_generation": 0, "known_broken_round": 0'


def _id(m):
    return type(m).__name__


def test_every_message_class_is_covered():
    classes = {
        obj for obj in vars(p).values()
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == p.__name__
    }
    assert classes == {type(m) for m in MESSAGES}


@pytest.mark.parametrize("message", MESSAGES, ids=_id)
def test_round_trip_through_json_bytes(message):
    body = p.to_json(message)
    assert isinstance(body, bytes)
    assert p.decode(type(message), body) == message


@pytest.mark.parametrize("message", MESSAGES, ids=_id)
def test_round_trip_through_str_and_dict(message):
    text = p.to_json(message).decode()
    assert p.decode(type(message), text) == message
    assert p.decode(type(message), json.loads(text)) == message


def test_enums_are_encoded_as_their_values():
    assert json.loads(p.to_json(p.Report("w", 1, p.Outcome.FAILED))) == {
        "worker_id": "w", "round": 1, "outcome": "failed", "message": "",
        "snapshots_written": 0, "snapshots_failed": 0, "snapshot_error": "",
    }
    assert json.loads(p.to_json(p.RendezvousReply(p.RendezvousStatus.WAIT))) == {
        "status": "wait", "assignment": None, "standby": False,
    }


def test_decoded_enums_are_enum_members():
    reply = p.decode(p.RendezvousReply, b'{"status": "exit"}')
    assert reply.status is p.RendezvousStatus.EXIT
    assert reply.assignment is None


def test_optional_default_fields_may_be_left_out():
    assert p.decode(p.Report, '{"worker_id": "w", "round": 1, "outcome": "done"}') == p.Report(
        "w", 1, p.Outcome.DONE, ""
    )
    assert p.decode(p.Ack, "{}") == p.Ack(True)


def test_integer_is_accepted_for_a_float_field_and_becomes_float():
    req = p.decode(
        p.HeartbeatRequest, '{"worker_id": "w", "known_generation": 0, "known_broken_round": 0, "wait_seconds": 2}'
    )
    assert req.wait_seconds == 2.0 and type(req.wait_seconds) is float


# ----- rejections ----------------------------------------------------------------------


def test_unknown_field_is_refused_naming_it():
    with pytest.raises(p.ProtocolError, match=r"RendezvousRequest: unknown field\(s\) evil, extra"):
        p.decode(p.RendezvousRequest, '{"worker_id": "w", "after_round": 0, "extra": 1, "evil": 2}')


def test_missing_field_is_refused_naming_it():
    with pytest.raises(p.ProtocolError, match=r"RendezvousRequest: missing field 'after_round'"):
        p.decode(p.RendezvousRequest, '{"worker_id": "w"}')


def test_heartbeat_request_without_known_broken_round_is_refused():
    with pytest.raises(p.ProtocolError, match=r"HeartbeatRequest: missing field 'known_broken_round'"):
        p.decode(p.HeartbeatRequest, '{"worker_id": "w", "known_generation": 0, "wait_seconds": 1}')


@pytest.mark.parametrize(
    ("body", "where", "expected"),
    [
        ('{"worker_id": 5, "after_round": 0}', "RendezvousRequest.worker_id", "expected str, got int"),
        ('{"worker_id": "w", "after_round": "0"}', "RendezvousRequest.after_round", "expected int, got str"),
        ('{"worker_id": "w", "after_round": 1.0}', "RendezvousRequest.after_round", "expected int, got float"),
        ('{"worker_id": "w", "after_round": true}', "RendezvousRequest.after_round", "expected int, got bool"),
        ('{"worker_id": "w", "after_round": null}', "RendezvousRequest.after_round", "expected int, got NoneType"),
        ('{"worker_id": null, "after_round": 0}', "RendezvousRequest.worker_id", "expected str, got NoneType"),
    ],
)
def test_wrong_type_is_refused_naming_field_and_types(body, where, expected):
    with pytest.raises(p.ProtocolError) as info:
        p.decode(p.RendezvousRequest, body)
    assert str(info.value) == f"{where}: {expected}"


def test_bool_is_not_a_float():
    with pytest.raises(p.ProtocolError, match=r"HeartbeatRequest.wait_seconds: expected float, got bool"):
        p.decode(p.HeartbeatRequest, f'{{{HB_FIELDS}, "wait_seconds": false}}')


def test_int_is_not_a_bool():
    with pytest.raises(p.ProtocolError, match=r"RoundLostReply.lost: expected bool, got int"):
        p.decode(p.RoundLostReply, '{"lost": 1}')


@pytest.mark.parametrize(
    ("cls", "body", "field"),
    [
        (p.RendezvousRequest, '{"worker_id": "w", "after_round": -1}', "after_round"),
        (p.HeartbeatRequest, f'{{{HB_FIELDS}, "wait_seconds": -0.5}}', "wait_seconds"),
        (p.HeartbeatRequest, '{"worker_id": "w", "known_generation": 0, "known_broken_round": -1, "wait_seconds": 0}',
         "known_broken_round"),
        (p.RoundLostRequest, '{"worker_id": "w", "round": -3, "wait_seconds": 1}', "round"),
    ],
)
def test_negative_numbers_are_refused(cls, body, field):
    with pytest.raises(p.ProtocolError, match=rf"{cls.__name__}\.{field}: expected a non-negative number"):
        p.decode(cls, body)


def test_unknown_enum_value_is_refused_listing_the_allowed_ones():
    with pytest.raises(p.ProtocolError, match=r"Report.outcome: expected one of 'done', 'removed', 'failed', got 'won'"):
        p.decode(p.Report, '{"worker_id": "w", "round": 1, "outcome": "won"}')


def test_unhashable_enum_value_is_refused():
    with pytest.raises(p.ProtocolError, match=r"RendezvousReply.status: expected one of"):
        p.decode(p.RendezvousReply, '{"status": ["wait"]}')


def test_nested_message_errors_name_the_path():
    bad = dataclasses.asdict(ASSIGNMENT) | {"rank": "zero"}
    with pytest.raises(p.ProtocolError, match=r"RendezvousReply.assignment.rank: expected int, got str"):
        p.decode(p.RendezvousReply, {"status": "assigned", "assignment": bad})


def test_nested_message_must_be_an_object():
    with pytest.raises(p.ProtocolError, match=r"RendezvousReply.assignment: expected a JSON object, got list"):
        p.decode(p.RendezvousReply, '{"status": "assigned", "assignment": [1, 2]}')


@pytest.mark.parametrize("body", [b"", b"not json", b"{", b"{'single': 1}", b"\xff\xfe\x00garbage", "{,}"])
def test_non_json_is_refused(body):
    with pytest.raises(p.ProtocolError, match=r"^RendezvousRequest: body is not valid JSON"):
        p.decode(p.RendezvousRequest, body)


@pytest.mark.parametrize(("body", "kind"), [("[]", "list"), ('"text"', "str"), ("3", "int"), ("null", "NoneType")])
def test_json_that_is_not_an_object_is_refused(body, kind):
    with pytest.raises(p.ProtocolError, match=rf"^Report: expected a JSON object, got {kind}$"):
        p.decode(p.Report, body)


def test_protocol_error_is_a_value_error():
    assert issubclass(p.ProtocolError, ValueError)


def test_to_json_refuses_non_json_values():
    with pytest.raises(TypeError, match="cannot encode object"):
        p.to_json(p.ErrorReply(object()))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cls", "body"),
    [
        (p.HeartbeatRequest, f'{{{HB_FIELDS}, "wait_seconds": NaN}}'),
        (p.RoundLostRequest, '{"worker_id": "w", "round": 1, "wait_seconds": NaN}'),
    ],
)
def test_nan_is_not_a_non_negative_number(cls, body):
    with pytest.raises(p.ProtocolError):
        p.decode(cls, body)


@pytest.mark.parametrize(
    ("value", "shown"), [("Infinity", "inf"), ("-Infinity", "-inf"), ("1" + "0" * 400, "an integer too large")]
)
def test_number_beyond_float_is_refused_naming_the_field(value, shown):
    body = f'{{{HB_FIELDS}, "wait_seconds": {value}}}'
    with pytest.raises(p.ProtocolError, match=rf"^HeartbeatRequest.wait_seconds: expected a finite number, got {shown}$"):
        p.decode(p.HeartbeatRequest, body)


# ----- signing -------------------------------------------------------------------------

SECRET = "0123456789abcdef" * 4
BODY = p.to_json(p.HeartbeatRequest("w", 0, 0, 1.0))


def _auth(headers: dict[str, str]) -> p.RequestAuth:
    auth = p.parse_request_auth(headers)
    assert auth is not None
    return auth


def test_request_signature_is_hmac_sha256_of_the_documented_fields():
    # Pins the wire format: driver and workers of different builds must agree on it.
    headers = p.sign_request(SECRET, "POST", p.PATH_HEARTBEAT, BODY)
    fields = ["POST", p.PATH_HEARTBEAT, headers[p.HEADER_TIMESTAMP], headers[p.HEADER_NONCE],
              hashlib.sha256(BODY).hexdigest()]
    expected = hmac.new(SECRET.encode(), "\n".join(fields).encode(), hashlib.sha256).hexdigest()
    assert headers[p.HEADER_SIGNATURE] == expected


def test_signed_request_carries_wall_clock_seconds_a_fresh_nonce_and_never_the_secret():
    before = int(time.time())
    first = p.sign_request(SECRET, "POST", p.PATH_HEARTBEAT, BODY)
    second = p.sign_request(SECRET, "POST", p.PATH_HEARTBEAT, BODY)
    assert set(first) == {p.HEADER_PROTOCOL, p.HEADER_TIMESTAMP, p.HEADER_NONCE, p.HEADER_SIGNATURE}
    assert first[p.HEADER_PROTOCOL] == str(p.PROTOCOL_VERSION)
    assert before <= int(first[p.HEADER_TIMESTAMP]) <= int(time.time())
    assert len(first[p.HEADER_NONCE]) == 32 and first[p.HEADER_NONCE] != second[p.HEADER_NONCE]
    assert first[p.HEADER_SIGNATURE] != second[p.HEADER_SIGNATURE]
    assert not any(SECRET in value for value in first.values())


def test_bearer_scheme_is_gone():
    assert not hasattr(p, "AUTH_SCHEME") and not hasattr(p, "AUTH_HEADER")


def test_signed_request_verifies():
    auth = _auth(p.sign_request(SECRET, "POST", p.PATH_REPORT, BODY))
    assert p.verify_request(SECRET, "POST", p.PATH_REPORT, auth, BODY)


@pytest.mark.parametrize(
    ("secret", "method", "path", "body"),
    [
        ("f" * 64, "POST", p.PATH_REPORT, BODY),
        (SECRET[:-1], "POST", p.PATH_REPORT, BODY),
        (SECRET, "GET", p.PATH_REPORT, BODY),
        (SECRET, "POST", p.PATH_HEARTBEAT, BODY),
        (SECRET, "POST", p.PATH_REPORT, BODY + b" "),
        (SECRET, "POST", p.PATH_REPORT, b""),
    ],
    ids=["wrong-secret", "shorter-secret", "method", "path", "body", "empty-body"],
)
def test_request_signature_fails_when_anything_signed_differs(secret, method, path, body):
    auth = _auth(p.sign_request(SECRET, "POST", p.PATH_REPORT, BODY))
    assert not p.verify_request(secret, method, path, auth, body)


def test_request_signature_covers_timestamp_and_nonce():
    auth = _auth(p.sign_request(SECRET, "POST", p.PATH_REPORT, BODY))
    other_nonce = "%032x" % (int(auth.nonce, 16) ^ 1)
    for changed in (auth._replace(timestamp=auth.timestamp + 1), auth._replace(nonce=other_nonce)):
        assert not p.verify_request(SECRET, "POST", p.PATH_REPORT, changed, BODY)


def test_parse_request_auth_reads_the_headers():
    headers = p.sign_request(SECRET, "POST", p.PATH_REPORT, BODY)
    assert p.parse_request_auth(headers) == p.RequestAuth(
        int(headers[p.HEADER_TIMESTAMP]), headers[p.HEADER_NONCE], headers[p.HEADER_SIGNATURE]
    )


@pytest.mark.parametrize(
    ("header", "value"),
    [
        (p.HEADER_TIMESTAMP, None), (p.HEADER_NONCE, None), (p.HEADER_SIGNATURE, None),
        (p.HEADER_TIMESTAMP, ""), (p.HEADER_TIMESTAMP, "-5"), (p.HEADER_TIMESTAMP, "1.5"),
        (p.HEADER_TIMESTAMP, "0123"), (p.HEADER_TIMESTAMP, "\u0661\u0662"), (p.HEADER_TIMESTAMP, "1" * 17),
        (p.HEADER_NONCE, "ab" * 15), (p.HEADER_NONCE, "AB" * 16), (p.HEADER_NONCE, "zz" * 16),
        (p.HEADER_SIGNATURE, "0" * 63), (p.HEADER_SIGNATURE, "A" * 64), (p.HEADER_SIGNATURE, "\xe9" * 64),
        (p.HEADER_SIGNATURE, "0" * 64 + "\n"),
    ],
)
def test_missing_or_malformed_auth_header_parses_to_none(header, value):
    headers = p.sign_request(SECRET, "POST", p.PATH_REPORT, BODY)
    if value is None:
        del headers[header]
    else:
        headers[header] = value
    assert p.parse_request_auth(headers) is None


def test_signed_reply_verifies():
    nonce = "ab" * 16
    signature = p.sign_reply(SECRET, 200, nonce, b"{}")
    assert p.verify_reply(SECRET, 200, nonce, b"{}", signature)


def test_reply_signature_is_hmac_sha256_of_the_documented_fields():
    nonce = "ab" * 16
    message = "\n".join(["reply", "409", nonce, hashlib.sha256(b"{}").hexdigest()]).encode()
    assert p.sign_reply(SECRET, 409, nonce, b"{}") == hmac.new(SECRET.encode(), message, hashlib.sha256).hexdigest()


def test_reply_signature_of_an_http_status_is_that_of_its_number():
    assert p.sign_reply(SECRET, HTTPStatus.CONFLICT, "ab" * 16, b"") == p.sign_reply(SECRET, 409, "ab" * 16, b"")


@pytest.mark.parametrize(
    ("secret", "status", "nonce", "body", "signature"),
    [
        ("f" * 64, 200, "ab" * 16, b"{}", "good"),
        (SECRET, 409, "ab" * 16, b"{}", "good"),
        (SECRET, 200, "cd" * 16, b"{}", "good"),
        (SECRET, 200, "ab" * 16, b'{"x": 1}', "good"),
        (SECRET, 200, "ab" * 16, b"{}", None),
        (SECRET, 200, "ab" * 16, b"{}", ""),
        (SECRET, 200, "ab" * 16, b"{}", "\xe9" * 64),
    ],
    ids=["wrong-secret", "status", "other-request", "body", "missing", "empty", "non-ascii"],
)
def test_reply_signature_fails_when_anything_signed_differs(secret, status, nonce, body, signature):
    if signature == "good":
        signature = p.sign_reply(SECRET, 200, "ab" * 16, b"{}")
    assert not p.verify_reply(secret, status, nonce, body, signature)


# ----- clip: one-line texts bounded at a word boundary ----------------------------------------


@pytest.mark.parametrize("text, limit, clipped", [
    ("short enough", 12, "short enough"),
    ("Connection closed by peer", 20, "Connection closed..."),  # not "Connection closed by..." cut mid-word
    ("Connection closed by peer", 21, "Connection closed..."),
    ("Connection closed by peer", 24, "Connection closed by..."),
    ("x" * 30, 10, "xxxxxxx..."),  # one word longer than half the bound: cut where it must be
    ("a " + "y" * 30, 12, "a yyyyyyy..."),  # a boundary too early to keep: cut too
])
def test_clip_cuts_at_the_last_word_boundary_with_an_ellipsis(text, limit, clipped):
    assert p.clip(text, limit) == clipped
    assert len(p.clip(text, limit)) <= limit
