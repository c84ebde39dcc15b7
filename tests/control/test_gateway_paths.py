"""The gateway relays only what it authorised, and a node applies the team's scope itself.

A one-node cluster (gateway, scheduler, Redis, a process-backend node) with two teams: `alpha`,
the victim, with a sandbox, a named snapshot and a template build; `beta`, the attacker, with a
sandbox and a template of its own. Every request of these tests is sent as raw bytes
(http.client sends the target as written: no client normalises the path). Between the gateway
and the node sits a tap (a TCP relay that parses what the gateway sends with h11): the node's
advertised address is the tap's, so every request the node gets is recorded, and no test may
find one that names alpha's things for beta, or a path the gateway did not route. The fuzz
passes: a hypothesis generator of hostile targets (dot segments, encodings, empty segments,
absolute forms) over the routes of both teams' things, and schemathesis' requests of every
operation with such a segment spliced in, at the gateway and at the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import quote, unquote, urlsplit

import h11
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from agentenv.api.openapi import openapi_document
from agentenv.api.routes import CLUSTER_EVENTS_PATH
from tests.control.cluster import ROOMY_NODES, LocalCluster
from tests.control.conftest import free_port

pytestmark = pytest.mark.timeout(300)

TEAM = "x-agentenv-team"


@dataclass
class Seen:
    method: str
    target: str
    team: str | None
    #: the sandbox of sandbox traffic (its path is the sandbox's business)
    sandbox: str | None = None


class NodeTap:
    """A TCP relay in front of a node that records each request the gateway sends it."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.seen: list[Seen] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(10)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    def _record(self, parser: h11.Connection, data: bytes) -> h11.Connection | None:
        parser.receive_data(data)
        while True:
            try:
                event = parser.next_event()
            except h11.RemoteProtocolError:
                self.seen.append(Seen("?", "unparsable", None))
                return None
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return parser if event is h11.NEED_DATA else None
            if isinstance(event, h11.Request):
                teams = [v.decode() for n, v in event.headers if n == TEAM.encode()]
                sandbox = [v.decode() for n, v in event.headers if n == b"e2b-sandbox-id"]
                if (event.method == b"GET" and not teams
                        and event.target.startswith(CLUSTER_EVENTS_PATH.encode() + b"?")):
                    continue  # the gateway's event collector, polling on its own
                self.seen.append(Seen(event.method.decode(), event.target.decode("latin-1"),
                                      teams[0] if len(teams) == 1 else ",".join(teams) or None,
                                      ",".join(sandbox) or None))
            elif isinstance(event, h11.EndOfMessage):
                # play the server's part so that the next request on the connection parses
                parser.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
                parser.send(h11.EndOfMessage())
                parser.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        parser: h11.Connection | None = h11.Connection(h11.SERVER)

        async def to_node() -> None:
            nonlocal parser
            while data := await reader.read(65536):
                if parser is not None:
                    parser = self._record(parser, data)
                up_writer.write(data)
                await up_writer.drain()
            up_writer.close()

        async def to_gateway() -> None:
            while data := await up_reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.close()

        with contextlib.suppress(OSError):
            await asyncio.gather(to_node(), to_gateway())


@dataclass
class World:
    cluster: LocalCluster
    tap: NodeTap
    alpha: str
    beta: str
    #: alpha's things (the victim's): their ids and names
    victim: dict[str, str] = field(default_factory=dict)
    #: beta's own
    own: dict[str, str] = field(default_factory=dict)


def raw(url: str, method: str, target: str, headers: dict[str, str] | None = None,
        body: bytes | None = None) -> tuple[int, str]:
    """One request with `target` sent exactly as written."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request(method, target, body=body, headers=headers or {})
        answer = conn.getresponse()
        return answer.status, answer.read().decode("latin-1")
    finally:
        conn.close()


def clean_path(target: str, trailing_slash: bool = False) -> bool:
    """The test's own idea of a path no parser reads two ways (origin-form, no dot or empty
    segment, no encoded separator, however often decoded): what a node may be sent."""
    if not target.startswith("/") or target.startswith("//"):
        return False
    path = target.split("?", 1)[0]
    segments = path[1:].split("/")
    if trailing_slash and len(segments) > 1 and segments[-1] == "":
        segments.pop()
    for segment in segments:
        for _ in range(4):
            if segment in ("", ".", "..") or any(c in segment for c in "/\\\0"):
                return path == "/"
            segment = unquote(segment)
    return True


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    cluster = LocalCluster(tmp_path_factory.mktemp("paths"), nodes=1,
                           node_env=ROOMY_NODES)
    node = cluster.nodes[0]
    tap = NodeTap(node.port)
    # the gateway reaches the node at the tap's address
    node.extra_args = tuple(f"127.0.0.1:{tap.port}" if a == f"127.0.0.1:{node.port}" else a
                            for a in node.extra_args)
    tap.start()
    try:
        cluster.start()
        made = World(cluster, tap, cluster.team("alpha"), cluster.team("beta"))
        with httpx.Client(base_url=cluster.url, timeout=120) as api:
            for team, key, into in (("alpha", made.alpha, made.victim),
                                    ("beta", made.beta, made.own)):
                headers = {"X-API-KEY": key}
                sbx = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600},
                               headers=headers)
                assert sbx.status_code == 201, sbx.text
                into["sandbox"] = sbx.json()["sandboxID"]
                tpl = api.post("/v3/templates", json={"name": f"{team}-tpl", "cpuCount": 1,
                                                      "memoryMB": 512}, headers=headers)
                assert tpl.status_code == 202, tpl.text
                into["template"] = tpl.json()["templateID"]
                into["build"] = tpl.json()["buildID"]
            snap = api.post(f"/sandboxes/{made.victim['sandbox']}/snapshots",
                            json={"name": "secret-snap"}, headers={"X-API-KEY": made.alpha})
            assert snap.status_code == 201, snap.text
            made.victim["snapshot"] = snap.json()["snapshotID"]
        yield made
    finally:
        cluster.stop()
        tap.stop()


def _leaks(world: World, since: int) -> list[Seen]:
    """What the node was sent since `since` (beta's requests only) that the gateway did not
    authorise: a path with a problem, no team, alpha's team (but for the upload URLs of
    alpha's template, which the node checks the signature of), or one of alpha's sandbox,
    snapshot or template ids for another team (in the path; of sandbox traffic, whose path
    is the sandbox's business, the sandbox)."""
    victim = [world.victim[k] for k in ("sandbox", "snapshot", "template")]
    upload = f"/template-files/{world.victim['template']}/"
    bad = []
    for seen in world.tap.seen[since:]:
        names_victim = any(v in (seen.sandbox or seen.target) for v in victim)
        if seen.target == "unparsable" or not clean_path(seen.target, bool(seen.sandbox)) or \
                seen.team is None or (names_victim and seen.team != "alpha") or \
                (seen.team == "alpha" and not seen.target.startswith(upload)):
            bad.append(seen)
    return bad


TRAVERSALS = ["..", "%2e%2e", "%2E%2e", ".%2E", "%252e%252e", "%2e%2E"]


def test_template_files_cannot_reach_another_teams_sandbox(world: World) -> None:
    """The reproduced critical one: `/template-files/<own template>/../../sandboxes/<victim>/
    connect` went through without a key, reached the node as the connect of the victim's
    sandbox (with the cluster secret) and answered its envd token."""
    url, victim = world.cluster.url, world.victim["sandbox"]
    since = len(world.tap.seen)
    for dots in TRAVERSALS:
        for method in ("POST", "PUT"):
            for target in (
                f"/template-files/{world.own['template']}/{dots}/{dots}/sandboxes/{victim}/connect",
                f"/template-files/{world.own['template']}/x/{dots}/{dots}/{dots}/sandboxes/"
                f"{victim}/connect",
                f"/template-files/{world.own['template']}/x%2f{dots}%2f{dots}%2fsandboxes%2f"
                f"{victim}%2fconnect",
                f"/template-files/{world.own['template']}//../sandboxes/{victim}/connect",
            ):
                status, body = raw(url, method, target, {"content-type": "application/json"},
                                   b'{"timeout": 60}')
                assert status in (400, 401, 403, 404, 405), (method, target, status, body)
                assert "envdAccessToken" not in body, (method, target, body)
    # the exact form of a signed upload is relayed as that form only (a bad signature: 403)
    status, body = raw(url, "PUT", f"/template-files/{world.own['template']}/{'a' * 64}"
                       "?expires=1&signature=x", body=b"data")
    assert status == 403, body
    assert _leaks(world, since) == []
    assert world.tap.seen[-1].target.startswith(f"/template-files/{world.own['template']}/")
    assert world.tap.seen[-1].team == "beta"


def test_dot_segments_and_empty_segments_are_400_before_routing(world: World) -> None:
    """Another team's build logs by `.../status/x/..`, and every other route the same way:
    400 naming the path's problem, nothing sent to the node."""
    url = world.cluster.url
    tid, bid = world.victim["template"], world.victim["build"]
    beta = {"X-API-KEY": world.beta}
    since = len(world.tap.seen)
    for dots in TRAVERSALS:
        for target in (f"/templates/{tid}/builds/{bid}/status/x/{dots}",
                       f"/templates/{world.own['template']}/{dots}/{tid}/builds/{bid}/status",
                       f"/sandboxes/{world.own['sandbox']}/{dots}/{world.victim['sandbox']}",
                       f"/snapshots/x/{dots}/{world.victim['snapshot']}",
                       f"/v2/sandboxes/{world.own['sandbox']}/{dots}/{world.victim['sandbox']}"
                       "/connect"):
            for method in ("GET", "POST", "DELETE"):
                status, body = raw(url, method, target, beta)
                assert status == 400, (method, target, status, body)
                assert "dot segment" in json.loads(body)["message"], body
    for target in (f"/sandboxes//{world.victim['sandbox']}", "/v2/sandboxes/",
                   f"/templates/{tid}//builds/{bid}/status"):
        status, body = raw(url, "GET", target, beta)
        assert status == 400 and "empty segment" in body, (target, body)
    assert _leaks(world, since) == []
    assert len(world.tap.seen) == since  # none of it reached the node


def test_init_is_the_nodes_however_it_is_spelled(world: World) -> None:
    """`/./init` slipped past the proxy's `/init` guard: refused at the gateway and at the
    node, encoded or not; `/init/` is the reserved route too."""
    sandbox = {"E2b-Sandbox-Id": world.own["sandbox"], "content-type": "application/json"}
    init = b'{"accessToken": "planted", "envVars": {"PLANTED": "1"}}'
    node = world.cluster.nodes[0]
    as_gateway = {**sandbox, **world.cluster.node_headers(node, "beta")}
    for base, headers in ((world.cluster.url, sandbox), (node.url, as_gateway)):
        for target in ("/./init", "/%2e/init", "/%2E/init", "/x/../init", "/x/%2e%2e/init"):
            status, body = raw(base, "POST", target, headers, init)
            assert status == 400, (base, target, status, body)
            assert "dot segment" in json.loads(body)["message"], body
        status, body = raw(base, "POST", "/init/", headers, init)
        assert status == 403 and "reserved" in body, (base, body)


def test_another_teams_snapshot_by_name_is_not_found(world: World) -> None:
    """Reproduced: 201 by name where the id gave 404. Both 404 now."""
    beta = {"X-API-KEY": world.beta}
    with httpx.Client(base_url=world.cluster.url, timeout=120, headers=beta) as api:
        for ref in ("secret-snap", world.victim["snapshot"], "alpha/secret-snap",
                    "secret-snap:default"):
            made = api.post("/v2/sandboxes", json={"templateID": ref, "timeout": 60})
            if made.status_code == 201:
                api.delete(f"/sandboxes/{made.json()['sandboxID']}")
            assert made.status_code == 404, (ref, made.text)
        for path in ("/snapshots/secret-snap", f"/snapshots/{world.victim['snapshot']}",
                     f"/templates/{world.victim['template']}", "/templates/aliases/alpha-tpl"):
            answer = api.get(path)
            assert answer.status_code == 404, (path, answer.text)


def test_names_are_per_team(world: World) -> None:
    """The same name in two teams names two things; neither team's name blocks the other."""
    alpha, beta = {"X-API-KEY": world.alpha}, {"X-API-KEY": world.beta}
    with httpx.Client(base_url=world.cluster.url, timeout=120) as api:
        mine = api.post(f"/sandboxes/{world.own['sandbox']}/snapshots",
                        json={"name": "secret-snap"}, headers=beta)
        assert mine.status_code == 201, mine.text
        mine_id = mine.json()["snapshotID"]
        try:
            for headers, expected in ((beta, mine_id), (alpha, world.victim["snapshot"])):
                made = api.post("/v2/sandboxes", json={"templateID": "secret-snap",
                                                       "timeout": 60}, headers=headers)
                assert made.status_code == 201, made.text
                api.delete(f"/sandboxes/{made.json()['sandboxID']}", headers=headers)
                assert made.json()["templateID"] == expected
                listed = api.get("/snapshots", params={"name": "secret-snap"},
                                 headers=headers).json()
                assert [s["snapshotID"] for s in listed] == [expected]
            # a template name of alpha's is free for beta too
            tpl = api.post("/v3/templates", json={"name": "alpha-tpl", "cpuCount": 1,
                                                  "memoryMB": 512}, headers=beta)
            assert tpl.status_code == 202, tpl.text
            assert tpl.json()["templateID"] != world.victim["template"]
            assert api.get("/templates/aliases/alpha-tpl", headers=alpha
                           ).json()["templateID"] == world.victim["template"]
            assert api.delete(f"/templates/{tpl.json()['templateID']}",
                              headers=beta).status_code == 204
        finally:
            api.delete(f"/templates/{mine_id}", headers=beta)


def test_the_node_applies_the_team_scope_itself(world: World) -> None:
    """As if the gateway had a bug: requests with the node's key, for team beta, naming
    alpha's things, straight to the node. None of alpha's is found; without a team only the
    team-less routes answer."""
    node, victim = world.cluster.nodes[0], world.victim
    beta = world.cluster.node_headers(node, "beta")
    with httpx.Client(base_url=node.url, timeout=60, headers=beta) as api:
        for method, path in [("GET", f"/sandboxes/{victim['sandbox']}"),
                             ("POST", f"/sandboxes/{victim['sandbox']}/connect"),
                             ("POST", f"/v2/sandboxes/{victim['sandbox']}/connect"),
                             ("POST", f"/sandboxes/{victim['sandbox']}/pause"),
                             ("POST", f"/sandboxes/{victim['sandbox']}/fork"),
                             ("POST", f"/sandboxes/{victim['sandbox']}/snapshots"),
                             ("PUT", f"/sandboxes/{victim['sandbox']}/network"),
                             ("DELETE", f"/sandboxes/{victim['sandbox']}"),
                             ("GET", f"/snapshots/{victim['snapshot']}"),
                             ("GET", "/snapshots/secret-snap"),
                             ("GET", f"/templates/{victim['template']}"),
                             ("GET", "/templates/alpha-tpl"),
                             ("GET", f"/templates/{victim['template']}/builds/{victim['build']}"
                              "/status"),
                             ("DELETE", f"/templates/{victim['template']}")]:
            answer = api.request(method, path, json={"timeout": 60} if method != "GET" else None)
            assert answer.status_code == 404, (method, path, answer.text)
        for ref in (victim["snapshot"], "secret-snap"):
            made = api.post("/v2/sandboxes", json={"templateID": ref, "timeout": 60})
            assert made.status_code == 404, (ref, made.text)
        listed = json.dumps([api.get(p).json() for p in
                             ("/sandboxes", "/v2/sandboxes", "/snapshots", "/templates",
                              "/v2/templates")])
        assert not [v for v in victim.values() if v in listed], listed
        assert world.own["sandbox"] in listed  # beta's own are there
        proxied = api.get("/health", headers={"E2b-Sandbox-Id": victim["sandbox"]})
        assert proxied.status_code == 502 and "not found" in proxied.text
        # alpha's, for alpha: found (the scope is the team's, not a wall around everything)
        assert api.get(f"/sandboxes/{victim['sandbox']}",
                       headers={TEAM: "alpha"}).status_code == 200
    secret = {"x-agentenv-node-key": beta["x-agentenv-node-key"]}  # the node's key, no team
    for headers in (secret, {**secret, TEAM: "Not A Team"}):
        for extra in ({}, {"E2b-Sandbox-Id": victim["sandbox"]}):
            answer = httpx.get(f"{node.url}/sandboxes/{victim['sandbox']}", timeout=30,
                               headers={**headers, **extra})
            assert answer.status_code == 403, answer.text
    two = httpx.get(f"{node.url}/v2/sandboxes", timeout=30,
                    headers=[*secret.items(), (TEAM, "beta"), (TEAM, "alpha")])
    assert two.status_code == 403, two.text
    # a node's figures are always some team's view (no team-less /nodes)
    assert httpx.get(f"{node.url}/nodes", headers=secret, timeout=30).status_code == 403


def test_a_clients_team_header_is_not_passed_on(world: World) -> None:
    """Only the gateway says which team a request is for."""
    since = len(world.tap.seen)
    beta = {"X-API-KEY": world.beta, TEAM: "alpha"}
    with httpx.Client(base_url=world.cluster.url, timeout=60) as api:
        assert api.get("/v2/sandboxes", headers=beta).status_code == 200
        assert api.get(f"/sandboxes/{world.victim['sandbox']}", headers=beta).status_code == 404
        traffic = api.get("/health", headers={"E2b-Sandbox-Id": world.own["sandbox"], TEAM: "alpha"})
        assert traffic.status_code in (200, 204), traffic.text
    recorded = world.tap.seen[since:]
    assert recorded and all(s.team == "beta" for s in recorded), recorded


# --- fuzz ----------------------------------------------------------------------------------------

#: the routes of the gateway and the node, with the ids the fuzzer fills in
ROUTES = ["/sandboxes/{s}", "/sandboxes/{s}/connect", "/v2/sandboxes/{s}/connect",
          "/sandboxes/{s}/pause", "/sandboxes/{s}/fork", "/sandboxes/{s}/snapshots",
          "/sandboxes/{s}/network", "/sandboxes/{s}/rollback", "/sandboxes/{s}/children",
          "/snapshots/{n}", "/snapshots/{n}/fork", "/snapshots/{n}/children",
          "/templates/{t}", "/templates/aliases/{t}",
          "/templates/{t}/builds/{b}/status", "/templates/{t}/tags", "/template-files/{t}/{h}",
          "/v2/templates/{t}/builds/{b}", "/init", "/files", "/nodes/{s}",
          "/aenv/snapshots/push"]
DOTS = ["", ".", "..", "%2e", "%2E", "%2e%2e", ".%2e", "%2E.", "%252e%252e", "%2f", "%5c", "\\",
        "x%2f..", "%2e%2e%2f"]


@st.composite
def hostile_targets(draw: st.DrawFn, world: World) -> str:
    """A route with ids of either team, and dot segments, encodings, empty segments, or an
    absolute form spliced in somewhere."""
    route = draw(st.sampled_from(ROUTES))
    pick = st.sampled_from
    ids = {"s": draw(pick([world.victim["sandbox"], world.own["sandbox"]])),
           "n": draw(pick([world.victim["snapshot"], "secret-snap"])),
           "t": draw(pick([world.victim["template"], world.own["template"], "alpha-tpl"])),
           "b": draw(pick([world.victim["build"], world.own["build"]])),
           "h": "a" * 64}
    segments = route.format(**ids).split("/")[1:]
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(segments)))
        segments.insert(at, draw(pick(DOTS)))
    target = "/" + "/".join(segments)
    if draw(st.booleans()):
        target += draw(pick(["", "/", "?x=/../y", "?path=%2e%2e"]))
    form = draw(pick(["origin", "origin", "absolute", "double-slash"]))
    if form == "absolute":
        target = "http://127.0.0.1" + target
    elif form == "double-slash":
        target = "/" + target
    return target


def test_fuzzed_paths_reach_no_route_the_gateway_did_not_authorise(world: World) -> None:
    """Generated targets through the gateway (as beta, with no key, and as beta's sandbox
    traffic), and straight to the node for team beta: no 2xx answer names alpha's things and
    every request the node got is one the gateway routed (a clean path, beta's team)."""
    since = len(world.tap.seen)
    node = world.cluster.nodes[0]
    senders = [(world.cluster.url, {"X-API-KEY": world.beta}),
               (world.cluster.url, {}),
               (world.cluster.url, {"E2b-Sandbox-Id": world.own["sandbox"]}),
               (node.url, world.cluster.node_headers(node, "beta"))]
    checked = [0]

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(target=hostile_targets(world), method=st.sampled_from(["GET", "POST", "PUT",
                                                                   "DELETE"]))
    def one(target: str, method: str) -> None:
        for base, headers in senders:
            status, body = raw(base, method, target,
                               {**headers, "content-type": "application/json"}, b"{}")
            checked[0] += 1
            traffic = "E2b-Sandbox-Id" in headers
            if not clean_path(target, traffic):
                assert status == 400, (method, target, base, headers, status, body)
            if 200 <= status < 300:
                named = [v for v in world.victim.values() if v in body]
                assert not named, (method, target, base, body)

    one()
    assert checked[0] >= 200
    assert _leaks(world, since) == []



# --- schemathesis: every operation of the API, its generated path spliced ------------------------

SCHEMA = schemathesis.openapi.from_dict(openapi_document())
SPLICES = ["/./", "/../", "/%2e%2e/", "/%2E/", "//", "/x%2f..%2f"]
#: (method, quoted path) of the cases already checked: the requests sent are the method and the
#: spliced path only (no query, body or case headers), so a case of the same path (schemathesis'
#: coverage cases vary mostly those: ~42 cases, ~7 paths, per operation) would send them again
CHECKED: set[tuple[str, str]] = set()


@SCHEMA.parametrize()
@settings(max_examples=2, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
def test_every_operation_with_a_spliced_path_is_400_at_gateway_and_node(
        case: schemathesis.Case, world: World) -> None:
    """schemathesis' requests of every operation of the API (the node's document, the
    gateway's too), each path with a dot segment, an encoding or an empty segment spliced in
    after its first segment: 400 at the gateway (as beta, and with no key) and at the node
    (for beta), and nothing of it reaches the node through the gateway."""
    since = len(world.tap.seen)
    path = quote(case.formatted_path, safe="/:@!$&'()*+,;=-._~")
    if (case.method.upper(), path) in CHECKED:
        return
    CHECKED.add((case.method.upper(), path))
    head, _, tail = path.lstrip("/").partition("/")
    node = world.cluster.nodes[0]
    for splice in SPLICES:
        target = f"/{head}{splice}{tail}"
        for base, headers in ((world.cluster.url, {"X-API-KEY": world.beta}),
                              (world.cluster.url, {}),
                              (node.url, world.cluster.node_headers(node, "beta"))):
            status, body = raw(base, case.method.upper(), target, headers)
            assert status == 400, (case.method, target, base, status, body)
    assert world.tap.seen[since:] == []
