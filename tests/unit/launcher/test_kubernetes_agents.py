"""examples/kubernetes/agents.yaml: valid Kubernetes objects (checked by kubernetes-validate
against the API's own schemas, offline), commands the CLI accepts, and the README's section
naming exactly the objects the file creates."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from lightning_elastic.launcher.cli import agent_settings, config_from_args, parse_args

REPO = Path(__file__).resolve().parents[3]
MANIFEST = REPO / "examples" / "kubernetes" / "agents.yaml"
README = REPO / "README.md"
KUBERNETES_VERSION = "1.30"  # the oldest release still supported upstream when this was written


def objects() -> list[dict]:
    return [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]


@pytest.mark.parametrize("obj", objects(), ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_every_object_is_valid_against_the_kubernetes_schema(obj: dict) -> None:
    # strict: a field the API does not know (a typo) fails too.
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_validator_is_real() -> None:
    broken = {**objects()[-1], "spec": {**objects()[-1]["spec"], "replicas": "four"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def by_kind() -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects()}


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def test_the_driver_accepts_agents_on_the_services_port_with_the_mounted_secret(tmp_path, monkeypatch) -> None:
    found = by_kind()
    driver = container(found[("Deployment", "elastic-driver")])
    assert driver["command"] == ["lightning-elastic"]  # exec form: SIGTERM reaches the driver
    args = driver["args"]
    service = found[("Service", "elastic-driver")]
    assert service["spec"]["selector"] == found[("Deployment", "elastic-driver")]["spec"]["template"]["metadata"]["labels"]
    assert [p["port"] for p in service["spec"]["ports"]] == [int(args[args.index("--port") + 1])]
    # The launcher's own parser accepts the arguments (the mounted secret and the pod's
    # address stood in for by this machine's).
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123\n")
    given = [str(secret) if a == "/etc/elastic/secret" else "127.0.0.1" if a == "$(POD_IP)" else a for a in args]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    config = config_from_args(parse_args(given, {}))
    assert config.agents is not None and config.hosts is None and (config.np, config.min_np, config.max_np) == (4, 2, 8)
    assert config.driver_address == "127.0.0.1" and config.port == 29400
    # --state-dir on the volume the agents' pods mount at the same path: their workers read
    # the restarted driver's address from its driver-url file there (a new pod, a new IP).
    assert config.state_dir is not None and str(config.state_dir).startswith("/snapshots/")
    agents = container(found[("Deployment", "elastic-agents")])
    assert {"name": "snapshots", "mountPath": "/snapshots"} in [
        {k: m[k] for k in ("name", "mountPath")} for m in agents["volumeMounts"]]


def test_the_agents_are_pods_of_a_deployment_sized_as_the_job_that_leave_gracefully(tmp_path) -> None:
    found = by_kind()
    agents = found[("Deployment", "elastic-agents")]
    pod = agents["spec"]["template"]["spec"]
    agent = container(agents)
    assert agent["command"] == ["lightning-elastic"] and agent["args"][0] == "agent"  # no shell: SIGTERM reaches it
    driver_args = container(found[("Deployment", "elastic-driver")])["args"]
    assert agents["spec"]["replicas"] == int(driver_args[driver_args.index("-np") + 1])  # replicas = the job's size
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123\n")
    args = parse_args([str(secret) if a == "/etc/elastic/secret" else a for a in agent["args"]], {})
    settings = agent_settings(args)
    assert (settings.driver_host, settings.driver_port) == ("elastic-driver", 29400)
    # The grace period covers a graceful leave: --leave-timeout, then the agent's own stop
    # of its workers (SIGTERM, SIGKILL 5 s later), with room to spare.
    assert pod["terminationGracePeriodSeconds"] >= settings.leave_timeout + 5 + 10
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    assert str(args.secret_file).startswith(str(tmp_path)) and mounts["job-secret"] == "/etc/elastic"
    assert found[("Secret", "elastic-job-secret")]["metadata"]["name"] == pod["volumes"][0]["secret"]["secretName"]


def readme_section(title: str) -> str:
    text = README.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.M | re.S)
    assert match, f"README has no section {title!r}"
    return match.group(1)


def test_the_readme_section_names_exactly_the_objects_the_manifest_creates() -> None:
    section = readme_section("Running on Kubernetes")
    named = set(re.findall(r"`(Secret|PersistentVolumeClaim|Deployment|Service)/([a-z0-9-]+)`", section))
    assert named == set(by_kind())
