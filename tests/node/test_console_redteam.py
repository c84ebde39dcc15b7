"""Red-team checks of the web console's origin (docs/security.md, docs/console.md): what else
the console's origin serves must not run script in it. A real node (process backend) and
Debian's headless Chromium, as tests/node/test_console.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.node.conftest import NodeProcess, sdk_pointed_at
from tests.node.test_console import browser, console_page, sign_in  # noqa: F401 (fixture)

#: a page a sandbox's user (or its guest's root) writes into the sandbox; script run by it in the
#: console's origin reads the API key the console keeps in this tab's sessionStorage
STEAL = ("<!doctype html><title>file</title><script>"
         "document.title = 'stolen:' + sessionStorage.getItem('aenv-console-key');"
         "</script>")


def test_a_signed_file_url_runs_no_script_in_the_console_origin(
        browser: Any, node: NodeProcess) -> None:  # noqa: F811 (fixture)
    """A signed /files URL is served on the API's origin (E2B_SANDBOX_URL = the API URL, the
    node's and the gateway's shared sandbox address), the console's origin: a .html file of
    any sandbox, opened in the tab the console signed in, ran its script there and read the
    key (or registered a service worker for the whole origin)."""
    from e2b import Sandbox

    with sdk_pointed_at(node):
        sbx = Sandbox.create(timeout=120)
    try:
        sbx.files.write("/tmp/page.html", STEAL)
        url = sbx.download_url("/tmp/page.html")
        assert url.startswith(node.url + "/files?"), url
        with console_page(browser) as (page, _):
            sign_in(page, node, node.api_key)
            page.wait_for_selector("#sandbox-list")
            page.goto(url)  # the same tab: its sessionStorage holds the key
            page.wait_for_load_state("load")
            assert not page.title().startswith("stolen:"), "a sandbox's file read the API key"
            assert node.api_key not in page.title()
        # the file itself still comes, as bytes the browser shows without running them
        with httpx.Client(trust_env=False, timeout=30) as client:
            served = client.get(url)
        assert served.status_code == 200 and served.text == STEAL
        assert served.headers["content-security-policy"] == "sandbox"
    finally:
        sbx.kill()


def test_another_teams_signed_file_cannot_read_a_key_through_the_gateway(
        browser: Any, tmp_path: Path) -> None:  # noqa: F811 (fixture)
    """A cluster: team beta (a key holder of another team) writes a page into its own
    sandbox and signs its URL on the gateway, the origin where team alpha's console signed in.
    Opened in alpha's tab, it must run no script: it read alpha's key."""
    from e2b import Sandbox

    from tests.control.cluster import LocalCluster
    from tests.node.conftest import environ_set

    cluster = LocalCluster(tmp_path / "cluster", nodes=1)
    try:
        cluster.start()
        alpha, beta = cluster.team("alpha"), cluster.team("beta")
        with environ_set({"E2B_API_URL": cluster.url, "E2B_SANDBOX_URL": cluster.url,
                          "E2B_API_KEY": beta}):
            sbx = Sandbox.create(timeout=300)
            sbx.files.write("/tmp/page.html", STEAL)
            url = sbx.download_url("/tmp/page.html")
        assert url.startswith(cluster.url + "/files?"), url
        with console_page(browser) as (page, _):
            page.goto(cluster.url + "/console")
            page.fill("#api-key", alpha)
            page.click("#login button[type=submit]")
            page.wait_for_selector("#sandbox-list")
            page.goto(url)
            page.wait_for_load_state("load")
            assert alpha not in page.title(), "team beta's file read team alpha's key"
        with httpx.Client(trust_env=False, timeout=30) as client:
            served = client.get(url)
        assert served.status_code == 200 and served.text == STEAL
        assert served.headers["content-security-policy"] == "sandbox"
    finally:
        cluster.stop()


def test_a_guests_escape_sequences_cannot_hang_the_terminal(
        browser: Any, node: NodeProcess) -> None:  # noqa: F811 (fixture)
    """What a sandbox prints reaches term.js's Screen: a count in a CSI sequence (scroll up
    `ESC[<n>S`, down `T`, insert or delete lines `L` `M`, characters `@` `P`) was used as is,
    so one line of output (`printf '\\e[999999999S'`, or a file a user `cat`s) looped a billion
    times on the page's thread (or, with `@`, built a billion-cell array): the console's tab
    froze. Counts are bounded by the screen's size now. (`@` comes last: unfixed, the first
    sequence never ends, so the gigabytes `@` would take are never asked for.)"""
    with console_page(browser) as (page, _):
        page.goto(node.url + "/console")
        page.evaluate("""() => { window.fed = undefined; setTimeout(async () => {
            const { Screen } = await import('/console/term.js');
            const screen = new Screen(100, 28);
            screen.write('top\\r\\n\\x1b[999999999S\\x1b[999999999T\\x1b[999999999L'
                         + '\\x1b[999999999M\\x1b[999999999P\\x1b[999999999@end');
            window.fed = screen.lines().length;
        }, 0); }""")
        page.wait_for_function("() => window.fed !== undefined", timeout=30_000)
        assert page.evaluate("() => window.fed") <= 28 + 2000  # the screen and scrollback


def test_a_teams_metadata_is_shown_as_text(browser: Any, node: NodeProcess) -> None:  # noqa: F811
    """Metadata keys and values (a team's own, or a guest's through its parent's API use) are
    shown in the list and on the sandbox's page as text: markup in them runs nothing."""
    payload = "<img src=x onerror=\"document.title='xss'\"><script>document.title='xss'</script>"
    with httpx.Client(base_url=node.url, headers={"X-API-KEY": node.api_key}, timeout=60,
                      trust_env=False) as api:
        made = api.post("/sandboxes", json={"templateID": "base", "timeout": 300,
                                            "metadata": {payload: payload}})
        assert made.status_code == 201, made.text
        sid = made.json()["sandboxID"]
        try:
            with console_page(browser) as (page, _):
                sign_in(page, node, node.api_key)
                row = page.wait_for_selector(f"#sandbox-list tr[data-id='{sid}']")
                assert payload in row.text_content()
                page.click(f"#sandbox-list tr[data-id='{sid}'] a")
                page.wait_for_selector(f"#sandbox-id:has-text('{sid}')")
                page.wait_for_selector(".facts:has-text('onerror')")
                assert page.title() != "xss" and page.query_selector("main img") is None
        finally:
            api.delete(f"/sandboxes/{sid}")
