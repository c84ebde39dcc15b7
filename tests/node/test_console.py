"""The web console (agentenv.console, docs/console.md) in a real browser: Debian's headless
Chromium driven by Playwright, against a real node (the process backend: its sandboxes run
envd, so the terminal is a real PTY). One sandbox, one browser; a screenshot of each page goes
to the test's temporary directory (the paths are printed)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentenv.console import CSP
from tests.node.conftest import NodeProcess

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
WAIT_MS = 60_000  # generous: CI has 2 busy cores


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One Chromium (a fresh profile) for the module; each test opens its own page, and so its
    own sessionStorage."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/install-system.sh (chromium)")
    os.environ["PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD"] = "1"  # never a browser of its own
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900})
        context.set_default_timeout(WAIT_MS)
        try:
            yield context
        finally:
            context.close()


@contextlib.contextmanager
def console_page(browser: Any) -> Iterator[tuple[Any, list[str]]]:
    """A new page, and the browser's complaints seen meanwhile (CSP violations, script
    errors): a console that breaks its own policy would fail silently otherwise."""
    page = browser.new_page()
    complaints: list[str] = []
    page.on("console", lambda m: complaints.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: complaints.append(str(e)))
    page.on("response", lambda r: complaints.append(f"{r.status} {r.request.method} {r.url}")
            if r.status >= 400 else None)
    try:
        yield page, complaints
    finally:
        page.close()


def shot(page: Any, directory: Path, name: str, shots: list[Path]) -> None:
    path = directory / f"console-{len(shots) + 1:02d}-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    shots.append(path)
    print(f"screenshot: {path}")


def raw_status(node: NodeProcess, target: str) -> int:
    """The status of a GET of exactly `target` (an HTTP client would tidy its dot segments)."""
    with socket.create_connection(("127.0.0.1", node.port), timeout=30) as conn:
        conn.sendall(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
                     .encode())
        head = conn.recv(4096).decode("latin-1")
    return int(head.split(" ", 2)[1])


def sign_in(page: Any, node: NodeProcess, key: str) -> None:
    page.goto(node.url + "/console")
    page.fill("#api-key", key)
    page.click("#login button[type=submit]")


def test_static_files_carry_the_policy_and_pass_the_path_checks(node: NodeProcess) -> None:
    with httpx.Client(base_url=node.url, trust_env=False, timeout=30) as client:
        page = client.get("/console")  # no key: the files hold nothing secret
        assert page.status_code == 200, page.text
        assert page.headers["content-type"].startswith("text/html")
        for answer in (page, client.get("/console/app.js"), client.get("/console/style.css")):
            assert answer.status_code == 200
            assert answer.headers["content-security-policy"] == CSP
            assert "'unsafe-inline'" not in CSP and "script-src 'self'" in CSP
            assert answer.headers["x-frame-options"] == "DENY"
            assert answer.headers["x-content-type-options"] == "nosniff"
        assert client.get("/console/app.js").headers["content-type"].startswith("text/javascript")
        # every script of the page is a file of this origin: nothing inline to allow
        scripts = re.findall(r"<script\b[^>]*>", page.text)
        assert scripts and all('src="/console/' in s for s in scripts), scripts
        assert "style=" not in page.text
        missing = client.get("/console/secrets.js")
        assert missing.status_code == 404 and missing.json()["code"] == 404
        assert client.post("/console").status_code == 405
        assert client.head("/console").status_code == 200
        # dot segments, encoded separators and a trailing slash are refused before routing,
        # as on every other path of the API
        for target in ("/console/../health", "/console/%2e%2e/health", "/console/..%2fapp.js",
                       "/console/", "/console//app.js", "/console/./app.js"):
            assert raw_status(node, target) == 400, target
        # the data the console shows still needs the key
        assert client.get("/v2/sandboxes").status_code == 401


def test_the_gateway_serves_the_same_files_and_a_cluster_node_only_to_its_gateway(
        tmp_path: Path) -> None:
    """In-process: the gateway answers /console itself (before any team lookup: its store and
    scheduler here are unreachable), with the node's files and headers; a node of a cluster
    serves nothing, the console included, to anyone but its gateway."""
    import secrets
    import warnings

    from agentenv.cluster_keys import node_key
    from agentenv.console import Console
    from agentenv.control.gateway.app import GatewayApp
    from agentenv.control.gateway.placement import SchedulerLink
    from agentenv.control.gateway.store import GatewayStore
    from agentenv.node.server import ServeOptions, build_app
    from agentenv.scheduling.client import Credentials

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient

    secret = secrets.token_urlsafe(32)
    gateway = TestClient(GatewayApp(SchedulerLink("127.0.0.1:9", Credentials.gateway(secret)),
                                    GatewayStore("redis://127.0.0.1:9/0"), secret))
    files = Console().files
    assert {"/console", "/console/app.js", "/console/term.js"} <= set(files)
    for path, (_, body) in files.items():
        answer = gateway.get(path)
        assert answer.status_code == 200 and answer.content == body, path
        assert answer.headers["content-security-policy"] == CSP
        assert answer.headers["x-frame-options"] == "DENY"
    assert gateway.get("/console/nope.js").status_code == 404
    assert gateway.put("/console").status_code == 405

    key = node_key(secret, "n1")
    member = TestClient(build_app(ServeOptions(state_dir=tmp_path / "state", backend="process",
                                               node_key=key)))
    assert member.get("/console").status_code == 403
    assert member.get("/console", headers={"x-agentenv-node-key": key,
                                           "x-agentenv-team": "t1"}).status_code == 200


def test_a_wrong_key_shows_the_login_error(browser: Any, node: NodeProcess) -> None:
    with console_page(browser) as (page, complaints):
        sign_in(page, node, "e2b_" + "0" * 40)
        page.wait_for_selector("#login-error:has-text('invalid API key')")
        assert page.evaluate("sessionStorage.length") == 0
        assert page.is_hidden("#nav")
        # the one refusal: the sign-in's own call
        assert [c for c in complaints if c.startswith("401 GET")] == [
            f"401 GET {node.url}/v2/sandboxes?limit=1"], complaints
        assert not [c for c in complaints if "401" not in c], complaints


def test_console_walkthrough(browser: Any, node: NodeProcess,
                             tmp_path: Path) -> None:
    """Login, the list, a sandbox's page with its metrics, events and logs, a terminal into it
    (`echo hi` answers `hi`), the other pages, then kill from the sandbox's page."""
    shots: list[Path] = []
    with node.client() as api:
        made = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600,
                                              "metadata": {"owner": "console-test"}})
        assert made.status_code == 201, made.text
        sid = made.json()["sandboxID"]
        try:
            with console_page(browser) as (page, complaints):
                sign_in(page, node, node.api_key)
                page.wait_for_selector(f"#sandbox-list tr[data-id='{sid}']")
                shot(page, tmp_path, "sandboxes", shots)

                # the metadata filter is the API's: another value shows nothing
                page.fill("#filters input[name=metadata]", "owner=someone-else")
                page.click("#filters button[type=submit]")
                page.wait_for_selector("#sandbox-list:has-text('No sandboxes match.')")
                page.fill("#filters input[name=metadata]", "owner=console-test")
                page.click("#filters button[type=submit]")
                page.click(f"#sandbox-list tr[data-id='{sid}'] a")

                page.wait_for_selector(f"#sandbox-id:has-text('{sid}')")
                page.wait_for_selector("#metrics svg.chart polyline")
                page.wait_for_selector("#events:has-text('created')")
                shot(page, tmp_path, "sandbox", shots)

                page.click("#open-terminal")
                page.wait_for_selector("#terminal-status:has-text('connected')")
                page.click("#terminal")
                page.keyboard.type("echo hi")
                page.keyboard.press("Enter")
                page.wait_for_function(  # a function: a string would be eval, which the CSP bars
                    "() => document.querySelector('#terminal').textContent.split('\\n')"
                    ".some(line => line.trim() === 'hi')")
                shot(page, tmp_path, "terminal", shots)

                for name, ready in (("templates", "td:has-text('base')"),
                                    ("snapshots", "h1:has-text('Snapshots')"),
                                    ("nodes", "section.node"),
                                    ("events", f"#event-list a:has-text('{sid}')")):
                    page.click(f"#nav a[data-page={name}]")
                    page.wait_for_selector(ready)
                    shot(page, tmp_path, name, shots)
                page.click("#nav a[data-page=templates]")
                page.click("a:has-text('base')")
                page.wait_for_selector("h2:has-text('Builds')")
                shot(page, tmp_path, "template", shots)

                page.goto(f"{node.url}/console#/sandboxes/{sid}")
                page.wait_for_selector("#kill")
                page.click("#kill")
                page.click("#kill:has-text('Confirm')")  # a second click does it
                page.wait_for_selector("#sandbox-list")
                page.wait_for_selector(f"#sandbox-list tr[data-id='{sid}']", state="detached")
                shot(page, tmp_path, "after-kill", shots)
                assert api.get(f"/sandboxes/{sid}").status_code == 404
                assert not complaints, complaints
        finally:
            api.delete(f"/sandboxes/{sid}")
    assert all(p.stat().st_size > 0 for p in shots)
    print("screenshots:", *shots, sep="\n  ")


def test_the_console_of_a_cluster_through_its_gateway(browser: Any, tmp_path: Path) -> None:
    """A one-node cluster: the gateway serves the console, a team's key signs in, its sandbox
    is listed and its terminal works through the gateway's sandbox relay."""
    from tests.control.cluster import LocalCluster

    cluster = LocalCluster(tmp_path / "cluster", nodes=1)
    shots: list[Path] = []
    try:
        cluster.start()
        key = cluster.team("alpha")
        with httpx.Client(base_url=cluster.url, headers={"X-API-KEY": key}, timeout=60,
                          trust_env=False) as api:
            made = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600})
            assert made.status_code == 201, made.text
            sid = made.json()["sandboxID"]
        with console_page(browser) as (page, complaints):
            page.goto(cluster.url + "/console")
            page.fill("#api-key", key)
            page.click("#login button[type=submit]")
            page.click(f"#sandbox-list tr[data-id='{sid}'] a")
            page.click("#open-terminal")
            page.wait_for_selector("#terminal-status:has-text('connected')")
            page.click("#terminal")
            page.keyboard.type("echo hi")
            page.keyboard.press("Enter")
            page.wait_for_function(
                "() => document.querySelector('#terminal').textContent.split('\\n')"
                ".some(line => line.trim() === 'hi')")
            shot(page, tmp_path, "gateway-terminal", shots)
            page.click("#nav a[data-page=nodes]")
            page.wait_for_selector("section.node[data-id=node0]")
            shot(page, tmp_path, "gateway-nodes", shots)
            # what a page shows of a route the gateway does not relay (yet) is its 404; any
            # other failure is the console's
            assert not [c for c in complaints if not c.startswith("404 ")
                        and "status of 404" not in c], complaints
    finally:
        cluster.stop()
