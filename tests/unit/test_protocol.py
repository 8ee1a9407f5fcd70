"""lightning_elastic/protocol.py: every message round-trips; decode refuses what does not fit."""

from __future__ import annotations

import dataclasses
import json

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
    p.HeartbeatRequest("w", 2, 1.5),
    p.HeartbeatReply(4, 3),
    p.RoundLostRequest("w", 2, 5.0),
    p.RoundLostReply(True),
    p.RoundLostReply(False),
    p.Report("w", 1, p.Outcome.DONE),
    p.Report("w", 2, p.Outcome.FAILED, "ValueError: bad ünïcode ✓"),
    p.Report("w", 0, p.Outcome.REMOVED, ""),
    p.Ack(),
    p.Ack(False),
    p.ErrorReply("no such path /x"),
]


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
    }
    assert json.loads(p.to_json(p.RendezvousReply(p.RendezvousStatus.WAIT))) == {
        "status": "wait", "assignment": None,
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
    req = p.decode(p.HeartbeatRequest, '{"worker_id": "w", "known_generation": 0, "wait_seconds": 2}')
    assert req.wait_seconds == 2.0 and type(req.wait_seconds) is float


# ----- rejections ----------------------------------------------------------------------


def test_unknown_field_is_refused_naming_it():
    with pytest.raises(p.ProtocolError, match=r"RendezvousRequest: unknown field\(s\) evil, extra"):
        p.decode(p.RendezvousRequest, '{"worker_id": "w", "after_round": 0, "extra": 1, "evil": 2}')


def test_missing_field_is_refused_naming_it():
    with pytest.raises(p.ProtocolError, match=r"RendezvousRequest: missing field 'after_round'"):
        p.decode(p.RendezvousRequest, '{"worker_id": "w"}')


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
        p.decode(p.HeartbeatRequest, '{"worker_id": "w", "known_generation": 0, "wait_seconds": false}')


def test_int_is_not_a_bool():
    with pytest.raises(p.ProtocolError, match=r"RoundLostReply.lost: expected bool, got int"):
        p.decode(p.RoundLostReply, '{"lost": 1}')


@pytest.mark.parametrize(
    ("cls", "body", "field"),
    [
        (p.RendezvousRequest, '{"worker_id": "w", "after_round": -1}', "after_round"),
        (p.HeartbeatRequest, '{"worker_id": "w", "known_generation": 0, "wait_seconds": -0.5}', "wait_seconds"),
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
        (p.HeartbeatRequest, '{"worker_id": "w", "known_generation": 0, "wait_seconds": NaN}'),
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
    body = f'{{"worker_id": "w", "known_generation": 0, "wait_seconds": {value}}}'
    with pytest.raises(p.ProtocolError, match=rf"^HeartbeatRequest.wait_seconds: expected a finite number, got {shown}$"):
        p.decode(p.HeartbeatRequest, body)
