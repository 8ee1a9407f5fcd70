"""Wire protocol between the driver (``lightning_elastic.launcher``) and the workers (the rest of ``lightning_elastic``).

This is the only module both sides import. It is standard-library only (no torch, no
requests) so the driver can use it without loading the worker runtime.

Every request is an HTTP POST with a JSON body, signed with the per-job secret (the secret
itself never travels: workers may run on other machines). ``sign_request`` gives the
headers: a wall-clock timestamp, a random nonce and
``HMAC-SHA256(secret, method | path | timestamp | nonce | sha256(body))``. The driver
signs its reply, bound to that nonce (``sign_reply``), so a worker can trust the store
address and ranks it is told: a spoofed driver cannot answer. Bodies are decoded into the
frozen dataclasses below by ``decode``, which rejects unknown, missing or mistyped fields with a
``ProtocolError`` naming the field, so a malformed request gets a clear 400 instead of
reaching the driver's state.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import itertools
import json
import math
import os
import re
import secrets
import time
import typing
from collections.abc import Mapping
from enum import Enum
from typing import Any, NamedTuple, TypeVar

# Environment variables the driver sets for every worker (besides torch's usual RANK,
# WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
ENV_DRIVER_URL = "LIGHTNING_ELASTIC_DRIVER_URL"
# The job secret is never in the environment or on a command line (``ps`` shows both): the
# worker reads it once from the inherited pipe whose descriptor this variable names.
ENV_SECRET_FD = "LIGHTNING_ELASTIC_SECRET_FD"
ENV_WORKER_ID = "LIGHTNING_ELASTIC_WORKER_ID"
ENV_HOSTNAME = "LIGHTNING_ELASTIC_HOSTNAME"
ENV_HEARTBEAT_INTERVAL = "LIGHTNING_ELASTIC_HEARTBEAT_INTERVAL"
ENV_HEARTBEAT_TIMEOUT = "LIGHTNING_ELASTIC_HEARTBEAT_TIMEOUT"
ENV_ELASTIC_TIMEOUT = "LIGHTNING_ELASTIC_TIMEOUT"
ENV_LOST_MEMBER_WAIT = "LIGHTNING_ELASTIC_LOST_MEMBER_WAIT"
ENV_PROCESS_GROUP_TIMEOUT = "LIGHTNING_ELASTIC_PROCESS_GROUP_TIMEOUT"
ENV_PREEMPTION_GRACE = "LIGHTNING_ELASTIC_PREEMPTION_GRACE"
# --driver-patience, set with --state-dir: how long a worker waits for an unreachable driver
# (a restarted one adopts it) before it exits. Unset: 2 x the heartbeat timeout, as without.
ENV_DRIVER_PATIENCE = "LIGHTNING_ELASTIC_DRIVER_PATIENCE"
# The exit status of a worker that gave up on an unreachable driver (its patience ran out):
# EX_TEMPFAIL of sysexits.h. A restarted driver that adopts the job and finds a worker of
# its predecessor ended so counts it as gone for the driver's absence, not as a failure of
# its host (launcher/job/exits.py), and starts a new worker in its slot.
EXIT_DRIVER_GONE = 75
# With --state-dir: the file in it where the serving driver writes its URL (one line,
# http://HOST:PORT). A worker that cannot reach its driver re-reads it: a restarted driver
# may serve at another address (another machine; the state dir is on a shared filesystem).
ENV_DRIVER_URL_FILE = "LIGHTNING_ELASTIC_DRIVER_URL_FILE"
# The CUDA device index a worker keeps for its whole life, set when its launcher gives every
# worker devices of its own (a Ray actor sees only its GPUs, as device 0...). Unset: the
# device is cuda:LOCAL_RANK of the current round.
ENV_CUDA_DEVICE = "LIGHTNING_ELASTIC_CUDA_DEVICE"

# The protocol's version, on every request and reply: a worker and a driver of different
# versions refuse each other with a message that says so (2: the store's MULTI_GET; 3: a
# hot spare's WAIT says so; 4: store writes carry a request id; 5: a round-lost question
# says how long it may wait for the driver's verdict on a silent peer; 6: agents join the job).
PROTOCOL_VERSION = 6
HEADER_PROTOCOL = "X-Elastic-Protocol"
HEADER_TIMESTAMP = "X-Elastic-Timestamp"  # integer seconds of the sender's wall clock
HEADER_NONCE = "X-Elastic-Nonce"  # 32 hex digits, never sent twice: see NonceSequence
HEADER_SIGNATURE = "X-Elastic-Signature"  # hex HMAC-SHA256; on requests and on replies

PATH_RENDEZVOUS = "/v1/rendezvous"
PATH_HEARTBEAT = "/v1/heartbeat"
PATH_ROUND_LOST = "/v1/round-lost"
PATH_REPORT = "/v1/report"
PATH_LEAVE = "/v1/leave"
PATH_STORE = "/v1/store"
# Every round forms its group under this prefix followed by the round number and "/"
# (process_group.init_round_group); the store forgets a round's keys once later rounds form.
STORE_ROUND_PREFIX = "lightning_elastic/round/"

RENDEZVOUS_POLL = 5.0  # longest the service holds a rendezvous request before "wait"
# A round-lost question may wait for the driver's verdict on a peer silent since it was
# asked: that peer's heartbeat timeout runs out at most --heartbeat-timeout after the
# question, and the driver's next decision pass breaks the round; this much more covers
# that pass on a busy machine (see RoundLostRequest.verdict_wait_seconds).
VERDICT_GRACE = 3.0


# A text either side shows in one line (an error, a worker's last output line) is bounded
# so: cut at the last word boundary before the bound, with this after it (never mid-word).
ELLIPSIS = "..."
_WHITESPACE = re.compile(r"\s")


def clip(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters; else its words that fit, then "...".

    A single word longer than half the bound (a path, a hex dump) is cut where it must be.
    """
    if len(text) <= limit:
        return text
    room = max(0, limit - len(ELLIPSIS))
    head = text[:room + 1]  # the character after the room tells whether a word ends there
    cut = max((m.start() for m in _WHITESPACE.finditer(head)), default=-1)
    kept = head[:cut] if cut > room // 2 else text[:room]
    return kept.rstrip() + ELLIPSIS


class ProtocolError(ValueError):
    """A message does not match the protocol; the text names the field and what was expected."""


class RendezvousStatus(str, Enum):
    ASSIGNED = "assigned"  # the worker is a member of a newly formed round
    WAIT = "wait"  # no round for this worker yet: ask again
    EXIT = "exit"  # the worker is not part of the job any more: leave gracefully


class Outcome(str, Enum):
    DONE = "done"  # the training function returned: the only report that means success
    REMOVED = "removed"  # left gracefully because its slot was removed from the job
    FAILED = "failed"  # raised an error that was not a lost peer


@dataclasses.dataclass(frozen=True)
class RendezvousRequest:
    worker_id: str
    after_round: int  # the last round this worker was a member of (0: none yet)


@dataclasses.dataclass(frozen=True)
class Assignment:
    """A worker's place in one rendezvous round."""

    round: int
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str
    store_host: str  # the process-group store: the driver's own service (PATH_STORE)
    store_port: int
    generation: int  # host-change generation this round was formed at


@dataclasses.dataclass(frozen=True)
class RendezvousReply:
    status: RendezvousStatus
    assignment: Assignment | None = None
    # WAIT to a hot spare (--spares): it may wait for as long as the job runs, not only
    # for the elastic timeout that bounds waiting for a round to form.
    standby: bool = False


@dataclasses.dataclass(frozen=True)
class HeartbeatRequest:
    worker_id: str
    known_generation: int
    known_broken_round: int  # highest broken round the worker has heard of (0: none)
    wait_seconds: float  # long poll: answer early when the generation or broken round moves past known
    stepped_round: int = 0  # the newest round in which this worker completed a training step (0: none)
    stepped_at: float = 0.0  # its first step in that round, the worker's wall clock (for the timeline)
    # Durable snapshots this worker wrote and failed to write (--snapshot-dir), for the
    # driver's summary; the newest failure's reason (bounded by the driver).
    snapshots_written: int = 0
    snapshots_failed: int = 0
    snapshot_error: str = ""


@dataclasses.dataclass(frozen=True)
class HeartbeatReply:
    generation: int  # monotonic counter of announced host changes
    last_broken_round: int  # highest round known to have lost a member (0: none)


@dataclasses.dataclass(frozen=True)
class RoundLostRequest:
    """A member caught an error in ``round``: was it a lost peer or its own?

    ``collective`` says the error is a collective failure by its type (torch's DistError,
    a timeout): the member leaves its round whatever the answer, so the driver counts the
    round as broken by it. ``error`` (its last traceback line) and ``commits`` (commits
    made in this round) let the driver see the same error repeating with no progress.

    ``wait_seconds`` is --error-wait: after it the error is the asker's own, unless a peer
    has sent the driver nothing since the question. Such a peer may be dead on a machine
    whose exit the driver cannot see yet (a crashed node's srun or ssh lingers): then the
    answer waits for the driver's verdict on it (its heartbeat timeout breaks the round:
    "lost"), at most ``verdict_wait_seconds`` from the question (the worker's
    --heartbeat-timeout plus ``VERDICT_GRACE``; 0: not at all).
    """

    worker_id: str
    round: int
    wait_seconds: float
    collective: bool = False
    error: str = ""
    commits: int = 0
    verdict_wait_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class RoundLostReply:
    lost: bool  # True: recover (restore the last commit, re-form); False: the error is the worker's own
    reason: str = ""  # why a collective error is not recovered from (e.g. it repeats)


@dataclasses.dataclass(frozen=True)
class LeaveRequest:
    """The worker received a preemption notice (SIGTERM) and asks to leave gracefully."""

    worker_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class LeaveReply:
    # True: the driver announces the departure; the worker leaves at its next check.
    # False: exit now (the driver is stopping this worker itself, or training is over).
    graceful: bool


@dataclasses.dataclass(frozen=True)
class Report:
    worker_id: str
    round: int
    outcome: Outcome
    message: str = ""
    # The final counts of durable snapshots (as in HeartbeatRequest), the write in progress
    # included: a heartbeat may not come after the last one.
    snapshots_written: int = 0
    snapshots_failed: int = 0
    snapshot_error: str = ""


class StoreOp(str, Enum):
    """Operations of the process-group store (``torch.distributed.Store``'s, one key each)."""

    SET = "set"
    GET = "get"  # long poll: answer when the key exists or ``wait_seconds`` have passed
    ADD = "add"
    CHECK = "check"
    COMPARE_SET = "compare_set"
    DELETE = "delete"
    NUM_KEYS = "num_keys"
    APPEND = "append"
    MULTI_GET = "multi_get"  # long poll: answer when every one of ``keys`` exists, or not found


@dataclasses.dataclass(frozen=True)
class StoreRequest:
    """One store operation. The store is served by the driver over this signed channel, so
    nobody without the job's secret can read or plant process-group bootstrap keys (a
    torch TCPStore has no authentication at all). Values are base64 (bytes in JSON)."""

    worker_id: str
    op: StoreOp
    key: str = ""
    value: str = ""  # base64: SET, APPEND, COMPARE_SET's desired value
    expected: str = ""  # base64: COMPARE_SET's expected value
    amount: str = "0"  # ADD, as decimal text (it may be negative)
    wait_seconds: float = 0.0  # GET, MULTI_GET
    keys: tuple[str, ...] = ()  # MULTI_GET
    # Writes: the same for every attempt of one operation, so that a retry after a lost
    # reply is answered, not applied a second time (an ADD counted twice). "": no id.
    request_id: str = ""


@dataclasses.dataclass(frozen=True)
class StoreReply:
    found: bool  # GET, CHECK, DELETE: whether the key existed
    value: str = ""  # base64: GET's value, ADD's new total (decimal text), COMPARE_SET's result
    count: int = 0  # NUM_KEYS
    values: tuple[str, ...] = ()  # base64: MULTI_GET's, in the order of its keys, once all exist


# ----- agents (``lightning-elastic agent``): capacity that joins by itself ---------------
#
# An agent runs on a machine or in a pod, connects to the driver (outbound only), offers its
# host and slots, then carries out the driver's orders there: start a worker, signal one.
# It speaks the same signed channel as the workers: every request signed with the job
# secret (the driver refuses a wrong or replayed one), every reply signed for the request's
# own nonce (the agent refuses a reply the driver did not sign: nothing starts on an agent
# that cannot prove the driver knows the secret). Orders and worker events are numbered and
# acknowledged, so a lost reply never loses or repeats one.

PATH_AGENT_JOIN = "/v1/agent/join"
PATH_AGENT_POLL = "/v1/agent/poll"  # long poll: the agent's orders, and its heartbeat
PATH_AGENT_REPORT = "/v1/agent/report"  # its workers' starts, output and exits
PATH_AGENT_LEAVE = "/v1/agent/leave"
AGENT_OUTPUT_CHARS = 16 * 1024  # the most worker output one event carries (MAX_BODY bounds a request)
AGENT_EVENTS_PER_REPORT = 3  # events per report: with their output, within the service's MAX_BODY


class AgentOrderKind(str, Enum):
    START = "start"  # start worker ``worker_id`` with command, env and cwd
    SIGNAL = "signal"  # send ``signal`` to the worker's process group


class AgentEventKind(str, Enum):
    STARTED = "started"  # the worker runs as ``pid``
    OUTPUT = "output"  # ``output``: what it printed (stdout and stderr, as text)
    EXITED = "exited"  # it ended: ``status``, or killed by ``signal``
    NOT_STARTED = "not_started"  # its command could not be started: ``detail`` says why


@dataclasses.dataclass(frozen=True)
class AgentWorker:
    """A worker an agent still holds when it joins again (its driver restarted): the new
    driver adopts it if its saved state has that worker on that host (and that pid)."""

    worker_id: str
    pid: int
    running: bool = True
    status: int = 0  # (not running) its exit status ...
    signal: int = 0  # ... or the signal that killed it


@dataclasses.dataclass(frozen=True)
class AgentJoin:
    agent_id: str  # drawn once per agent process: a reconnect of the same agent says so
    host: str
    slots: int
    # The workers this agent kept while it had no driver (--state-dir: a restarted driver
    # adopts the ones it knows; the agent stops every other one).
    workers: tuple[AgentWorker, ...] = ()


@dataclasses.dataclass(frozen=True)
class AgentJoinReply:
    accepted: bool
    reason: str = ""  # why the agent is refused (one line)
    poll_seconds: float = 0.0  # how long the driver holds a poll: the agent's heartbeat period
    heartbeat_timeout: float = 0.0  # silent this long, an agent is lost (and stops its workers)
    # --state-dir: how long the agent keeps its workers while it cannot reach the driver (a
    # restarted driver adopts them); 0: it stops them once the heartbeat timeout has passed.
    patience: float = 0.0
    adopted: tuple[str, ...] = ()  # of the join's workers, those the driver took: stop the rest


@dataclasses.dataclass(frozen=True)
class AgentOrder:
    number: int  # 1, 2, ... per agent: carried out once, in order
    kind: AgentOrderKind
    worker_id: str
    command: tuple[str, ...] = ()
    env: tuple[str, ...] = ()  # NAME=VALUE, laid over the agent's own environment
    cwd: str = ""
    signal: int = 0


@dataclasses.dataclass(frozen=True)
class AgentPoll:
    agent_id: str
    wait_seconds: float
    orders_through: int  # the highest order number the agent has received


@dataclasses.dataclass(frozen=True)
class AgentPollReply:
    orders: tuple[AgentOrder, ...] = ()  # those past orders_through, in order
    # The driver no longer counts this agent (lost, refused, the job is over): it stops its
    # workers and joins again, or exits once it is leaving.
    dropped: bool = False
    reason: str = ""
    ended: bool = False  # (with dropped) the job is over: the agent exits
    # (with dropped) this driver never knew the agent: it restarted. The agent joins again
    # keeping its workers (when its previous driver gave it a patience) for it to adopt.
    unknown: bool = False


@dataclasses.dataclass(frozen=True)
class AgentEvent:
    number: int  # 1, 2, ... per agent: taken once, in order
    kind: AgentEventKind
    worker_id: str
    pid: int = 0
    status: int = 0  # EXITED: the exit status ...
    signal: int = 0  # ... or the signal that killed it (status then 0)
    output: str = ""
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class AgentReport:
    agent_id: str
    events: tuple[AgentEvent, ...]


@dataclasses.dataclass(frozen=True)
class AgentReportReply:
    through: int  # the highest event number the driver has taken
    dropped: bool = False


@dataclasses.dataclass(frozen=True)
class AgentLeave:
    """SIGTERM reached the agent: ``gone`` False: its host leaves the job (its workers leave at
    their next check); True: its workers have all ended and it exits now."""

    agent_id: str
    gone: bool = False


@dataclasses.dataclass(frozen=True)
class Ack:
    ok: bool = True


@dataclasses.dataclass(frozen=True)
class ErrorReply:
    error: str


T = TypeVar("T")


# ----- signing -----------------------------------------------------------------------

# Canonical forms only, so each header value has one spelling and the signature covers
# exactly what is parsed.
_TIMESTAMP = re.compile(r"0|[1-9][0-9]{0,15}")
_NONCE = re.compile(r"[0-9a-f]{32}")
_SIGNATURE = re.compile(r"[0-9a-f]{64}")


class RequestAuth(NamedTuple):
    """The well-formed signing headers of a request (not yet verified)."""

    timestamp: int
    nonce: str
    signature: str


def _hmac(secret: str, *parts: str) -> str:
    # "\n" cannot occur in any part (an HTTP method or path, digits, hex), so the joined
    # message is unambiguous.
    return hmac.new(secret.encode(), "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def _matches(expected: str, given: str | None) -> bool:
    # compare_digest raises on non-ASCII str (a header may hold any latin-1 text): compare bytes.
    return given is not None and hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace"))


def request_signature(secret: str, method: str, path: str, timestamp: int, nonce: str, body: bytes) -> str:
    return _hmac(secret, method, path, str(timestamp), nonce, hashlib.sha256(body).hexdigest())


class NonceSequence:
    """The nonces of one sender: 16 hex digits drawn once, then 16 of a sequence number.

    The driver refuses a replay by remembering, per sender, the newest sequence number and
    a bitmap of the ones below it (``launcher/service/replay_guard.py``): memory per sender, not
    per request. A forked child (a data-loader worker that copied its parent's client)
    draws a sender of its own, so parent and child never send the same nonce.
    """

    def __init__(self) -> None:
        self._pid = -1
        self._sender = ""
        self._numbers = itertools.count()

    def next(self) -> str:
        if self._pid != os.getpid():
            self._pid, self._sender, self._numbers = os.getpid(), secrets.token_hex(8), itertools.count()
        return f"{self._sender}{next(self._numbers):016x}"  # count's next() is atomic under the GIL


def sign_request(
    secret: str, method: str, path: str, body: bytes, nonces: NonceSequence | None = None
) -> dict[str, str]:
    """The signing headers for one request: call again for every attempt (a fresh nonce).

    A client sending more than one request passes its ``NonceSequence``; without one, the
    request is its own sender (a one-off: tests, tools).
    """
    timestamp, nonce = int(time.time()), (nonces or NonceSequence()).next()
    return {
        HEADER_PROTOCOL: str(PROTOCOL_VERSION),
        HEADER_TIMESTAMP: str(timestamp),
        HEADER_NONCE: nonce,
        HEADER_SIGNATURE: request_signature(secret, method, path, timestamp, nonce, body),
    }


def parse_request_auth(headers: Mapping[str, str]) -> RequestAuth | None:
    """The request's signing headers, or None when one is missing or malformed."""
    timestamp, nonce, signature = (headers.get(h) for h in (HEADER_TIMESTAMP, HEADER_NONCE, HEADER_SIGNATURE))
    if not (
        timestamp is not None and _TIMESTAMP.fullmatch(timestamp)
        and nonce is not None and _NONCE.fullmatch(nonce)
        and signature is not None and _SIGNATURE.fullmatch(signature)
    ):
        return None
    return RequestAuth(int(timestamp), nonce, signature)


def verify_request(secret: str, method: str, path: str, auth: RequestAuth, body: bytes) -> bool:
    """Is the signature right? Freshness (timestamp window, unseen nonce) is the receiver's check."""
    expected = request_signature(secret, method, path, auth.timestamp, auth.nonce, body)
    return _matches(expected, auth.signature)


def sign_reply(secret: str, status: int, nonce: str, body: bytes) -> str:
    """Signature of a reply to the request that carried ``nonce`` (sent in HEADER_SIGNATURE)."""
    # int(): an HTTPStatus must sign as "200", never as its enum name.
    return _hmac(secret, "reply", str(int(status)), nonce, hashlib.sha256(body).hexdigest())


def verify_reply(secret: str, status: int, nonce: str, body: bytes, signature: str | None) -> bool:
    return _matches(sign_reply(secret, status, nonce, body), signature)


def version_mismatch(theirs: str | None, side: str = "worker") -> str:
    """Why a peer speaking protocol ``theirs`` (None: too old to say) is refused."""
    said = f"protocol version {theirs}" if theirs is not None else "an older protocol (no version)"
    ours = "driver" if side == "worker" else "worker"
    return (f"the {side} speaks {said} and the {ours} version {PROTOCOL_VERSION}: "
            "install the same lightning-elastic version for the driver and on every host")


def to_json(message: Any) -> bytes:
    return json.dumps(_as_dict(message), default=_enum_value).encode()


def _as_dict(message: Any) -> dict[str, Any]:
    """A message's fields by name, a nested message as a dict: ``dataclasses.asdict``
    without its deep copy of every value (over half of encoding an assignment, which the
    driver does for every member of a round at once). Fields hold JSON values, enums,
    tuples of strings, messages or tuples of messages."""
    return {name: _as_dict(value) if hasattr(value, "__dataclass_fields__") else _items(value)
            for name in _field_names(type(message)) for value in (getattr(message, name),)}


def _items(value: Any) -> Any:
    """A tuple of messages (an agent's orders, its events) as a list of dicts; else as it is."""
    if type(value) is tuple and value and hasattr(value[0], "__dataclass_fields__"):
        return [_as_dict(item) for item in value]
    return value


@functools.lru_cache(maxsize=None)
def _field_names(cls: Any) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _enum_value(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    raise TypeError(f"cannot encode {type(value).__name__}")


def decode(cls: type[T], body: bytes | str | dict) -> T:
    """Build ``cls`` from JSON, checking every field's presence and type."""
    if isinstance(body, (bytes, str)):
        try:
            body = json.loads(body)
        except (ValueError, UnicodeDecodeError) as err:
            raise ProtocolError(f"{cls.__name__}: body is not valid JSON ({err})") from None
    return _build(cls, body, cls.__name__)


@functools.lru_cache(maxsize=None)
def _schema(cls: Any) -> tuple[tuple[tuple[str, Any, bool], ...], frozenset[str]]:
    """A message class's fields as (name, type, has a default), and their names: resolved
    once per class (get_type_hints parses the annotations on every call, a tenth of the
    service's time per request at fleet scale)."""
    hints = typing.get_type_hints(cls)
    fields = tuple((f.name, hints[f.name], f.default is not dataclasses.MISSING) for f in dataclasses.fields(cls))
    return fields, frozenset(name for name, _, _ in fields)


def _build(cls: Any, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ProtocolError(f"{where}: expected a JSON object, got {type(data).__name__}")
    fields, names = _schema(cls)
    if not names.issuperset(data):
        raise ProtocolError(f"{where}: unknown field(s) {', '.join(sorted(set(data) - names))}")
    values = {}
    for name, hint, has_default in fields:
        if name not in data:
            if has_default:
                continue
            raise ProtocolError(f"{where}: missing field '{name}'")
        value = data[name]
        kind = type(value)
        # Most fields are a string, a flag or a number, exactly as declared and in range:
        # taken as they are (what _convert would return); anything else is checked there.
        if kind is hint and (kind is str or kind is bool or (kind is int and value >= 0)
                             or (kind is float and 0.0 <= value < math.inf)):  # NaN fails both
            values[name] = value
        else:
            values[name] = _convert(hint, value, f"{where}.{name}")
    return cls(**values)


def _convert(hint: Any, value: Any, where: str) -> Any:
    args = typing.get_args(hint)
    if type(None) in args:  # Optional[X]
        if value is None:
            return None
        (hint,) = [a for a in args if a is not type(None)]
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if typing.get_origin(hint) is tuple:  # tuple[X, ...]: a JSON array
        (item, _ellipsis) = args
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected an array, got {type(value).__name__}")
        return tuple(_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in hint)
            raise ProtocolError(f"{where}: expected one of {allowed}, got {value!r}") from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:  # an integer beyond float's range: as unusable as inf
            raise ProtocolError(f"{where}: expected a finite number, got an integer too large") from None
    if hint in (int, float, str, bool):
        if type(value) is not hint:
            raise ProtocolError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
        # json.loads accepts NaN and Infinity; NaN passes "< 0" (and every bound after
        # it, e.g. a wait would have no limit), so refuse both before that check.
        if hint is float and not math.isfinite(value):
            raise ProtocolError(f"{where}: expected a finite number, got {value}")
        if hint in (int, float) and value < 0:
            raise ProtocolError(f"{where}: expected a non-negative number, got {value}")
        return value
    raise ProtocolError(f"{where}: unsupported type {hint}")
