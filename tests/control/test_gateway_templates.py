"""Template builds through the gateway on 2 process-backend nodes placed round-robin (a strategy
that spreads builds): a team's new templates are built next to its own templates, so a chain
built with the official SDK's Template.build (A from base, B from A, C from B) stays on one node;
a build placed away from its base (that node full at placement) is refused at its trigger with a
409 naming both nodes, before the node starts anything, and built again it goes to the base's
node; another team's template is no base (400 "not found")."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException

from agentenv.control.gateway.placement import NODES_TTL
from tests.control.cluster import LocalCluster
from tests.control.helpers import call, wait_for
from tests.node.conftest import environ_set

pytestmark = pytest.mark.timeout(300)

VCPUS = 4  # per node: two sandboxes of a 2-vCPU template fill one


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    made = LocalCluster(tmp_path_factory.mktemp("tplcluster"), nodes=2, strategy="round-robin",
                        node_env={"AENV_NODE_VCPUS": str(VCPUS),
                                  "AENV_MEMORY_BUDGET_MB": "100000"})
    try:
        made.start()
        made.team("tee")
        made.team("other")
        with environ_set({"E2B_API_URL": made.url, "E2B_SANDBOX_URL": made.url,
                          "E2B_API_KEY": made.keys["tee"]}):
            yield made
    finally:
        made.stop()


def home(cluster: LocalCluster, template_id: str) -> str:
    """The one node that has the template (asked of every node with the cluster secret)."""
    found = [f"node{i}" for i, node in enumerate(cluster.nodes)
             if httpx.get(f"{node.url}/templates/{template_id}", timeout=10,
                          headers=cluster.node_headers(node, "tee")).status_code == 200]
    assert len(found) == 1, (template_id, found)
    return found[0]


def build(name: str, base: str, line: str, api_key: str | None = None) -> str:
    template = Template().from_template(base).run_cmd(f"echo {line} >> /tmp/chain.txt")
    return Template.build(template, name, cpu_count=2, memory_mb=512, skip_cache=True,
                          api_key=api_key).template_id


def cpu_free(cluster: LocalCluster, node_id: str) -> int:
    nodes = call(cluster.scheduler.address, "list_nodes")
    return next(int(n.status.cpu_free) for n in nodes if n.node_id == node_id)


def test_a_team_chain_of_templates_stays_on_one_node(cluster: LocalCluster) -> None:
    a = build("chain-a", "base", "a")
    b = build("chain-b", "chain-a", "b")  # round-robin alone would put it on the other node
    c = build("chain-c", "chain-b:default", "c")
    assert home(cluster, a) == home(cluster, b) == home(cluster, c)
    sbx = Sandbox.create(template="chain-c", timeout=60)
    try:
        assert sbx.files.read("/tmp/chain.txt") == "a\nb\nc\n"
    finally:
        sbx.kill()
    # another team's template is no base: refused as unknown before its node starts anything
    with pytest.raises(BuildException, match="template 'chain-a' not found"):
        build("theirs", "chain-a", "x", api_key=cluster.keys["other"])


def test_a_build_placed_away_from_its_base_is_refused_then_built_next_to_it(
        cluster: LocalCluster) -> None:
    a = build("far-a", "base", "a")
    near = home(cluster, a)
    far = next(f"node{i}" for i in range(2) if f"node{i}" != near)
    # fill the base's node: the next new template of the team cannot go there
    fill = [Sandbox.create(template="far-a", timeout=120) for _ in range(VCPUS // 2)]
    try:
        wait_for(f"{near} reported full", lambda: cpu_free(cluster, near) < 2)
        time.sleep(NODES_TTL + 0.1)  # the gateway's view of the nodes is that old at most
        with pytest.raises(BuildException) as refused:
            build("far-b", "far-a", "b")
        message = str(refused.value)
        assert f"on node {near}" in message and f"placed on node {far}" in message, message
        listed = httpx.get(f"{cluster.url}/templates", timeout=30,
                           headers={"X-API-KEY": cluster.keys["tee"]}).json()
        b = next(t["templateID"] for t in listed if "far-b" in t.get("names", []))
        assert home(cluster, b) == far
        # the node never started the build: its only build is still waiting
        detail = httpx.get(f"{cluster.nodes[int(far[-1])].url}/templates/{b}", timeout=10,
                           headers=cluster.node_headers(cluster.nodes[int(far[-1])], "tee")).json()
        assert [x["status"] for x in detail["builds"]] == ["waiting"], detail
        # as the message says: delete it, make room, build it again: it goes to the base
        deleted = httpx.delete(f"{cluster.url}/templates/{b}", timeout=30,
                               headers={"X-API-KEY": cluster.keys["tee"]})
        assert deleted.status_code == 204, deleted.text
    finally:
        for sbx in fill:
            sbx.kill()
    wait_for(f"{near} reported free", lambda: cpu_free(cluster, near) >= 2)
    time.sleep(NODES_TTL + 0.1)
    b = build("far-b", "far-a", "b")
    assert home(cluster, b) == near
