"""launcher/config.py: LaunchConfig validation, one message naming the bad option and value."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from launcher.config import LaunchConfig, Timeouts
from launcher.errors import ConfigError, LaunchError
from launcher.hosts import HostSlots

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
        (dict(hosts=None), "give exactly one host source: -H/--hosts or --host-discovery-script"),
        (dict(discovery_script=Path("/bin/true")), "give exactly one host source: -H/--hosts or --host-discovery-script"),
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


@pytest.mark.parametrize("overrides", [dict(min_np=2, max_np=2), dict(reset_limit=0), dict(blacklist_cooldown=(0.0, 0.0)), dict(blacklist_cooldown=(2.0, 2.0))])
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
