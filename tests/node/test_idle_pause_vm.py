"""Idle pause with a real VM (the shared VM node) and the official SDK unchanged: the sandbox
sets its idlePauseAfter through metadata (what an unchanged SDK can send), idles past it and
is paused with its memory (the API and the events say so); a command, a file read and an
HTTP request to a server in it each resume it and succeed, its processes where they were;
a command that streams for longer than the setting keeps it running. One VM."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from agentenv.node.idle import IDLE_PAUSE_METADATA

from .conftest import NodeProcess, sdk_pointed_at

pytestmark = pytest.mark.qemu  # boots VMs

IDLE_AFTER = 3
#: generous: a pause of a VM on a loaded 2-core host takes seconds, not minutes
DEADLINE = 120.0


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {DEADLINE:.0f} s"
        time.sleep(0.2)


def test_idle_vm_pauses_and_every_kind_of_request_resumes_it(
        shared_vm_node: NodeProcess) -> None:
    node = shared_vm_node
    with sdk_pointed_at(node), node.client() as api:
        sbx = Sandbox.create(template="base", timeout=600,
                             metadata={IDLE_PAUSE_METADATA: str(IDLE_AFTER)})
        sid = sbx.sandbox_id
        try:
            def events(kind: str) -> list[dict[str, Any]]:
                return [e for e in api.get(f"/events/sandboxes/{sid}",
                                           params={"limit": 100, "orderAsc": "true"}).json()
                        if e["type"] == f"sandbox.lifecycle.{kind}"]

            seen = [0]  # paused events so far

            def idle_paused() -> None:
                """Wait until the node has paused it again (it ran since the last call; its
                event is stored just after the pause): for idleness, with its memory, as
                every pause of it."""
                _wait(lambda: api.get(f"/sandboxes/{sid}").json()["state"] == "paused"
                      and len(events("paused")) > seen[0], "an idle pause")
                pauses = events("paused")
                seen[0] = len(pauses)
                assert {p["eventData"]["reason"] for p in pauses} == {"idle"}
                assert pauses[-1]["eventData"]["pause_mode"] == "full"  # memory kept

            detail = api.get(f"/sandboxes/{sid}").json()
            assert detail["lifecycle"]["idlePauseAfter"] == IDLE_AFTER
            sbx.files.write("/tmp/www/index.html", "served from the guest")
            sbx.files.write("/home/user/note.txt", "kept in the guest")
            # a server with no command stream attached: it keeps nothing awake
            sbx.commands.run("nohup python3 -m http.server 8080 --directory /tmp/www "
                             ">/dev/null 2>&1 &")
            _wait(lambda: sbx.commands.run("curl -s localhost:8080/ || true").stdout
                  == "served from the guest", "the guest's web server")

            idle_paused()
            ran = sbx.commands.run("cat /home/user/note.txt")  # a command resumes it
            assert ran.stdout == "kept in the guest"
            assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
            _wait(lambda: bool(events("resumed")), "the resumed event")
            assert events("resumed")[-1]["eventData"]["idle_pause"] is True

            idle_paused()
            assert sbx.files.read("/home/user/note.txt") == "kept in the guest"  # a file read

            idle_paused()  # an HTTP request to the server in it: still there, it answers
            page = httpx.get(node.url + "/", trust_env=False, timeout=DEADLINE,
                             headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8080"})
            assert page.status_code == 200 and page.text == "served from the guest"

            # A command that streams (silently) for 3 x the setting: it resumes it and keeps
            # it running until it ends.
            idle_paused()
            long = sbx.commands.run(f"sleep {3 * IDLE_AFTER}; echo finished",
                                    timeout=DEADLINE)
            finished = time.time()
            assert long.stdout == "finished\n"
            began = _seconds(events("resumed")[-1]["timestamp"])
            assert finished - began >= 3 * IDLE_AFTER - 1  # it was resumed by this command
            assert not [p for p in events("paused") if began <= _seconds(p["timestamp"])
                        <= finished], "paused while the command's stream was open"
            idle_paused()
            pauses = len(events("paused"))

            metrics = api.get("/metrics").text
            assert _metric(metrics, "aenv_node_idle_pauses_total") >= pauses >= 5
            assert _metric(metrics, "aenv_node_idle_resumes_total") >= pauses - 1
        finally:
            sbx.kill()


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")
