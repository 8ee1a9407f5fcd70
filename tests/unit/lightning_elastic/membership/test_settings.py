"""lightning_elastic/membership/settings.py: the job secret read once from the launcher's pipe."""

from __future__ import annotations

import os

import pytest

from lightning_elastic import protocol as p
from lightning_elastic.errors import RendezvousError
from lightning_elastic.membership.settings import WorkerSettings, _read_secret


def secret_pipe(secret: bytes) -> int:
    """A pipe's read end holding ``secret``, its write end closed (as spawn_worker leaves it)."""
    read_end, write_end = os.pipe()
    os.write(write_end, secret)
    os.close(write_end)
    return read_end


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def closed_descriptor() -> int:
    read_end, write_end = os.pipe()
    os.close(read_end)
    os.close(write_end)
    return read_end


def test_env_secret_fd_name():
    assert p.ENV_SECRET_FD == "LIGHTNING_ELASTIC_SECRET_FD"


def test_secret_is_read_the_descriptor_closed_and_the_variable_removed():
    fd = secret_pipe(b"0123abcd")
    environ = {p.ENV_SECRET_FD: str(fd), "OTHER": "kept"}
    assert _read_secret(environ) == "0123abcd"
    assert environ == {"OTHER": "kept"}
    assert not is_open(fd)


def test_secret_longer_than_one_read_is_read_whole():
    secret = "x" * 10_000 + "end"
    environ = {p.ENV_SECRET_FD: str(secret_pipe(secret.encode()))}
    assert _read_secret(environ) == secret


def test_unreadable_descriptor_is_a_rendezvous_error_naming_it():
    fd = closed_descriptor()
    environ = {p.ENV_SECRET_FD: str(fd)}
    with pytest.raises(RendezvousError) as info:
        _read_secret(environ)
    message = str(info.value)
    assert message.startswith(f"cannot read the job secret from descriptor {fd} (")
    assert message.endswith("): start workers with lightning-elastic launch")
    assert p.ENV_SECRET_FD not in environ


def test_settings_from_environment_read_the_secret_and_heartbeat_timeout():
    fd = secret_pipe(b"job-secret")
    environ = {
        p.ENV_DRIVER_URL: "http://127.0.0.1:29400",
        p.ENV_WORKER_ID: "w3",
        p.ENV_HOSTNAME: "node-a",
        p.ENV_SECRET_FD: str(fd),
        p.ENV_HEARTBEAT_TIMEOUT: "7.5",
    }
    settings = WorkerSettings.from_environment(environ)
    assert settings is not None
    assert settings.secret == "job-secret"
    assert settings.heartbeat_timeout == 7.5
    assert (settings.driver_url, settings.worker_id, settings.hostname) == ("http://127.0.0.1:29400", "w3", "node-a")
    assert settings.heartbeat_interval == 1.0  # the default when the launcher gives none
    # A question about an error may wait for the driver's verdict on a silent peer: its
    # heartbeat timeout, and a grace for the driver's pass (issue 34, row 66).
    assert settings.verdict_wait == 7.5 + p.VERDICT_GRACE
    assert p.ENV_SECRET_FD not in environ
    assert not is_open(fd)
    assert "job-secret" not in repr(settings) and "job-secret" not in str(settings)  # never in a log line


def test_settings_default_heartbeat_timeout_is_10():
    environ = {
        p.ENV_DRIVER_URL: "http://127.0.0.1:1",
        p.ENV_WORKER_ID: "w0",
        p.ENV_HOSTNAME: "h",
        p.ENV_SECRET_FD: str(secret_pipe(b"s")),
    }
    assert WorkerSettings.from_environment(environ).heartbeat_timeout == 10.0


def test_settings_without_a_driver_are_none_and_leave_the_descriptor_alone():
    fd = secret_pipe(b"s")
    try:
        environ = {p.ENV_SECRET_FD: str(fd)}
        assert WorkerSettings.from_environment(environ) is None
        assert environ == {p.ENV_SECRET_FD: str(fd)}
        assert is_open(fd)
    finally:
        os.close(fd)


def test_settings_without_the_descriptor_variable_name_it():
    environ = {p.ENV_DRIVER_URL: "http://127.0.0.1:1", p.ENV_WORKER_ID: "w0", p.ENV_HOSTNAME: "h"}
    with pytest.raises(RendezvousError) as info:
        WorkerSettings.from_environment(environ)
    assert str(info.value) == (
        f"environment variable {p.ENV_SECRET_FD} is missing: start workers with lightning-elastic launch"
    )


def test_settings_with_a_bad_descriptor_are_a_rendezvous_error():
    fd = closed_descriptor()
    environ = {p.ENV_DRIVER_URL: "http://127.0.0.1:1", p.ENV_WORKER_ID: "w0", p.ENV_HOSTNAME: "h",
               p.ENV_SECRET_FD: str(fd)}
    with pytest.raises(RendezvousError, match=f"descriptor {fd} "):
        WorkerSettings.from_environment(environ)
