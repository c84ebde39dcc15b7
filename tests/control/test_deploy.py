"""deploy/kubernetes: every manifest validates against the Kubernetes schemas that
kubernetes-validate ships (no network), and the pieces agree with each other and with the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
# The oldest Kubernetes we document support for, and the newest schemas in the pinned package.
VERSIONS = ("1.29.0", "1.37.0")


def documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return out


DOCS = documents()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("name", "doc"), DOCS, ids=[n for n, _ in DOCS])
def test_manifest_is_valid(name: str, doc: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{name} is not valid for Kubernetes {version}: {exc.message} at "
                    f"{'/'.join(str(p) for p in exc.path)}")


def test_schema_validation_rejects_a_bad_manifest() -> None:
    """The check above can fail: a misspelt field is an error in strict mode."""
    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"clusterIp": "None"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


def by_kind(kind: str, name: str) -> dict[str, Any]:
    for _, doc in DOCS:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind}/{name} in deploy/kubernetes")


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    files = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def test_pieces_agree() -> None:
    service = by_kind("Service", "aenv-node")
    assert service["spec"]["clusterIP"] == "None"  # headless: one endpoint per node pod
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]  # discovery.py reads "http"
    node = by_kind("DaemonSet", "aenv-node")["spec"]["template"]["spec"]
    assert node["hostNetwork"] and node["containers"][0]["securityContext"]["privileged"]
    assert {"path": "/var/lib/aenv", "type": "DirectoryOrCreate"} in [
        v["hostPath"] for v in node["volumes"]]
    scheduler = by_kind("Deployment", "aenv-scheduler")["spec"]["template"]["spec"]
    args = scheduler["containers"][0]["args"]
    assert args[args.index("--k8s-service") + 1] == "aenv/aenv-node"
    role = by_kind("Role", "aenv-scheduler-endpointslices")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = by_kind("RoleBinding", "aenv-scheduler-endpointslices")
    assert binding["subjects"][0]["name"] == scheduler["serviceAccountName"]


@pytest.mark.parametrize(("kind", "name"), [("Deployment", "aenv-scheduler"),
                                            ("DaemonSet", "aenv-node"),
                                            ("Deployment", "aenv-gateway")])
def test_container_commands_parse(kind: str, name: str) -> None:
    from agentenv.cli.main import cli

    container = by_kind(kind, name)["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[0] == "aenv"
    if command[1] not in cli.commands:
        pytest.skip(f"`aenv {command[1]}` is not in this build")
    sub = cli.commands[command[1]]
    try:
        sub.make_context(command[1], list(container["args"]))
    except click.UsageError as exc:
        pytest.fail(f"{kind}/{name}: `aenv {command[1]}` rejects its args: {exc}")


def test_containerfile_installs_the_project() -> None:
    text = (DEPLOY / "Containerfile").read_text()
    assert "scripts/install-system.sh" in text and "pip install" in text
