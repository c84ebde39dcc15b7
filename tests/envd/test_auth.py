"""The access token rule, /init, /envs, /metrics and signed /files URLs."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from e2b import AuthenticationException

from tests.envd.conftest import start_envd

pytestmark = pytest.mark.root


def test_access_token_rule(fresh_envd) -> None:
    server = fresh_envd()
    token = "secret-token"
    hostname = os.uname().nodename
    reply = httpx.post(
        f"{server.url}/init",
        json={
            "accessToken": token,
            "envVars": {"FROM_INIT": "yes"},
            "defaultWorkdir": "/data",
            # With a root other than `/`, envd must leave this machine's clock and name alone.
            "timestamp": "2001-01-01T00:00:00.123456789Z",
            "hostname": "guest-name",
        },
    )
    assert reply.status_code == 204
    assert os.uname().nodename == hostname
    assert time.gmtime().tm_year > 2001
    assert reply.headers["x-envd-version"] == "0.6.4"

    good = server.sandbox(token=token)
    assert good.commands.run("echo $FROM_INIT; pwd").stdout == "yes\n/data\n"
    good.files.write("/data/t.txt", "t")
    assert good.files.read("/data/t.txt") == "t"
    assert good.is_running() is True

    for bad in (server.sandbox(token=None), server.sandbox(token="wrong")):
        assert bad.is_running() is True  # /health needs no token
        with pytest.raises(AuthenticationException):
            bad.commands.run("true")
        with pytest.raises(AuthenticationException):
            bad.commands.list()
        with pytest.raises(AuthenticationException):
            bad.files.list("/data")
        with pytest.raises(AuthenticationException):
            bad.files.read("/data/t.txt")
        with pytest.raises(AuthenticationException):
            bad.files.write("/data/t.txt", "overwrite")
    assert good.files.read("/data/t.txt") == "t"

    assert httpx.get(f"{server.url}/envs").status_code == 401
    envs = httpx.get(f"{server.url}/envs", headers={"X-Access-Token": token})
    assert envs.json() == {"FROM_INIT": "yes"}
    reply = httpx.post(f"{server.url}/process.Process/List", json={}, headers={"Content-Type": "application/json"})
    assert reply.status_code == 401
    assert reply.json()["code"] == 401

    # /init cannot take the sandbox over without the current token.
    assert httpx.post(f"{server.url}/init", json={"accessToken": "mine"}).status_code == 401
    again = httpx.post(f"{server.url}/init", json={"accessToken": token}, headers={"X-Access-Token": token})
    assert again.status_code == 204


def test_signed_urls(fresh_envd) -> None:
    server = fresh_envd()
    token = "sign-token"
    assert httpx.post(f"{server.url}/init", json={"accessToken": token}).status_code == 204
    sandbox = server.sandbox(token=token)

    upload_url = sandbox.upload_url("/data/signed.txt", use_signature_expiration=60)
    reply = httpx.post(upload_url, files={"file": ("/data/signed.txt", b"signed body")})
    assert reply.status_code == 200, reply.text
    download_url = sandbox.download_url("/data/signed.txt")
    reply = httpx.get(download_url)
    assert reply.status_code == 200
    assert reply.content == b"signed body"

    tampered = download_url.replace("signed.txt", "other.txt")
    assert httpx.get(tampered).status_code == 401
    expired = sandbox.download_url("/data/signed.txt", use_signature_expiration=-10)
    reply = httpx.get(expired)
    assert reply.status_code == 401
    assert "expired" in reply.json()["message"]


def test_metrics(fresh_envd) -> None:
    server = fresh_envd()
    metrics = httpx.get(f"{server.url}/metrics").json()
    assert set(metrics) == {
        "ts", "cpu_count", "cpu_used_pct", "mem_total", "mem_used", "mem_cache",
        "mem_total_mib", "mem_used_mib", "disk_used", "disk_total",
    }
    assert metrics["mem_total"] > metrics["mem_used"] > 0
    assert metrics["disk_total"] >= metrics["disk_used"] > 0
    assert abs(metrics["ts"] - time.time()) < 5


def test_sync_saves_defaults_for_the_next_start(fresh_envd) -> None:
    """/aenv/sync (before a filesystem-only pause) leaves /init's defaults on the root's disk,
    without the token; an envd started again on that root (a cold boot) takes them back."""
    server = fresh_envd()
    token = "tok-sync"
    init = {"accessToken": token, "envVars": {"KEPT": "yes"}, "defaultUser": "root",
            "defaultWorkdir": "/tmp"}
    assert httpx.post(f"{server.url}/init", json=init).status_code == 204
    assert httpx.post(f"{server.url}/aenv/sync").status_code == 401  # token-protected
    assert httpx.get(f"{server.url}/aenv/sync", headers={"X-Access-Token": token}).status_code == 405
    assert httpx.post(f"{server.url}/aenv/sync", headers={"X-Access-Token": token}).status_code == 204
    saved = server.root / "var/lib/aenv/envd-defaults.json"
    assert saved.stat().st_mode & 0o777 == 0o600
    assert token not in saved.read_text()
    assert json.loads(saved.read_text()) == {"defaultUser": "root", "defaultWorkdir": "/tmp",
                                             "envVars": {"KEPT": "yes"}}
    server.stop()
    again = start_envd(server.root, server.log_path.parent)
    try:
        assert httpx.get(f"{again.url}/envs").json() == {"KEPT": "yes"}  # no token until /init
        sbx = again.sandbox()
        assert sbx.commands.run("pwd; whoami").stdout.split() == ["/tmp", "root"]
    finally:
        again.stop()


def test_init_volume_mounts_are_checked_and_refused_outside_a_vm(fresh_envd) -> None:
    """/init's volumeMounts (our extension, docs/volumes.md §6): malformed ones are a 400; an
    envd that is not in a VM (a root other than `/`) mounts nothing and says so."""
    server = fresh_envd()
    for bad in ({"volumeMounts": "x"}, {"volumeMounts": [{"serial": "aenv-vol0"}]},
                {"volumeMounts": [{"serial": "aenv-vol0", "path": "rel", "readOnly": True}]},
                {"volumeMounts": [{"serial": "a/b", "path": "/mnt", "readOnly": True}]}):
        reply = httpx.post(f"{server.url}/init", json=bad)
        assert reply.status_code == 400 and "volume" in reply.json()["message"].lower(), bad
    reply = httpx.post(f"{server.url}/init", json={"volumeMounts": [
        {"serial": "aenv-vol0", "path": "/mnt/data", "readOnly": True}]})
    assert reply.status_code == 400 and "does not run in a VM" in reply.json()["message"]
    assert httpx.post(f"{server.url}/init", json={"volumeMounts": []}).status_code == 204
