"""launcher/config.py: LaunchConfig validation, one message naming the bad option and value."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lightning_elastic.launcher.config import LaunchConfig, SshSettings, Timeouts
from lightning_elastic.launcher.errors import ConfigError, LaunchError
from lightning_elastic.launcher.job.slots import HostSlots

HOSTS = (HostSlots("localhost", 2),)


def config(**overrides) -> LaunchConfig:
    fields = dict(command=("python", "train.py"), np=2, min_np=1, max_np=4, hosts=HOSTS)
    fields.update(overrides)
    return LaunchConfig(**fields)


def test_valid_config_keeps_its_values_and_defaults():
    c = config()
    assert (c.np, c.min_np, c.max_np, c.hosts) == (2, 1, 4, HOSTS)
    assert c.elastic_timeout == 600.0 and c.reset_limit is None and c.blacklist_cooldown is None
    assert c.timeouts == Timeouts()


def test_discovery_script_instead_of_hosts_is_valid():
    c = config(hosts=None, discovery_script=Path("/bin/true"))
    assert c.discovery_script == Path("/bin/true")


def test_config_error_is_a_launch_error():
    assert issubclass(ConfigError, LaunchError)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(command=()), "COMMAND: missing, expected the training command, e.g. python train.py"),
        (dict(np=0, min_np=0), "-np: must be at least 1, got 0"),
        (dict(np=-2, min_np=1), "-np: must be at least 1, got -2"),
        (dict(min_np=3), "--min-np: must be between 1 and -np (2), got 3"),
        (dict(min_np=0), "--min-np: must be between 1 and -np (2), got 0"),
        (dict(max_np=1), "--max-np: must be at least -np (2), got 1"),
        (dict(spares=-1), "--spares: expected 0 or more workers, got -1"),
        (dict(preload=("torch", "lightning-pytorch")),
         "--preload: 'lightning-pytorch' is not a module name, expected e.g. lightning.pytorch"),
        (dict(preload=("torch",), state_dir=Path("/tmp/state")),
         "--preload: not supported with --state-dir yet (workers that outlive the driver cannot be forked "
         "from a server that dies with it)"),
        (dict(preload=("torch",), command=("bash", "train.sh")),
         "--preload: COMMAND must start with a Python interpreter (python, python3, ...) to fork from, got 'bash'"),
        (dict(hosts=None), "give exactly one host source: -H/--hosts, --hostfile, --host-discovery-script, --ray or --slurm"),
        (dict(discovery_script=Path("/bin/true")), "give exactly one host source: -H/--hosts, --hostfile, --host-discovery-script, --ray or --slurm"),
        (dict(elastic_timeout=0.0), "--elastic-timeout: must be positive, got 0.0"),
        (dict(elastic_timeout=-5.0), "--elastic-timeout: must be positive, got -5.0"),
        (dict(reset_limit=-1), "--reset-limit: must be 0 or more, got -1"),
        (dict(discovery_interval=0.0), "--discovery-interval: must be positive, got 0.0"),
        (dict(blacklist_cooldown=(5.0, 1.0)), "--blacklist-cooldown-range: expected 0 <= MIN <= MAX, got 5.0 1.0"),
        (dict(blacklist_cooldown=(-1.0, 3.0)), "--blacklist-cooldown-range: expected 0 <= MIN <= MAX, got -1.0 3.0"),
    ],
)
def test_invalid_value_gives_one_line_naming_it(overrides, message):
    with pytest.raises(ConfigError) as info:
        config(**overrides)
    assert str(info.value) == message
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("overrides", [dict(preload=("torch", "lightning.pytorch")),
                                       dict(preload=("torch",), command=("/venv/bin/python3.11", "-u", "t.py")),
                                       dict(min_np=2, max_np=2), dict(reset_limit=0), dict(blacklist_cooldown=(0.0, 0.0)), dict(blacklist_cooldown=(2.0, 2.0))])
def test_boundary_values_are_accepted(overrides):
    config(**overrides)


def test_infinite_elastic_timeout_is_accepted():
    assert math.isinf(config(elastic_timeout=math.inf).elastic_timeout)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(elastic_timeout=math.nan),
        dict(discovery_interval=math.nan),
        dict(blacklist_cooldown=(math.nan, 10.0)),
    ],
    ids=["elastic_timeout", "discovery_interval", "blacklist_cooldown"],
)
def test_nan_is_refused(overrides):
    with pytest.raises(ConfigError):
        config(**overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(elastic_timeout=math.nan), "--elastic-timeout: must be positive, got nan"),
        (dict(discovery_interval=math.nan), "--discovery-interval: must be a finite number, got nan"),
        (dict(discovery_interval=math.inf), "--discovery-interval: must be a finite number, got inf"),
        (dict(blacklist_cooldown=(math.nan, 10.0)), "--blacklist-cooldown-range: expected finite numbers, got nan 10.0"),
        (dict(blacklist_cooldown=(1.0, math.inf)), "--blacklist-cooldown-range: expected finite numbers, got 1.0 inf"),
    ],
)
def test_non_finite_value_gives_one_line_naming_it(overrides, message):
    with pytest.raises(ConfigError) as info:
        config(**overrides)
    assert str(info.value) == message


# ----- SshSettings ---------------------------------------------------------------------


def test_ssh_settings_defaults():
    s = SshSettings()
    assert (s.port, s.identity_file, s.options) == (None, None, ())
    assert (s.connect_timeout, s.server_alive_interval, s.server_alive_count) == (10.0, 5.0, 3)
    assert config().ssh == s


@pytest.mark.parametrize("port", [1, 22, 65535])
def test_ssh_port_in_range_is_accepted(port):
    assert SshSettings(port=port).port == port


@pytest.mark.parametrize("port", [0, -1, 65536, 70000])
def test_ssh_port_out_of_range_is_refused(port):
    with pytest.raises(ConfigError) as info:
        SshSettings(port=port)
    assert str(info.value) == f"--ssh-port: expected a port number 1..65535, got {port}"


def test_ssh_identity_file_that_exists_is_accepted(tmp_path):
    key = tmp_path / "id_ed25519"
    key.write_text("key")
    assert SshSettings(identity_file=key).identity_file == key


@pytest.mark.parametrize("name", ["missing-key", "."], ids=["missing", "directory"])
def test_ssh_identity_file_that_is_not_a_file_is_refused(tmp_path, name):
    path = tmp_path / name
    with pytest.raises(ConfigError) as info:
        SshSettings(identity_file=path)
    assert str(info.value) == f"--ssh-identity-file: {path} is not a readable file"


@pytest.mark.parametrize("options", [("StrictHostKeyChecking=no",), ("A=b", "UserKnownHostsFile=/dev/null", "X=")])
def test_ssh_options_as_name_equals_value_are_accepted(options):
    assert SshSettings(options=options).options == options


@pytest.mark.parametrize("option", ["BatchMode", "=yes", " =yes", "Batch Mode=yes", ""])
def test_ssh_option_without_name_equals_value_is_refused(option):
    with pytest.raises(ConfigError) as info:
        SshSettings(options=("Port=22", option))
    assert str(info.value) == f"--ssh-option: expected NAME=VALUE as ssh's -o takes it, got {option!r}"


# ----- heartbeat timeout, -x/--env, driver address --------------------------------------


@pytest.mark.parametrize("timeout", [math.nan, math.inf, 1.5, 0.0, -10.0])
def test_heartbeat_timeout_not_finite_or_under_two_intervals_is_refused(timeout):
    with pytest.raises(ConfigError) as info:
        config(timeouts=Timeouts(heartbeat_timeout=timeout))
    assert str(info.value) == (
        "--heartbeat-timeout: expected a finite number of seconds, at least twice the heartbeat "
        f"interval (2), got {timeout}"
    )


def test_heartbeat_timeout_bound_follows_the_interval():
    with pytest.raises(ConfigError, match=r"--heartbeat-timeout: .*\(6\), got 5.0"):
        config(timeouts=Timeouts(heartbeat_interval=3.0, heartbeat_timeout=5.0))
    assert config(timeouts=Timeouts(heartbeat_interval=3.0, heartbeat_timeout=6.0)).timeouts.heartbeat_timeout == 6.0


@pytest.mark.parametrize("timeout", [2.0, 10.0, 3600.0])
def test_heartbeat_timeout_of_two_intervals_or_more_is_accepted(timeout):
    assert config(timeouts=Timeouts(heartbeat_timeout=timeout)).timeouts.heartbeat_timeout == timeout


def test_env_names_that_are_identifiers_are_accepted():
    env = (("FOO", "1"), ("_private", ""), ("NCCL_DEBUG", "INFO"))
    assert config(env=env).env == env


@pytest.mark.parametrize("name", ["1BAD", "A-B", "A B", ""])
def test_env_name_that_is_not_a_variable_name_is_refused(name):
    with pytest.raises(ConfigError) as info:
        config(env=(("GOOD", "1"), (name, "2")))
    assert str(info.value) == f"-x/--env: {name!r} is not a valid variable name"


def test_driver_address_and_interface_default_to_none_and_are_kept():
    assert (config().driver_address, config().network_interface) == (None, None)
    c = config(driver_address="10.0.0.1", network_interface="eth1")
    assert (c.driver_address, c.network_interface) == ("10.0.0.1", "eth1")


@pytest.mark.parametrize(("timeout", "period"), [(10.0, 2.5), (7.0, 1.75), (2.5, 1.0), (60.0, 2.5)])
def test_heartbeat_period_is_a_quarter_of_the_timeout_between_1_and_2_5_s(timeout, period):
    assert Timeouts(heartbeat_timeout=timeout).heartbeat_period == period


def test_an_explicit_heartbeat_interval_is_kept():
    assert Timeouts(heartbeat_interval=0.5, heartbeat_timeout=10.0).heartbeat_period == 0.5


# ----- --stop-grace, --discovery-timeout, --port, --log-dir -------------------------------


def test_stop_grace_and_discovery_timeout_defaults():
    t = Timeouts()
    assert (t.stop_grace, t.discovery) == (5.0, 30.0)


@pytest.mark.parametrize(("field", "option"), [("stop_grace", "--stop-grace"), ("discovery", "--discovery-timeout")])
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_stop_grace_and_discovery_timeout_must_be_positive_and_finite(field, option, value):
    with pytest.raises(ConfigError) as info:
        Timeouts(**{field: value})
    assert str(info.value) == f"{option}: expected a positive, finite number of seconds, got {value}"


@pytest.mark.parametrize("port", [0, -1, 65536])
def test_port_out_of_range_is_refused(port):
    with pytest.raises(ConfigError) as info:
        config(port=port)
    assert str(info.value) == f"--port: expected a port number 1..65535, got {port}"


def test_port_none_means_any_free_port():
    assert config().port is None and config(port=29500).port == 29500


def test_log_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "afile"
    path.write_text("")
    with pytest.raises(ConfigError) as info:
        config(log_dir=path)
    assert str(info.value) == f"--log-dir: {path} is a file, expected a directory"
    assert config(log_dir=tmp_path / "new").log_dir == tmp_path / "new"  # created by launch(), not here
