"""examples/kubernetes/driver-deployment.yaml: a Deployment the driver can be restarted in,
whose launch arguments the launcher accepts.

PyYAML is not among the test dependencies: the manifest is read by a small parser of the
block-style subset it is written in (maps, lists, quoted or plain scalars, one-line flow
lists), which fails on anything else, so the check cannot pass on a file it misreads.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from lightning_elastic.launcher.cli import parse_args

MANIFEST = Path(__file__).resolve().parents[3] / "examples" / "kubernetes" / "driver-deployment.yaml"


def _scalar(text: str) -> Any:
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        return [_scalar(part) for part in text[1:-1].split(",") if part.strip()]
    if text.startswith('"'):
        return ast.literal_eval(text)
    if re.fullmatch(r"-?\d+", text):
        return int(text, 8) if text.startswith("0") and len(text) > 1 else int(text)
    if text in ("true", "false"):
        return text == "true"
    assert not text.startswith(("'", "{", "&", "*", "|", ">")), f"outside the parsed subset: {text}"
    return text


def _lines(text: str) -> list[tuple[int, str]]:
    out = []
    for raw in text.splitlines():
        line = re.split(r"(?:^|\s)#", raw)[0]  # no value of the manifest holds " #"
        if line.strip():
            out.append((len(line) - len(line.lstrip()), line.strip()))
    return out


def _block(lines: list[tuple[int, str]], i: int, indent: int) -> tuple[Any, int]:
    """The map or list whose lines start at ``indent``, from line ``i``."""
    if lines[i][1].startswith("- "):
        items = []
        while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("- "):
            rest = lines[i][1][2:]
            if re.match(r"[\w.-]+:(\s|$)", rest):  # a map as a list item
                lines[i] = (indent + 2, rest)
                item, i = _block(lines, i, indent + 2)
            else:
                item, i = _scalar(rest), i + 1
            items.append(item)
        return items, i
    mapping: dict[str, Any] = {}
    while i < len(lines) and lines[i][0] == indent:
        key, sep, value = lines[i][1].partition(":")
        assert sep and key not in mapping, f"not a new key: {lines[i][1]}"
        i += 1
        if value.strip():
            mapping[key] = _scalar(value)
        else:
            assert i < len(lines) and lines[i][0] >= indent, f"{key}: no value"
            child_indent = lines[i][0]
            mapping[key], i = _block(lines, i, child_indent)
    return mapping, i


def load_all(text: str) -> list[dict[str, Any]]:
    docs = []
    for part in re.split(r"^---\s*$", text, flags=re.M):
        lines = _lines(part)
        if lines:
            doc, end = _block(lines, 0, lines[0][0])
            assert end == len(lines), f"unparsed from: {lines[end]}"
            docs.append(doc)
    return docs


def test_the_driver_deployment_restarts_one_driver_on_a_persistent_state_dir() -> None:
    claim, deployment = load_all(MANIFEST.read_text())
    assert claim["kind"] == "PersistentVolumeClaim"
    assert deployment["kind"] == "Deployment"
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}  # never two drivers at once
    pod = spec["template"]["spec"]
    assert 10 <= pod["terminationGracePeriodSeconds"] <= 120
    (container,) = pod["containers"]
    assert container["command"] == ["lightning-elastic"]

    args = parse_args(container["args"], {})  # the launcher's own parser accepts them
    assert args.state_dir is not None and args.host_discovery_script is not None
    mounts = {m["name"]: Path(m["mountPath"]) for m in container["volumeMounts"]}
    assert args.state_dir.is_relative_to(mounts["state"])  # on the persistent volume
    assert args.host_discovery_script.is_relative_to(mounts["discovery"])
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["state"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert volumes["discovery"]["configMap"]["defaultMode"] == 0o755
