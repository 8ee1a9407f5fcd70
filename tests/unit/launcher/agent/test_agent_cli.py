"""The agent's and ``launch --agents``' bad inputs: one line each, naming the input and what
was expected, and never the secret."""

from __future__ import annotations

import pytest

from lightning_elastic.launcher.cli import agent_settings, config_from_args, main, parse_args
from lightning_elastic.launcher.errors import ConfigError
from lightning_elastic.launcher.secret_source import ENV_SECRET, read_secret

SECRET = "s3cr3t-s3cr3t-s3cr3t"


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    return path


@pytest.mark.parametrize("argv, expected", [
    (["--driver", "driver-only"], "--driver: expected HOST:PORT (the driver's address and its --port), got 'driver-only'"),
    (["--driver", "d:0"], "--driver: expected HOST:PORT"),
    (["--driver", "d:99999"], "--driver: expected HOST:PORT"),
    (["--driver", "d:29400", "--slots", "0"], "--slots: expected 1 or more, got 0"),
    (["--driver", "d:29400", "--leave-timeout", "nan"], "--leave-timeout: expected a positive number of seconds"),
])
def test_bad_agent_options_are_one_line(argv, expected, secret_file):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        agent_settings(parse_args(["agent", *argv, "--secret-file", str(secret_file)], {}))


def test_the_agent_takes_the_secret_from_the_file_or_the_environment_and_clears_the_variable(secret_file):
    settings = agent_settings(parse_args(["agent", "--driver", "d:1", "--secret-file", str(secret_file)], {}))
    assert settings.secret == SECRET and SECRET not in repr(settings)
    environ = {ENV_SECRET: SECRET}
    assert read_secret(None, environ) == SECRET and ENV_SECRET not in environ


@pytest.mark.parametrize("text, expected", [
    ("short", "expected one word of 16 to 4096 characters (e.g. from openssl rand -hex 32), got 5 character(s)"),
    ("two words but long enough", "expected one word of 16 to 4096 characters"),
    ("", "got 0 character(s)"),
])
def test_a_weak_or_malformed_secret_is_refused_without_quoting_it(tmp_path, text, expected):
    path = tmp_path / "secret"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        read_secret(path, {})
    assert expected in str(caught.value) and (not text or text not in str(caught.value))


def test_no_secret_at_all_says_where_one_comes_from():
    with pytest.raises(ConfigError, match="the job secret is needed .* LIGHTNING_ELASTIC_SECRET .* openssl rand -hex 32"):
        read_secret(None, {})


def test_a_missing_driver_option_is_argparses_one_line(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["agent"], {})
    assert caught.value.code == 2
    assert "the following arguments are required: --driver" in capsys.readouterr().err


@pytest.mark.parametrize("extra, expected", [
    ([], "--agents: needs --port (the one port the agents connect to, e.g. --port 29400)"),
    (["--port", "29400"], "--agents: needs --driver-address or --network-interface"),
])
def test_launch_agents_needs_a_place_to_be_reached_at(extra, expected, secret_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    args = parse_args(["launch", "--agents", "--secret-file", str(secret_file), "-np", "2", *extra, "train.py"], {})
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        config_from_args(args)


def test_launch_agents_needs_np_and_a_secret_file_only_with_agents(secret_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    with pytest.raises(ConfigError, match="-np: required with --agents"):
        config_from_args(parse_args(["launch", "--agents", "--secret-file", str(secret_file), "train.py"], {}))
    with pytest.raises(ConfigError, match="--secret-file: only with --agents"):
        config_from_args(parse_args(["launch", "--secret-file", str(secret_file), "train.py"], {}))
    config = config_from_args(parse_args(["launch", "--agents", "--secret-file", str(secret_file), "-np", "2",
                                          "--port", "29400", "--driver-address", "127.0.0.1", "train.py"], {}))
    assert config.agents is not None and config.agents.secret == SECRET and SECRET not in repr(config)


def test_launch_agents_takes_preload(secret_file, tmp_path, monkeypatch):
    # An agent's host gets its fork server through its agent (launcher/driver/launch.py).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    config = config_from_args(parse_args(["launch", "--agents", "--secret-file", str(secret_file), "-np", "2",
                                          "--port", "29400", "--driver-address", "127.0.0.1", "--preload", "torch",
                                          "python", "train.py"], {}))
    assert config.agents is not None and config.preload == ("torch",)


def test_launch_agents_with_a_state_dir_is_accepted(secret_file, tmp_path, monkeypatch):
    """A driver restarted with --state-dir adopts the workers its agents kept (issue 36)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    config = config_from_args(parse_args(["launch", "--agents", "--secret-file", str(secret_file), "-np", "2",
                                          "--port", "29400", "--driver-address", "127.0.0.1", "--state-dir", "sd",
                                          "train.py"], {}))
    assert config.agents is not None and config.state_dir is not None
