"""Templates and snapshots that move, on real VM-backend nodes and a real registry (Debian's
docker-registry on loopback):

- `aenv pull IMAGE --name NAME` registers the image as a template of the running node, and
  the official e2b SDK creates a sandbox from NAME right after;
- node A publishes its template builds to a shared directory (AENV_SNAPSHOT_PUBLISH); node B
  pulls one from there and creates a sandbox from it;
- a paused sandbox's snapshot pushed from node A (`aenv snapshot push`) and pulled on node B
  (`aenv snapshot pull`, another process and state directory) lazily: its memory and disk
  layers stay in the registry and the restore fetches what it touches (fewer bytes than the
  snapshot has) through blockd's and memfs's chunk stores; the sandbox made from it on B has
  the process that ran on A still running with its state, and A's files; its envd was re-keyed:
  the token of A's sandbox (which the artifact carries) is refused, B's sandbox's own works
  (for a sandbox created `secure: false` too).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.template import helpers
from tests.template.conftest import Registry

from . import conftest
from .conftest import COUNTER, NodeProcess, counter_value, wait_counting

pytestmark = [pytest.mark.qemu, pytest.mark.root, pytest.mark.slow]

CACHE = Path("/var/cache/aenv-test/template-build")  # shared with test_template_api
NET_A, NET_B = "asm", "asn"  # unique: teardown deletes every {prefix}-s* namespace
FIRST_SLOT_A, FIRST_SLOT_B = 28001, 28401  # disjoint from the other VM test modules


@pytest.fixture(scope="module")
def image(registry: Registry) -> str:
    from tests.node.test_template_api import _host_image_tar

    built = helpers.build_image([_host_image_tar()], [""], config_extra={
        "User": "", "WorkingDir": "", "Cmd": ["/bin/bash"], "Env": ["PATH=/usr/bin:/bin"]})
    registry.push("aenv-move/hostroot", "v1", built)
    return f"{registry.host}/aenv-move/hostroot:v1"


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared directory repository (an NFS mount between nodes, here a local directory)."""
    return tmp_path_factory.mktemp("shared-snapshots")


@pytest.fixture(scope="module")
def node_a(tmp_path_factory: pytest.TempPathFactory, shared_dir: Path) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("node-a")
    (CACHE / "layer-cache").mkdir(parents=True, exist_ok=True)
    # Every template build of A is published to the shared directory.
    node = conftest.vm_node_process(base / "state", base / "node.log", NET_A, FIRST_SLOT_A, {
        "AENV_LAYER_CACHE": str(CACHE / "layer-cache"), "AENV_SNAPSHOT_PUBLISH": str(shared_dir),
        **conftest.NO_READY_POOLS})
    with conftest.serving_vm_node(node, NET_A):
        yield node


@pytest.fixture(scope="module")
def node_b(tmp_path_factory: pytest.TempPathFactory, node_a: NodeProcess) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("node-b")
    # A slow background completer: what a restore fetches stays apart from what it would
    # fetch anyway (counted apart too).
    node = conftest.vm_node_process(base / "state", base / "node.log", NET_B, FIRST_SLOT_B,
                                    {**conftest.NO_READY_POOLS, "AENV_REMOTE_BACKGROUND_BW": "1M"})
    with conftest.serving_vm_node(node, NET_B):
        yield node  # the tests name the node of each SDK call


def _aenv(node: NodeProcess, *args: str, timeout: float = 600) -> str:
    env = {**os.environ, "E2B_API_URL": node.url, "E2B_API_KEY": node.api_key}
    out = subprocess.run([sys.executable, "-m", "agentenv.cli.main", *args], env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"aenv {' '.join(args)}: {out.stderr[-2000:]}"
    return out.stdout.strip()


def _sandbox(node: NodeProcess, template: str):  # type: ignore[no-untyped-def]
    from e2b import Sandbox

    return Sandbox.create(template, api_key=node.api_key, api_url=node.url, sandbox_url=node.url,
                          timeout=600)


def test_pull_with_name_registers_a_template(node_a: NodeProcess, image: str) -> None:
    t0 = time.monotonic()
    tid = _aenv(node_a, "pull", image, "--name", "moved-hostroot", "-q")
    print(f"\naenv pull --name (the node pulls and builds): {time.monotonic() - t0:.1f} s")
    assert tid
    sbx = _sandbox(node_a, "moved-hostroot")
    try:
        assert sbx.commands.run("echo from-$((6*7))").stdout.strip() == "from-42"
        assert sbx.commands.run("test -x /bin/bash && echo yes").stdout.strip() == "yes"
    finally:
        sbx.kill()


def test_published_template_restores_on_b_from_the_shared_directory(
        node_a: NodeProcess, node_b: NodeProcess, shared_dir: Path) -> None:
    deadline = time.monotonic() + 120
    while not (published := sorted(shared_dir.glob("local/moved-hostroot-*/manifest.json"))):
        assert time.monotonic() < deadline, "node A did not publish its template build"
        time.sleep(0.5)
    ref = f"dir://{published[0].parent}"
    out = _aenv(node_b, "snapshot", "pull", ref, "--name", "published-hostroot")
    print(f"\n{out}")
    sbx = _sandbox(node_b, "published-hostroot")
    try:
        assert sbx.commands.run("echo on-b-$((6*7))").stdout.strip() == "on-b-42"
    finally:
        sbx.kill()


def _envd_token(node: NodeProcess, sandbox_id: str) -> str:
    import httpx

    answer = httpx.get(f"{node.url}/sandboxes/{sandbox_id}", headers={"X-API-KEY": node.api_key},
                       timeout=30, trust_env=False)
    answer.raise_for_status()
    return str(answer.json()["envdAccessToken"])


def _create_plain(node: NodeProcess, template: str) -> dict[str, str]:
    import httpx

    answer = httpx.post(f"{node.url}/sandboxes", headers={"X-API-KEY": node.api_key},
                        json={"templateID": template, "secure": False, "timeout": 300},
                        timeout=600, trust_env=False)
    assert answer.status_code == 201, answer.text
    return dict(answer.json())


def _kill(node: NodeProcess, sandbox_id: str) -> None:
    import httpx

    httpx.delete(f"{node.url}/sandboxes/{sandbox_id}", headers={"X-API-KEY": node.api_key},
                 timeout=120, trust_env=False)


def _envd_status(node: NodeProcess, sandbox_id: str, token: str) -> int:
    """envd's answer to GET /envs (token-protected) through B's sandbox proxy."""
    import httpx

    answer = httpx.get(f"{node.url}/envs", timeout=30, trust_env=False, headers={
        "E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983", "X-Access-Token": token})
    return answer.status_code


def _fetched(node: NodeProcess) -> tuple[int, int]:
    """Bytes node's blockd and memfs fetched for reads, and for background completion."""
    from agentenv.blockd.client import BlockdClient

    time.sleep(2.5)  # memfs writes its counters every 2 s
    with BlockdClient(Path(node.state_dir) / "vm-backend" / "blockd" / "blockd.sock") as client:
        stats = client.call("remote_stats")
    fetched = background = 0
    for part in (stats, stats.get("memory") or {}):
        fetched += sum(part.get("fetched_bytes", {}).values())
        background += part.get("background_bytes", 0)
    return fetched - background, background


def test_paused_snapshot_pushed_on_a_restores_lazily_on_b(
        node_a: NodeProcess, node_b: NodeProcess, registry: Registry) -> None:

    sbx = _sandbox(node_a, "moved-hostroot")
    try:
        old_token = _envd_token(node_a, sbx.sandbox_id)
        sbx.files.write("/root/moved.txt", "written on node A\n")
        sbx.commands.run(COUNTER, background=True, timeout=0)
        at_pause = wait_counting(sbx)
        assert sbx.pause() is True
        ref = f"{registry.host}/aenv-move/snapshots:paused"
        pushed = _aenv(node_a, "snapshot", "push", sbx.sandbox_id, ref)
        print(f"\n{pushed}")
        out = _aenv(node_b, "snapshot", "pull", ref, "--name", "from-a")
        print(out)
        assert "from-a" in out and "layers left remote" in out
        total = int(_registry_manifest_total(registry, "aenv-move/snapshots", "paused"))
        before, _ = _fetched(node_b)
        t0 = time.monotonic()
        moved = _sandbox(node_b, "from-a")
        try:
            # The counter that ran on A goes on counting on B from where it was paused.
            first = counter_value(moved)
            print(f"lazy restore to first command: {time.monotonic() - t0:.1f} s")
            assert first >= at_pause
            time.sleep(1.0)
            assert counter_value(moved) > first
            assert moved.files.read("/root/moved.txt") == "written on node A\n"
            # Re-keyed: the token the artifact carries does not open the restored sandbox.
            new_token = _envd_token(node_b, moved.sandbox_id)
            assert new_token != old_token
            assert _envd_status(node_b, moved.sandbox_id, old_token) == 401
            assert _envd_status(node_b, moved.sandbox_id, new_token) == 200
            fetched, background = _fetched(node_b)
            fetched -= before
            print(f"lazy restore fetched {fetched / 1e6:.1f} MB of the snapshot's "
                  f"{total / 1e6:.1f} MB (+{background / 1e6:.1f} MB in the background)")
            assert 0 < fetched < total
            # A sandbox that is not secure (E2B API v1 `secure: false`) is re-keyed too: to its
            # own token, which the create answer gives the SDK.
            plain = _create_plain(node_b, "from-a")
            try:
                assert _envd_status(node_b, plain["sandboxID"], old_token) == 401
                assert _envd_status(node_b, plain["sandboxID"], plain["envdAccessToken"]) == 200
            finally:
                _kill(node_b, plain["sandboxID"])
        finally:
            moved.kill()
        # Pulling again finds the snapshot on B and registers no second copy of its files.
        again = _aenv(node_b, "snapshot", "pull", ref)
        assert "0.0 MB fetched" in again
    finally:
        sbx.kill()


def _registry_manifest_total(registry: Registry, repository: str, tag: str) -> int:
    """The bytes of every part of a snapshot artifact, from its manifest."""
    import httpx

    answer = httpx.get(f"http://{registry.host}/v2/{repository}/manifests/{tag}", trust_env=False,
                       headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=30)
    answer.raise_for_status()
    return sum(int(layer["size"]) for layer in answer.json()["layers"])
