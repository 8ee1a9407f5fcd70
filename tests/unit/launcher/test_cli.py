"""launcher/cli.py: argv -> LaunchConfig; invalid input exits 2 with one error line.

Every argv given to ``main`` here is invalid, so ``launch`` is never reached; valid argv
are checked through ``config_from_args`` only, which builds the config without launching.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

import pytest

from lightning_elastic.launcher import cli
from lightning_elastic.launcher.config import RaySettings, SshSettings
from lightning_elastic.launcher.errors import ConfigError
from lightning_elastic.launcher.job.slots import HostSlots


@pytest.fixture(autouse=True)
def keep_root_logging():
    # main() calls logging.basicConfig(); leave the root logger as it was.
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(autouse=True)
def python_on_path(monkeypatch):
    # The commands below name "python": found on PATH as a worker would find it, here too.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


@pytest.fixture
def no_launch(monkeypatch):
    # A safety net, not a mock of behaviour under test: if validation wrongly let argv
    # through, the test fails instead of starting real workers.
    def refuse(config, *args, **kwargs):
        raise AssertionError(f"launch() reached with {config}")

    monkeypatch.setattr(cli, "launch", refuse)


def parse(*argv: str, environ: dict[str, str] | None = None):
    return cli.config_from_args(cli.parse_args(["launch", *argv], environ or {}))


def run_main(capsys, *argv: str, environ: dict[str, str] | None = None) -> tuple[int, list[str]]:
    try:
        code = cli.main(["launch", *argv], environ or {})
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    assert captured.out == ""
    return code, captured.err.strip().splitlines()


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\necho localhost:1\n")
    path.chmod(0o755)
    return path


# ----- valid argv ----------------------------------------------------------------------


def test_hosts_give_np_and_bounds_defaults():
    c = parse("-H", "127.0.0.1:2,127.0.0.2:1", "python", "train.py", "--lr", "0.1")
    assert c.hosts == (HostSlots("127.0.0.1", 2), HostSlots("127.0.0.2", 1))
    assert (c.np, c.min_np, c.max_np) == (3, 3, 3)
    assert c.command == ("python", "train.py", "--lr", "0.1")
    assert c.discovery_script is None


def test_no_host_source_means_localhost_with_np_slots():
    c = parse("-np", "3", "python", "t.py")
    assert c.hosts == (HostSlots("localhost", 3),)
    assert c.np == 3


def test_no_host_source_and_no_np_means_one_local_worker():
    c = parse("python", "t.py")
    assert c.hosts == (HostSlots("localhost", 1),) and c.np == 1


def test_every_option_reaches_the_config(tmp_path, script):
    c = parse(
        "-np", "2", "--min-np", "1", "--max-np", "4", "--host-discovery-script", str(script),
        "--slots-per-host", "2", "--elastic-timeout", "30", "--reset-limit", "3",
        "--blacklist-cooldown-range", "1", "8", "--discovery-interval", "0.5",
        "--log-dir", str(tmp_path / "logs"), "--verbose", "python", "t.py",
    )
    assert (c.np, c.min_np, c.max_np) == (2, 1, 4)
    assert c.discovery_script == script.absolute() and c.hosts is None
    assert c.slots_per_host == 2 and c.elastic_timeout == 30.0 and c.reset_limit == 3
    assert c.blacklist_cooldown == (1.0, 8.0) and c.discovery_interval == 0.5
    assert c.log_dir == tmp_path / "logs" and c.verbose is True


def test_every_bound_reaches_the_config():
    c = parse("-np", "1", "--heartbeat-timeout", "7", "--start-timeout", "900", "--collective-timeout", "45",
              "--exit-timeout", "12", "--preemption-grace", "20", "--repeated-error-limit", "5", "python")
    t = c.timeouts
    assert (t.heartbeat_timeout, t.worker_arrival, t.process_group, t.exit, t.preemption_grace) == (7, 900, 45, 12, 20)
    assert c.repeated_error_limit == 5


def test_bounds_default_to_values_that_suit_lightning():
    c = parse("-np", "1", "python")
    t = c.timeouts
    # Data preparation and a first compile before the Trainer joins; long collectives.
    assert (t.worker_arrival, t.process_group, t.exit, t.preemption_grace) == (600, 1800, 60, 30)
    assert c.repeated_error_limit == 3


def test_double_dash_before_the_command_is_dropped():
    assert parse("-np", "1", "--", "python", "-u", "t.py").command == ("python", "-u", "t.py")


COMMAND_OPTIONS = (
    # Prefixes of several launch options (--num-proc/--network-interface, --elastic-timeout/
    # --env/--exit-timeout, --driver-address/--discovery-*), of one, launch's own options
    # spelled out, and the top-level parser's.
    "--n", "96", "--e", "3", "--d", "x", "--ver", "-n", "--min-np", "1", "-np", "4", "-H", "h:1", "--hosts=a",
    "-x", "--verbose", "-h", "--help", "--version", "--",
)


def test_nothing_after_the_command_is_taken_by_the_launcher():
    c = parse("-np", "1", "-H", "127.0.0.1:1", "python", "train.py", *COMMAND_OPTIONS)
    assert c.command == ("python", "train.py", *COMMAND_OPTIONS)
    assert (c.np, c.min_np, c.verbose, [h.host for h in c.hosts]) == (1, 1, False, ["127.0.0.1"])
    # The environment's options are the launcher's whatever the command's arguments are.
    c = parse("python", "train.py", "--n", "2", environ={"LIGHTNING_ELASTIC_NUM_PROC": "3"})
    assert (c.np, c.command) == (3, ("python", "train.py", "--n", "2"))


def test_a_mistyped_option_is_refused_by_launch_naming_the_option_it_may_mean(capsys, no_launch):
    # Issue 37, item 10: --np was refused under the top-level usage, with no word of -np.
    code, lines = run_main(capsys, "--np", "2", "python", "train.py")
    assert code == 2 and lines[0].startswith("usage: lightning-elastic launch ")
    assert lines[-1] == "lightning-elastic launch: error: unrecognized arguments: --np (did you mean -np?)"
    code, lines = run_main(capsys, "--verbse", "--num_proc=2", "--nothing-like-it", "python", "train.py")
    assert lines[-1] == ("lightning-elastic launch: error: unrecognized arguments: --verbse (did you mean --verbose?) "
                         "--num_proc=2 (did you mean --num-proc?) --nothing-like-it")


def test_a_mistyped_timeline_option_is_refused_by_timeline(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["timeline", "logs", "--ouptut"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and lines[0].startswith("usage: lightning-elastic timeline ")
    assert lines[-1] == "lightning-elastic timeline: error: unrecognized arguments: --ouptut (did you mean --output?)"


def test_launch_options_after_the_command_go_to_it_with_a_hint(caplog):
    # Issue 37, item 10: `launch train.py -np 2` gave -np to the script without a word.
    with caplog.at_level(logging.INFO, logger="lightning_elastic.cli"):
        c = parse("-np", "1", "python", "train.py", "-np", "2", "--lr", "0.1", "--log-dir=x")
    assert c.command == ("python", "train.py", "-np", "2", "--lr", "0.1", "--log-dir=x") and c.np == 1
    assert caplog.messages == ["Passing -np --log-dir=x to the command, as everything after it: if they are meant "
                               "for launch, put them before the command (-- before the command silences this)."]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lightning_elastic.cli"):
        parse("-np", "1", "--", "python", "train.py", "--verbose")  # the user said where the command starts
        parse("-np", "1", "python", "train.py", "--lr", "0.1")
    assert caplog.messages == []


def test_a_job_without_min_np_says_it_is_not_elastic_below_np(caplog):
    with caplog.at_level(logging.INFO, logger="lightning_elastic.cli"):
        parse("-np", "2", "python", "train.py")
    assert caplog.messages == [
        "Not elastic below -np: without --min-np, training needs all 2 workers of -np (after a lost worker it waits, "
        "up to --elastic-timeout, for a replacement); pass --min-np to train on with fewer."]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lightning_elastic.cli"):
        parse("-np", "2", "--min-np", "2", "python", "train.py")  # said explicitly: nothing to add
        parse("-np", "2", "python", "train.py", environ={"LIGHTNING_ELASTIC_MIN_NP": "1"})
        parse("python", "train.py")  # one worker: nothing fewer to go on with
    assert caplog.messages == []


def test_a_launch_option_is_not_abbreviated():
    with pytest.raises(SystemExit):
        parse("--verb", "python", "t.py")


def test_slots_per_host_fills_in_missing_host_slot_counts():
    c = parse("-H", "a,b:3", "--slots-per-host", "2", "python", "t.py")
    assert c.hosts == (HostSlots("a", 2), HostSlots("b", 3))
    assert c.np == 5


def test_relative_discovery_script_is_made_absolute(script, monkeypatch):
    monkeypatch.chdir(script.parent)
    assert parse("-np", "1", "--host-discovery-script", script.name, "python").discovery_script == script


# ----- invalid argv: ConfigError, one line, status 2 -----------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-np", "2", "--min-np", "3", "python", "t.py"], "--min-np: must be between 1 and -np (2), got 3"),
        (["-np", "2", "--max-np", "1", "python", "t.py"], "--max-np: must be at least -np (2), got 1"),
        (["-np", "0", "python", "t.py"], "-np: must be at least 1, got 0"),
        (["-np", "1", "--elastic-timeout", "-1", "python"], "--elastic-timeout: must be positive, got -1.0"),
        (["-np", "1", "--discovery-interval", "0", "python"], "--discovery-interval: must be positive, got 0.0"),
        (["-np", "1", "--reset-limit", "-2", "python"], "--reset-limit: must be 0 or more, got -2"),
        (["-np", "1", "--blacklist-cooldown-range", "10", "5", "python"],
         "--blacklist-cooldown-range: expected 0 <= MIN <= MAX, got 10.0 5.0"),
        (["-np", "1", "--blacklist-cooldown-range", "-1", "5", "python"],
         "--blacklist-cooldown-range: expected 0 <= MIN <= MAX, got -1.0 5.0"),
        (["-np", "1"], "COMMAND: missing, expected the training command, e.g. python train.py"),
        (["-np", "1", "--"], "COMMAND: missing, expected the training command, e.g. python train.py"),
        (["-H", "a:1,a:2", "python"], "-H/--hosts: host 'a' is listed twice"),
        (["-H", "a:0", "python"], "-H/--hosts: slot count in 'a:0' must be at least 1, got 0"),
        (["-H", "a", "python"],
         "-H/--hosts: host entry 'a' has no slot count; write HOST:SLOTS or pass --slots-per-host"),
        (["-H", ",", "python"], "-H/--hosts: empty host list ',', expected HOST:SLOTS[,HOST:SLOTS...]"),
        (["-H", "a:1;b:1", "python"],  # issue 37, item 10: was taken as one host named "a:1;b"
         "-H/--hosts: 'a:1;b:1' separates hosts with ';': expected commas, HOST:SLOTS[,HOST:SLOTS...] (-H a:1,b:1)"),
        (["-H", "a:1 b:2", "python"],
         "-H/--hosts: 'a:1 b:2' separates hosts with ' ': expected commas, HOST:SLOTS[,HOST:SLOTS...] (-H a:1,b:2)"),
        (["-H", "a:1", "--slots-per-host", "0", "python"], "--slots-per-host: must be at least 1, got 0"),
        (["-np", "1", "--start-timeout", "0", "python"],
         "--start-timeout: expected a positive, finite number of seconds, got 0.0"),
        (["-np", "1", "--collective-timeout", "nan", "python"],
         "--collective-timeout: expected a positive, finite number of seconds, got nan"),
        (["-np", "1", "--exit-timeout", "inf", "python"],
         "--exit-timeout: expected a positive, finite number of seconds, got inf"),
        (["-np", "1", "--preemption-grace", "-5", "python"],
         "--preemption-grace: expected a positive, finite number of seconds, got -5.0"),
        (["-np", "1", "--repeated-error-limit", "-1", "python"],
         "--repeated-error-limit: must be 0 (off) or more, got -1"),
    ],
)
def test_invalid_values_exit_2_with_one_line(capsys, no_launch, argv, message):
    code, lines = run_main(capsys, *argv)
    assert code == 2
    assert lines == [f"lightning-elastic: error: {message}"]


def test_discovery_script_requires_np(capsys, no_launch, script):
    code, lines = run_main(capsys, "--host-discovery-script", str(script), "python")
    assert code == 2
    assert lines == ["lightning-elastic: error: -np: required with --host-discovery-script"]


def test_non_executable_discovery_script_is_refused(capsys, no_launch, tmp_path):
    path = tmp_path / "hosts.txt"
    path.write_text("localhost:1\n")
    code, lines = run_main(capsys, "-np", "1", "--host-discovery-script", str(path), "python")
    assert code == 2
    assert lines == [f"lightning-elastic: error: --host-discovery-script: {path} is not an executable file"]


def test_missing_discovery_script_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--host-discovery-script: .*nope.sh is not an executable file"):
        parse("-np", "1", "--host-discovery-script", str(tmp_path / "nope.sh"), "python")


# ----- invalid argv caught by argparse: status 2, the last line names the option --------
# (argparse prints its usage block first; the error itself is the final line)


def test_both_host_sources_are_refused(capsys, no_launch, script):
    code, lines = run_main(capsys, "-H", "a:1", "--host-discovery-script", str(script), "python")
    assert code == 2
    assert lines[-1] == (
        "lightning-elastic launch: error: argument --host-discovery-script: not allowed with argument -H/--hosts"
    )


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["-np", "two", "python"], "argument -np/--num-proc: invalid int value: 'two'"),
        (["-np", "1", "--elastic-timeout", "soon", "python"], "argument --elastic-timeout: invalid float value: 'soon'"),
        (["-np", "1", "--reset-limit", "1.5", "python"], "argument --reset-limit: invalid int value: '1.5'"),
        (["-np", "1", "--blacklist-cooldown-range", "1"], "argument --blacklist-cooldown-range: expected 2 arguments"),
    ],
)
def test_malformed_numbers_are_refused_naming_the_option(capsys, no_launch, argv, option):
    code, lines = run_main(capsys, *argv)
    assert code == 2
    assert lines[-1] == f"lightning-elastic launch: error: {option}"


def test_missing_verb_is_refused(capsys, no_launch):
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    assert "required: verb" in capsys.readouterr().err


# ----- multiple machines: ssh, -x/--env, heartbeat, driver address ----------------------


def test_multi_machine_defaults():
    c = parse("python", "t.py")
    assert c.ssh == SshSettings()
    assert c.env == ()
    assert (c.driver_address, c.network_interface) == (None, None)
    assert c.timeouts.heartbeat_timeout == 10.0


def test_ssh_options_reach_the_config(tmp_path):
    key = tmp_path / "id_ed25519"
    key.write_text("key")
    c = parse("-H", "node1:1,node2:1", "--ssh-port", "2222", "--ssh-identity-file", str(key),
              "--ssh-option", "StrictHostKeyChecking=no", "--ssh-option", "UserKnownHostsFile=/dev/null",
              "python", "t.py")
    assert c.ssh == SshSettings(
        port=2222, identity_file=key, options=("StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null")
    )


def test_heartbeat_timeout_reaches_the_config():
    assert parse("--heartbeat-timeout", "10", "python").timeouts.heartbeat_timeout == 10.0
    assert parse("--heartbeat-timeout", "2.5", "python").timeouts.heartbeat_timeout == 2.5


def test_driver_address_and_interface_reach_the_config():
    c = parse("--driver-address", "127.0.0.1", "--network-interface", "lo", "python")  # checked: this machine's
    assert (c.driver_address, c.network_interface) == ("127.0.0.1", "lo")


def test_env_name_value_is_kept_as_given():
    c = parse("-x", "FOO=bar", "--env", "EMPTY=", "-x", "EQ=a=b", "python")
    assert c.env == (("FOO", "bar"), ("EMPTY", ""), ("EQ", "a=b"))


def test_env_name_alone_takes_the_drivers_value(monkeypatch):
    monkeypatch.setenv("LE_TEST_FROM_DRIVER", "driver value")
    monkeypatch.setenv("LE_TEST_EMPTY", "")
    c = parse("-x", "LE_TEST_FROM_DRIVER", "-x", "LE_TEST_EMPTY", "python")
    assert c.env == (("LE_TEST_FROM_DRIVER", "driver value"), ("LE_TEST_EMPTY", ""))


def test_env_name_that_is_not_set_on_the_driver_is_refused(capsys, no_launch, monkeypatch):
    monkeypatch.delenv("LE_TEST_UNSET", raising=False)
    code, lines = run_main(capsys, "-x", "LE_TEST_UNSET", "python")
    assert code == 2
    assert lines == [
        "lightning-elastic: error: -x/--env: LE_TEST_UNSET is not set in the driver's environment; "
        "write LE_TEST_UNSET=VALUE"
    ]


def test_env_name_not_set_raises_config_error(monkeypatch):
    monkeypatch.delenv("LE_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError, match=r"^-x/--env: LE_TEST_UNSET is not set"):
        parse("-x", "LE_TEST_UNSET", "python")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ssh-port", "0", "python"], "--ssh-port: expected a port number 1..65535, got 0"),
        (["--ssh-port", "70000", "python"], "--ssh-port: expected a port number 1..65535, got 70000"),
        (["--ssh-option", "StrictHostKeyChecking", "python"],
         "--ssh-option: expected NAME=VALUE as ssh's -o takes it, got 'StrictHostKeyChecking'"),
        (["--heartbeat-timeout", "nan", "python"],
         "--heartbeat-timeout: expected a finite number of seconds, at least twice the heartbeat interval (2), "
         "got nan"),
        (["--heartbeat-timeout", "inf", "python"],
         "--heartbeat-timeout: expected a finite number of seconds, at least twice the heartbeat interval (2), "
         "got inf"),
        (["--heartbeat-timeout", "1.5", "python"],
         "--heartbeat-timeout: expected a finite number of seconds, at least twice the heartbeat interval (2), "
         "got 1.5"),
        (["-x", "1BAD=2", "python"], "-x/--env: '1BAD' is not a valid variable name"),
        (["-x", "MY-VAR=2", "python"], "-x/--env: 'MY-VAR' is not a valid variable name"),
    ],
)
def test_invalid_multi_machine_values_exit_2_with_one_line(capsys, no_launch, argv, message):
    code, lines = run_main(capsys, "-np", "1", *argv)
    assert code == 2
    assert lines == [f"lightning-elastic: error: {message}"]


def test_missing_identity_file_exits_2_naming_the_option(capsys, no_launch, tmp_path):
    path = tmp_path / "no_key"
    code, lines = run_main(capsys, "--ssh-identity-file", str(path), "python")
    assert code == 2
    assert lines == [f"lightning-elastic: error: --ssh-identity-file: {path} is not a readable file"]


def test_malformed_ssh_port_is_refused_by_argparse(capsys, no_launch):
    code, lines = run_main(capsys, "--ssh-port", "ssh", "python")
    assert code == 2
    assert lines[-1] == "lightning-elastic launch: error: argument --ssh-port: invalid int value: 'ssh'"


# ----- --ray -------------------------------------------------------------------------------


def test_ray_options_reach_the_config():
    pytest.importorskip("ray")
    c = parse("--ray", "10.0.0.1:6379", "-np", "2", "--max-np", "8", "--cpus-per-worker", "2", "--gpus-per-worker",
              "1", "python", "train.py")
    assert c.ray == RaySettings(address="10.0.0.1:6379", cpus_per_worker=2.0, gpus_per_worker=1.0)
    assert c.hosts is None and c.discovery_script is None
    assert (c.np, c.min_np, c.max_np) == (2, 2, 8)


def test_ray_defaults_one_cpu_and_no_gpu_per_worker():
    pytest.importorskip("ray")
    assert parse("--ray", "auto", "-np", "1", "python").ray == RaySettings("auto", 1.0, 0.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ray", "auto", "python"], "-np: required with --ray"),
        (["-np", "1", "--cpus-per-worker", "2", "python"], "--cpus-per-worker: only with --ray"),
        (["-np", "1", "--gpus-per-worker", "1", "python"], "--gpus-per-worker: only with --ray"),
        (["--ray", "auto", "-np", "1", "--cpus-per-worker", "-1", "python"],
         "--cpus-per-worker: expected a number of 0 or more, got -1.0"),
        (["--ray", "auto", "-np", "1", "--gpus-per-worker", "nan", "python"],
         "--gpus-per-worker: expected a number of 0 or more, got nan"),
        (["--ray", "auto", "-np", "1", "--cpus-per-worker", "0", "python"],
         "--cpus-per-worker, --gpus-per-worker: a worker must need some CPU or GPU, both are 0"),
        (["--ray", " ", "-np", "1", "python"],
         "--ray: expected auto, local or the cluster's HOST:PORT, got an empty address"),
    ],
)
def test_invalid_ray_values_exit_2_with_one_line(capsys, no_launch, argv, message):
    pytest.importorskip("ray")
    code, lines = run_main(capsys, *argv)
    assert code == 2
    assert lines == [f"lightning-elastic: error: {message}"]


def test_ray_without_the_extra_says_how_to_install_it(capsys, no_launch, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what an install without Ray imports: nothing
    code, lines = run_main(capsys, "--ray", "auto", "-np", "2", "python", "train.py")
    assert code == 2
    assert lines == ["lightning-elastic: error: --ray: Ray is not installed; "
                     "install the extra with pip install 'lightning-elastic[ray]'"]


def test_unreachable_ray_cluster_exits_2_naming_the_address(capsys):
    pytest.importorskip("ray")
    code, lines = run_main(capsys, "--ray", "127.0.0.1:9", "-np", "1", "python", "train.py")
    assert code == 2
    assert lines == ["lightning-elastic: error: --ray: cannot connect to the Ray cluster at 127.0.0.1:9: Connection refused"]


def test_ray_address_without_a_port_is_refused(capsys):
    pytest.importorskip("ray")
    code, lines = run_main(capsys, "--ray", "headnode", "-np", "1", "python", "train.py")
    assert code == 2
    assert lines == ["lightning-elastic: error: --ray: expected auto, local or the cluster's HOST:PORT, got 'headnode'"]


def test_ray_auto_without_a_cluster_says_what_to_do(capsys, monkeypatch):
    pytest.importorskip("ray")
    from ray._private.services import find_gcs_addresses

    if find_gcs_addresses():  # "auto" finds a cluster by its processes on this machine
        pytest.skip("a Ray cluster runs on this machine")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, lines = run_main(capsys, "--ray", "auto", "-np", "1", "python", "train.py")
    assert code == 2
    assert lines == ["lightning-elastic: error: --ray auto: no running Ray cluster found from this machine; start "
                     "one (ray start --head), give its HOST:PORT, or use --ray local"]


# ----- --version, --hostfile, --port, --stop-grace, --discovery-timeout -------------------


def test_version_is_printed_and_exits_0(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"], {})
    assert info.value.code == 0
    assert capsys.readouterr().out == "lightning-elastic 0.1.0\n"


def test_new_bounds_and_port_reach_the_config():
    c = parse("--stop-grace", "12", "--discovery-timeout", "90", "--port", "29500", "python")
    assert (c.timeouts.stop_grace, c.timeouts.discovery, c.port) == (12.0, 90.0, 29500)


def test_new_bounds_default_to_the_old_constants():
    c = parse("python")
    assert (c.timeouts.stop_grace, c.timeouts.discovery, c.port) == (5.0, 30.0, None)
    assert c.timeouts.lost_member_wait == 5.0


def test_error_wait_is_an_option_and_bounded(capsys, no_launch):
    assert parse("--error-wait", "0.5", "python").timeouts.lost_member_wait == 0.5
    assert parse("python", environ={"LIGHTNING_ELASTIC_ERROR_WAIT": "2"}).timeouts.lost_member_wait == 2.0
    for value, expected in (("0", "expected a positive, finite number of seconds, got 0.0"),
                            ("61", "expected at most 60 seconds, got 61.0")):
        code, lines = run_main(capsys, "--error-wait", value, "python")
        assert (code, lines[-1]) == (2, f"lightning-elastic: error: --error-wait: {expected}")


def test_hostfile_in_mpirun_and_horovod_forms_is_a_fixed_host_list(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the cluster\nnode1 slots=4\nnode2 slots=2 max_slots=8  # mpirun's bound, ignored\n\n"
                        "node3:1\nnode4\n")
    c = parse("--hostfile", str(hostfile), "--slots-per-host", "3", "python")
    assert c.hosts == (HostSlots("node1", 4), HostSlots("node2", 2), HostSlots("node3", 1), HostSlots("node4", 3))
    assert c.np == 10 and c.discovery_script is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node1 slots=4\nnode2 slots 4\n",
         "--hostfile {path} line 2: invalid entry 'node2 slots 4', expected HOST slots=N or HOST:SLOTS"),
        ("node1:2 slots=4\n", "--hostfile {path} line 1: invalid entry 'node1:2 slots=4', expected HOST slots=N or HOST:SLOTS"),
        ("node1 slots=0\n", "--hostfile {path} line 1: slot count in 'node1:0' must be at least 1, got 0"),
        ("node1\n", "--hostfile {path} line 1: host entry 'node1' has no slot count; write HOST:SLOTS or pass "
                    "--slots-per-host"),
        ("# nothing\n\n", "--hostfile {path}: lists no host, expected one HOST slots=N (or HOST:SLOTS) a line"),
        ("a slots=1\na slots=2\n", "--hostfile {path}: host 'a' is listed twice"),
    ],
)
def test_invalid_hostfile_exits_2_naming_the_file_and_line(capsys, no_launch, tmp_path, text, message):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(text)
    code, lines = run_main(capsys, "--hostfile", str(hostfile), "python")
    assert (code, lines) == (2, [f"lightning-elastic: error: {message.format(path=hostfile)}"])


def test_missing_hostfile_exits_2(capsys, no_launch, tmp_path):
    code, lines = run_main(capsys, "--hostfile", str(tmp_path / "nope"), "python")
    assert (code, lines) == (2, [f"lightning-elastic: error: --hostfile: {tmp_path / 'nope'}: No such file or directory"])


def test_hostfile_with_another_host_source_is_refused_by_argparse(capsys, no_launch, tmp_path):
    code, lines = run_main(capsys, "--hostfile", str(tmp_path), "-H", "a:1", "python")
    assert code == 2
    assert lines[-1] == "lightning-elastic launch: error: argument -H/--hosts: not allowed with argument --hostfile"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "0"], "--port: expected a port number 1..65535, got 0"),
        (["--port", "65536"], "--port: expected a port number 1..65535, got 65536"),
        (["--stop-grace", "0"], "--stop-grace: expected a positive, finite number of seconds, got 0.0"),
        (["--stop-grace", "inf"], "--stop-grace: expected a positive, finite number of seconds, got inf"),
        (["--discovery-timeout", "-1"], "--discovery-timeout: expected a positive, finite number of seconds, got -1.0"),
        (["--discovery-timeout", "nan"], "--discovery-timeout: expected a positive, finite number of seconds, got nan"),
    ],
)
def test_invalid_new_values_exit_2_with_one_line(capsys, no_launch, argv, message):
    code, lines = run_main(capsys, *argv, "python")
    assert (code, lines) == (2, [f"lightning-elastic: error: {message}"])


# ----- the command -------------------------------------------------------------------------


def test_a_py_command_runs_with_this_python(tmp_path, monkeypatch, caplog):
    (tmp_path / "train.py").write_text("print('hi')\n")  # not executable, no shebang
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO, logger="lightning_elastic.cli"):
        c = parse("-np", "2", "--min-np", "1", "train.py", "--lr", "0.1")
    assert c.command == (sys.executable, "train.py", "--lr", "0.1")
    assert caplog.messages == [f"Running train.py with this Python, as torchrun does: {sys.executable} train.py."]


@pytest.mark.parametrize(
    ("setup", "command", "message"),
    [
        (None, "nosuch-program-xyz", "COMMAND: nosuch-program-xyz: no such program on PATH"),
        ("file", "run.sh", "COMMAND: run.sh: no such program on PATH (to run the file here, write ./run.sh)"),
        (None, "./run.sh", "COMMAND: ./run.sh: no such file"),
        ("dir", "./run.sh", "COMMAND: ./run.sh: is a directory, expected a program or a script"),
        ("file", "./run.sh", "COMMAND: ./run.sh: not executable (chmod +x it, or name its interpreter first)"),
        (None, "missing.py", "COMMAND: missing.py: no such file"),
    ],
)
def test_a_command_that_cannot_run_exits_2_before_anything_starts(capsys, no_launch, tmp_path, monkeypatch,
                                                                    setup, command, message):
    monkeypatch.chdir(tmp_path)
    if setup == "file":
        (tmp_path / "run.sh").write_text("echo hi\n")
    elif setup == "dir":
        (tmp_path / "run.sh").mkdir()
    code, lines = run_main(capsys, "-np", "1", command)
    assert (code, lines) == (2, [f"lightning-elastic: error: {message}"])


def test_an_executable_command_by_path_is_accepted(tmp_path, monkeypatch):
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    assert parse("./run.sh", "x").command == ("./run.sh", "x")


# ----- inputs checked before the driver runs ---------------------------------------------


def test_discovery_script_that_is_a_directory_is_refused(capsys, no_launch, tmp_path):
    code, lines = run_main(capsys, "-np", "1", "--host-discovery-script", str(tmp_path), "python")
    assert (code, lines) == (2, [f"lightning-elastic: error: --host-discovery-script: {tmp_path} is not an executable file"])


def test_log_dir_that_is_a_file_is_refused(capsys, no_launch, tmp_path):
    path = tmp_path / "afile"
    path.write_text("")
    code, lines = run_main(capsys, "--log-dir", str(path), "python")
    assert (code, lines) == (2, [f"lightning-elastic: error: --log-dir: {path} is a file, expected a directory"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--driver-address", "10.255.0.99"], "--driver-address: 10.255.0.99 is not an address of this machine"),
        (["--driver-address", "driver.example"], "--driver-address: expected an IPv4 address, got 'driver.example'"),
    ],
)
def test_driver_address_this_machine_has_not_exits_2_before_anything_starts(capsys, no_launch, argv, message):
    code, lines = run_main(capsys, *argv, "python")
    assert (code, lines) == (2, [f"lightning-elastic: error: {message}"])


def test_unknown_network_interface_exits_2_before_anything_starts(capsys, no_launch):
    code, lines = run_main(capsys, "--network-interface", "nosuch0", "python")
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith("lightning-elastic: error: --network-interface: 'nosuch0' has no IPv4 address here (")


# ----- LIGHTNING_ELASTIC_* -----------------------------------------------------------------


def test_every_launch_option_has_its_variable():
    names = cli.environment_options()
    assert names["LIGHTNING_ELASTIC_NUM_PROC"] == "-np/--num-proc"
    assert names["LIGHTNING_ELASTIC_MIN_NP"] == "--min-np"
    assert names["LIGHTNING_ELASTIC_SLOTS_PER_HOST"] == "--slots-per-host/--slots"
    assert names["LIGHTNING_ELASTIC_ENV"] == "-x/--env"
    dests = {a.dest for a in cli.launch_options(cli.build_parser())}
    assert len(names) == len(dests)  # one variable per option, none shared
    # None is a variable of the workers' with another meaning (the driver sets
    # LIGHTNING_ELASTIC_HEARTBEAT_TIMEOUT and _PREEMPTION_GRACE for its workers: the same values).
    assert not set(names) & {"LIGHTNING_ELASTIC_DRIVER_URL", "LIGHTNING_ELASTIC_SECRET_FD",
                             "LIGHTNING_ELASTIC_WORKER_ID", "LIGHTNING_ELASTIC_HOSTNAME",
                             "LIGHTNING_ELASTIC_HEARTBEAT_INTERVAL", "LIGHTNING_ELASTIC_CUDA_DEVICE",
                             "LIGHTNING_ELASTIC_LOST_MEMBER_WAIT", "LIGHTNING_ELASTIC_PROCESS_GROUP_TIMEOUT"}


def test_the_readme_cli_table_names_every_option_and_its_variable():
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    table = readme[readme.index("| option | meaning | default | environment |"):readme.index("**The timeline.**")]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    documented = {name for row in rows for name in re.findall(r"LIGHTNING_ELASTIC_\w+", row.split(" | ")[-1])}
    assert documented == set(cli.environment_options())
    options = " ".join(row.split(" | ")[0] for row in rows)
    for action in cli.launch_options(cli.build_parser()):
        assert any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", options) for o in action.option_strings), \
            f"README's CLI table has no row for {action.option_strings}"


def test_options_come_from_the_environment(tmp_path):
    key = tmp_path / "key"
    key.write_text("k")
    c = parse("python", environ={
        "LIGHTNING_ELASTIC_NUM_PROC": "2", "LIGHTNING_ELASTIC_MIN_NP": "1", "LIGHTNING_ELASTIC_MAX_NP": "4",
        "LIGHTNING_ELASTIC_HOSTS": "127.0.0.1:2,127.0.0.2:2", "LIGHTNING_ELASTIC_VERBOSE": "yes",
        "LIGHTNING_ELASTIC_ELASTIC_TIMEOUT": "30", "LIGHTNING_ELASTIC_BLACKLIST_COOLDOWN_RANGE": "1 8",
        "LIGHTNING_ELASTIC_ENV": "A=1 'B=two words'", "LIGHTNING_ELASTIC_SSH_OPTION": "StrictHostKeyChecking=no",
        "LIGHTNING_ELASTIC_SSH_IDENTITY_FILE": str(key), "LIGHTNING_ELASTIC_LOG_DIR": str(tmp_path / "logs"),
        "LIGHTNING_ELASTIC_STOP_GRACE": "9", "LIGHTNING_ELASTIC_PORT": "29500",
        "LIGHTNING_ELASTIC_UNRELATED": "ignored", "LIGHTNING_ELASTIC_REPEATED_ERROR_LIMIT": "",  # empty: unset
    })
    assert (c.np, c.min_np, c.max_np) == (2, 1, 4)
    assert c.hosts == (HostSlots("127.0.0.1", 2), HostSlots("127.0.0.2", 2))
    assert c.verbose is True and c.elastic_timeout == 30.0 and c.blacklist_cooldown == (1.0, 8.0)
    assert c.env == (("A", "1"), ("B", "two words"))
    assert c.ssh == SshSettings(identity_file=key, options=("StrictHostKeyChecking=no",))
    assert c.log_dir == tmp_path / "logs" and c.timeouts.stop_grace == 9.0 and c.port == 29500
    assert c.repeated_error_limit == 3


def test_the_command_line_wins_over_the_environment(script):
    environ = {"LIGHTNING_ELASTIC_MIN_NP": "1", "LIGHTNING_ELASTIC_ENV": "A=env", "LIGHTNING_ELASTIC_VERBOSE": "1",
               "LIGHTNING_ELASTIC_HOSTS": "a:1,b:1", "LIGHTNING_ELASTIC_DRIVER_ADDRESS": "127.0.0.1"}
    c = parse("-np", "3", "--min-np", "2", "-x", "A=cli", "--host-discovery-script", str(script),
              "--network-interface", "lo", "python", environ=environ)
    assert (c.np, c.min_np) == (3, 2)
    assert c.env == (("A", "cli"),)  # a repeatable option given replaces the variable's list
    assert c.discovery_script == script and c.hosts is None  # one source given: no source from the environment
    assert (c.driver_address, c.network_interface) == (None, "lo")
    assert c.verbose is True  # not given on the command line: the variable's


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"LIGHTNING_ELASTIC_NUM_PROC": "two"}, "LIGHTNING_ELASTIC_NUM_PROC (-np/--num-proc): invalid int value: 'two'"),
        ({"LIGHTNING_ELASTIC_VERBOSE": "maybe"},
         "LIGHTNING_ELASTIC_VERBOSE (--verbose): expected 1, true, yes or on (0, false, no or off), got 'maybe'"),
        ({"LIGHTNING_ELASTIC_BLACKLIST_COOLDOWN_RANGE": "5"},
         "LIGHTNING_ELASTIC_BLACKLIST_COOLDOWN_RANGE (--blacklist-cooldown-range): expected 2 values, got '5'"),
        ({"LIGHTNING_ELASTIC_ENV": "A='unclosed"}, "LIGHTNING_ELASTIC_ENV (-x/--env): No closing quotation, in \"A='unclosed\""),
        ({"LIGHTNING_ELASTIC_HOSTS": "a:1", "LIGHTNING_ELASTIC_RAY": "auto"},
         "LIGHTNING_ELASTIC_HOSTS, LIGHTNING_ELASTIC_RAY: give exactly one host source: -H/--hosts, --hostfile, "
         "--host-discovery-script, --ray or --slurm"),
        ({"LIGHTNING_ELASTIC_MIN_NP": "5"}, "--min-np: must be between 1 and -np (1), got 5"),
    ],
)
def test_invalid_variables_exit_2_with_one_line_naming_them(capsys, no_launch, environ, message):
    code, lines = run_main(capsys, "python", environ=environ)
    assert (code, lines) == (2, [f"lightning-elastic: error: {message}"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--snapshot-every", "5"], "--snapshot-every: only with --snapshot-dir"),
        (["--no-resume"], "--no-resume: only with --snapshot-dir"),
        (["--resume-other-command"], "--resume-other-command: only with --snapshot-dir"),
        (["--snapshot-dir", "{tmp}", "--no-resume", "--resume-other-command"],
         "--resume-other-command: not with --no-resume, which starts over"),
        (["--snapshot-dir", "{tmp}", "--snapshot-every", "0"],
         "--snapshot-every: expected a positive, finite number of seconds, got 0.0"),
        (["--snapshot-dir", "{tmp}", "--snapshot-keep", "0"],
         "--snapshot-keep: expected 1 or more snapshots to keep, got 0"),
        (["--snapshot-dir", "{tmp}/file"], "--snapshot-dir: {tmp}/file is a file, expected a directory"),
    ],
)
def test_invalid_snapshot_options_exit_2_with_one_line(capsys, no_launch, tmp_path, argv, message):
    (tmp_path / "file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, lines = run_main(capsys, "-np", "1", *argv, "python")
    assert code == 2
    assert lines == [f"lightning-elastic: error: {message.replace('{tmp}', str(tmp_path))}"]


def test_snapshot_options_come_from_the_command_line_or_the_environment(tmp_path):
    c = parse("-np", "1", "--snapshot-dir", str(tmp_path), "--snapshot-every", "2.5", "--no-resume", "python")
    assert c.snapshots is not None and c.snapshots.directory == tmp_path and c.snapshots.every == 2.5
    assert c.snapshots.keep == 2 and not c.snapshots.resume
    c = parse("-np", "1", "python", environ={"LIGHTNING_ELASTIC_SNAPSHOT_DIR": str(tmp_path),
                                             "LIGHTNING_ELASTIC_SNAPSHOT_KEEP": "4"})
    assert c.snapshots is not None and c.snapshots.keep == 4 and c.snapshots.resume
    assert parse("-np", "1", "python").snapshots is None
    c = parse("-np", "1", "--snapshot-dir", str(tmp_path), "python",
              environ={"LIGHTNING_ELASTIC_RESUME_OTHER_COMMAND": "1"})
    assert c.snapshots is not None and c.snapshots.resume_other_command and c.snapshots.resume


def test_a_snapshot_dir_that_cannot_be_created_exits_2_before_anything_starts(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "snapshots"
    code, lines = run_main(capsys, "-np", "1", "--snapshot-dir", str(target), "python", "-c", "pass")
    assert code == 2
    assert lines[-1] == f"lightning-elastic: error: --snapshot-dir: cannot create {target}: Not a directory"


def test_preload_names_modules_separated_by_commas_on_the_line_or_in_the_environment():
    assert parse("-np", "2", "--preload", "torch, lightning.pytorch", "python", "t.py").preload == \
        ("torch", "lightning.pytorch")
    assert parse("-np", "2", "python", "t.py", environ={"LIGHTNING_ELASTIC_PRELOAD": "torch"}).preload == ("torch",)
    assert parse("-np", "2", "python", "t.py").preload == ()
