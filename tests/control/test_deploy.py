"""deploy/kubernetes: every manifest validates against the Kubernetes schemas that
kubernetes-validate ships (no network), and the pieces agree with each other and with the CLI."""

from __future__ import annotations

import json
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
        v["hostPath"] for v in node["volumes"] if "hostPath" in v]
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


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def pod_spec(kind: str, name: str) -> dict[str, Any]:
    return by_kind(kind, name)["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def test_redis_wants_a_password_per_component() -> None:
    """No `--protected-mode no` Redis: the ACL file of scripts/redis-acl.sh (default user off),
    written from the Secret aenv-redis; the gateway and the scheduler log in as their users with
    their password files; every component takes the cluster secret from one Secret."""
    redis = pod_spec("StatefulSet", "aenv-redis")
    args = redis["containers"][0]["args"]
    assert "--protected-mode" not in args
    acl = args[args.index("--aclfile") + 1]
    (init,) = redis["initContainers"]
    script = " ".join(init["command"])
    assert "scripts/redis-acl.sh" in script and script.endswith(f">{acl}")
    assert (DEPLOY.parents[1] / "scripts" / "redis-acl.sh").is_file()
    secrets = {v["name"]: v["secret"] for v in redis["volumes"] if "secret" in v}
    assert secrets["passwords"]["secretName"] == "aenv-redis"
    for user, kind, name in (("gateway", "Deployment", "aenv-gateway"),
                             ("scheduler", "Deployment", "aenv-scheduler")):
        assert f"/run/secrets/aenv-redis/{user}-password" in script  # the ACL's password
        spec = pod_spec(kind, name)
        container = spec["containers"][0]
        env = env_of(container)
        assert env["AENV_REDIS_USER"] == user
        assert env["AENV_CLUSTER_SECRET"] == {"secretKeyRef": {"name": "aenv-cluster",
                                                               "key": "secret"}}
        mount = next(m for m in container["volumeMounts"]
                     if env["AENV_REDIS_PASSWORD_FILE"].startswith(m["mountPath"] + "/"))
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == "aenv-redis"
        assert [i["key"] for i in volume["secret"]["items"]] == [f"{user}-password"]
        assert env["AENV_REDIS_PASSWORD_FILE"].endswith(volume["secret"]["items"][0]["path"])
        # group-readable file, read by the pod's non-root user through fsGroup
        assert spec["securityContext"]["fsGroup"] == container["securityContext"]["runAsUser"]
    node_env = env_of(pod_spec("DaemonSet", "aenv-node")["containers"][0])
    assert "AENV_REDIS_USER" not in node_env  # the nodes never talk to Redis


def test_nodes_never_hold_the_cluster_secret() -> None:
    """A node gets its own key from its host (/etc/aenv/node-key), the metrics token from a
    Secret of its own, and no shared peer key (its peers take the credentials the scheduler
    issues it): nothing of the node's pod names the cluster secret."""
    spec = pod_spec("DaemonSet", "aenv-node")
    container = spec["containers"][0]
    env = env_of(container)
    assert "aenv-cluster" not in json.dumps(spec)
    assert not any(name.startswith("AENV_CLUSTER_SECRET") for name in env)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts[env["AENV_NODE_KEY_FILE"]]]["hostPath"] == {
        "path": "/etc/aenv/node-key", "type": "File"}
    assert "AENV_PEER_KEY_FILE" not in env and "AENV_PEER_KEY" not in env
    directory, _, name = env["AENV_METRICS_TOKEN_FILE"].rpartition("/")
    assert name == "metrics-token"
    assert volumes[mounts[directory]]["secret"]["secretName"] == "aenv-node-shared"


def test_network_policies_let_only_the_gateway_and_scheduler_reach_redis() -> None:
    policies = {doc["metadata"]["name"]: doc["spec"] for _, doc in DOCS
                if doc["kind"] == "NetworkPolicy"}
    deny = policies["aenv-default-deny"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"]
    assert "ingress" not in deny
    labels = {name: pod_spec_labels(kind, name) for kind, name in (
        ("Deployment", "aenv-gateway"), ("Deployment", "aenv-scheduler"),
        ("StatefulSet", "aenv-redis"))}
    redis = policies["aenv-redis"]
    assert labels["aenv-redis"].items() >= redis["podSelector"]["matchLabels"].items()
    (rule,) = redis["ingress"]
    allowed = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
    assert allowed == [{"app.kubernetes.io/name": "aenv-gateway"},
                       {"app.kubernetes.io/name": "aenv-scheduler"}]
    for selector, name in zip(allowed, ("aenv-gateway", "aenv-scheduler"), strict=True):
        assert labels[name].items() >= selector.items()
    # nothing else selects Redis pods with a wider rule
    for name, spec in policies.items():
        if name not in ("aenv-redis", "aenv-default-deny"):
            assert not labels["aenv-redis"].items() >= spec["podSelector"]["matchLabels"].items()
    # every pod on the pod network has its ports opened by some policy (none closed by mistake)
    for kind, name in (("Deployment", "aenv-gateway"), ("Deployment", "aenv-scheduler"),
                       ("StatefulSet", "aenv-redis")):
        ports = {p["containerPort"] for p in pod_spec(kind, name)["containers"][0]["ports"]}
        opened = {p["port"] for spec in policies.values() if "ingress" in spec
                  and labels[name].items() >= spec["podSelector"]["matchLabels"].items()
                  for rule in spec["ingress"] for p in rule.get("ports", [])}
        assert ports == opened, (name, ports, opened)


def pod_spec_labels(kind: str, name: str) -> dict[str, str]:
    return by_kind(kind, name)["spec"]["template"]["metadata"]["labels"]  # type: ignore[no-any-return]
