"""Template builds through the official e2b SDK against a VM-backend node (the build flow of
docs/e2b-api.md §1.7, steps 1-4): an image pushed to a real registry on loopback, built with
RUN/WORKDIR/ENV/COPY and a start + ready command, then sandboxes made from it; a failing RUN
step; a template built from another template; and the raw routes (files upload, status logs,
tags, list/get/delete)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.template import helpers
from tests.template.conftest import Registry

from . import conftest
from .conftest import NodeProcess

pytestmark = [pytest.mark.qemu, pytest.mark.root, pytest.mark.slow]

CACHE = Path("/var/cache/aenv-test/template-build")  # converted layers, the test image's tar
NET_PREFIX = "atb"  # unique: a test teardown deletes every {NET_PREFIX}-s* namespace
FIRST_SLOT = 27001  # disjoint from test_vm_backend (24001), bench/api_bench (26001), tests/runtime (1)
IMAGE_LAYOUT = "1"  # bump when the test image's content changes
EXTRA_PROGRAMS = ("pgrep", "ps", "id", "whoami", "stat")


def _host_image_tar() -> bytes:
    """A root of this host's bash/coreutils/procps binaries and their libraries, as a tar layer
    (cached: its bytes name the converted layer in the layer cache)."""
    from agentenv.node.host_template import (
        LAYOUT_VERSION,
        _copy_into,
        _shared_libraries,
        build_host_rootfs,
    )

    cached = CACHE / f"host-root-{LAYOUT_VERSION}-{IMAGE_LAYOUT}.tar"
    if cached.is_file():
        return cached.read_bytes()
    CACHE.mkdir(parents=True, exist_ok=True)
    work = CACHE / f"work-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        root = build_host_rootfs(work / "root")
        extra = [p for p in (shutil.which(n) for n in EXTRA_PROGRAMS) if p]
        for program in extra:
            _copy_into(root, program)
        for lib in sorted(set(_shared_libraries(extra))):
            _copy_into(root, lib)
        data = helpers.tar_directory(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(cached)
    return data


@pytest.fixture(scope="module")
def image(registry: Registry) -> str:
    """`<registry>/aenv-build/hostroot:v1`: one uncompressed layer, no User, no WorkingDir."""
    layer = _host_image_tar()
    built = helpers.build_image([layer], [""], config_extra={
        "User": "", "WorkingDir": "", "Cmd": ["/bin/bash"],
        "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "FROM_IMAGE=yes"]})
    registry.push("aenv-build/hostroot", "v1", built)
    return f"{registry.host}/aenv-build/hostroot:v1"


@pytest.fixture(scope="module")
def build_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    with conftest.template_build_node(tmp_path_factory.mktemp("buildnode"), NET_PREFIX,
                                      FIRST_SLOT, CACHE / "layer-cache") as node:
        yield node


@pytest.fixture(scope="module")
def context_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ctx = tmp_path_factory.mktemp("context")
    (ctx / "hello.txt").write_text("hello from the build context\n")
    (ctx / "payload").mkdir()
    (ctx / "payload" / "run.sh").write_text("#!/bin/bash\necho payload-ran\n")
    (ctx / "payload" / "sub").mkdir()
    (ctx / "payload" / "sub" / "data.bin").write_bytes(bytes(range(256)) * 64)
    return ctx


def _build_qemus(node: NodeProcess) -> list[str]:
    out = subprocess.run(["pgrep", "-f", f"qemu-system.*{node.state_dir}"], capture_output=True,
                         text=True).stdout
    return out.split()


@pytest.fixture(scope="module")
def built(build_node: NodeProcess, image: str, context_dir: Path) -> dict[str, str]:
    """Step 1 of the reference flow: the template, built once for the module."""
    from e2b import Template

    suffix = uuid.uuid4().hex[:8]
    workdir = f"/home/user/agentenv-e2e-{suffix}"
    marker, startup = f"marker-{suffix}", f"startup-{suffix}"
    name = f"e2e-build-{suffix}"
    template = (
        Template(file_context_path=str(context_dir))
        .from_image(image)
        .run_cmd(f"mkdir -p {workdir}")
        .set_workdir(workdir)
        .set_envs({"AENV_MARKER": marker})
        .run_cmd('printf "%s" "$AENV_MARKER" > marker.txt')
        .run_cmd("pwd > workdir.txt; echo build-output-line")
        .copy("hello.txt", "copied/hello.txt")
        .copy("payload", "/opt/payload/", mode=0o755)
        .set_envs({"AENV_STARTUP": startup})
        .set_start_cmd(
            f'printf "%s" "$AENV_STARTUP" > startup-ready.txt; '
            f"exec -a agentenv-startup-{startup} sleep 1000000",
            f"test -f startup-ready.txt && grep -qx {startup} startup-ready.txt",
        )
    )
    logs: list[str] = []
    t0 = time.monotonic()
    info = Template.build(template, name, cpu_count=1, memory_mb=512, skip_cache=True,
                          on_build_logs=lambda entry: logs.append(str(entry.message)))
    seconds = time.monotonic() - t0
    print(f"\ntemplate build from image: {seconds:.1f} s")
    assert info.template_id and info.build_id and info.name == name
    assert any("build-output-line" in line for line in logs), logs[-20:]
    assert not _build_qemus(build_node), "the build VM still runs after the build"
    return {"name": name, "template_id": info.template_id, "build_id": info.build_id,
            "workdir": workdir, "marker": marker, "startup": startup,
            "seconds": f"{seconds:.1f}"}


def _retry_run(sbx: object, cmd: str, **kwargs: object) -> object:
    """The reference retries the first commands for a few seconds."""
    for attempt in range(10):
        try:
            return sbx.commands.run(cmd, **kwargs)  # type: ignore[attr-defined]
        except Exception:
            if attempt == 9:
                raise
            time.sleep(1)
    raise AssertionError("unreachable")


def test_sandbox_from_built_template(built: dict[str, str]) -> None:
    """Steps 2-4: a sandbox of the template has the files, the workdir, the env, the copied
    files, and the start process running (restored from the template's snapshot)."""
    from e2b import Sandbox, Template

    assert Template.exists(built["name"]) is True
    sbx = Sandbox.create(template=built["name"], timeout=120, metadata={"suite": "build"})
    try:
        listed = Sandbox.list(limit=20).next_items()
        assert sbx.sandbox_id in {s.sandbox_id for s in listed}
        workdir = built["workdir"]
        procs = _retry_run(sbx, f"pgrep -af ^agentenv-startup-{built['startup']}", cwd=workdir)
        assert procs.stdout.strip(), "the start process is not running in the sandbox"
        result = sbx.commands.run(
            "cat marker.txt; echo; cat workdir.txt; cat startup-ready.txt; echo; pwd; whoami;"
            " echo $AENV_MARKER $AENV_STARTUP $FROM_IMAGE")
        lines = result.stdout.splitlines()
        assert lines == [built["marker"], workdir, built["startup"], workdir, "user",
                         f"{built['marker']} {built['startup']} yes"], lines
        copied = sbx.commands.run(
            f"cat {workdir}/copied/hello.txt; stat -c '%U %a' {workdir}/copied/hello.txt "
            "/opt/payload/run.sh; /opt/payload/run.sh; md5sum /opt/payload/sub/data.bin")
        out = copied.stdout.splitlines()
        assert out[0] == "hello from the build context"
        assert out[1] == "user 644" and out[2] == "user 755"
        assert out[3] == "payload-ran"
        assert out[4].split()[0] == hashlib.md5(bytes(range(256)) * 64).hexdigest()
        # The SDK names no cold-memory setting: the node's (30 s) came with the snapshot.
        assert _damon(sbx) == ["on", "15"]
    finally:
        sbx.kill()


def _damon(sbx: object) -> list[str]:
    """The guest's DAMON pageout scheme: its state and minimum age (2 s aggregations)."""
    return sbx.commands.run(  # type: ignore[attr-defined]
        "cd /sys/kernel/mm/damon/admin/kdamonds/0; cat state"
        " contexts/0/schemes/0/access_pattern/age/min", user="root").stdout.split()[:2]


def test_failing_run_step_fails_the_build(build_node: NodeProcess, built: dict[str, str]) -> None:
    """A RUN step exiting 7: status `error`, reason with the step and the exit code and output;
    no template is registered and no VM is left."""
    from e2b import Template
    from e2b.exceptions import BuildException

    name = f"{built['name']}-broken"
    template = (Template().from_template(built["name"])
                .run_cmd("echo fine")
                .run_cmd("echo about-to-fail; exit 7")
                .run_cmd("echo never-runs"))
    with pytest.raises(BuildException) as raised:
        Template.build(template, name, skip_cache=True)
    assert "exit code 7" in str(raised.value) and "about-to-fail" in str(raised.value)
    with httpx.Client(base_url=build_node.url, headers={"X-API-KEY": build_node.api_key},
                      timeout=30) as api:
        listed = {t["names"][0]: t for t in api.get("/templates").json()}
        broken = listed[name]
        assert broken["buildStatus"] == "error"
        status = api.get(f"/templates/{broken['templateID']}/builds/{broken['buildID']}/status",
                         params={"logsOffset": 0}).json()
        assert status["status"] == "error"
        assert status["reason"]["step"] == "2"
        assert "exit code 7" in status["reason"]["message"]
        messages = [e["message"] for e in status["logEntries"]]
        assert "about-to-fail" in messages and "never-runs" not in messages
        assert all(e["level"] in ("debug", "info", "warn", "error") for e in status["logEntries"])
        later = api.get(f"/templates/{broken['templateID']}/builds/{broken['buildID']}/status",
                        params={"logsOffset": len(status["logEntries"])}).json()
        assert later["logEntries"] == []
        assert Template.exists(name) is False
        create = api.post("/v2/sandboxes", json={"templateID": name})
        assert create.status_code in (400, 404), create.text
        assert api.delete(f"/templates/{broken['templateID']}").status_code == 204
        assert name not in {t["names"][0] for t in api.get("/templates").json()}
    assert not _build_qemus(build_node), "the failed build left its VM running"


def test_template_from_template(build_node: NodeProcess, built: dict[str, str]) -> None:
    """Step 7: a template built from the first keeps its files, workdir, env and start process."""
    from e2b import Sandbox, Template

    name = f"{built['name']}-child"
    template = (Template().from_template(built["name"])
                .set_envs({"CHILD_ENV": "child"})
                .run_cmd("printf child > child.txt")
                .set_user("root")
                .run_cmd("whoami > /root/who.txt"))
    t0 = time.monotonic()
    info = Template.build(template, name, skip_cache=True)
    print(f"\ntemplate build from template: {time.monotonic() - t0:.1f} s")
    sbx = Sandbox.create(template=name, timeout=120)
    try:
        workdir = built["workdir"]
        result = _retry_run(sbx, "cat child.txt; echo; cat marker.txt; echo; pwd; whoami;"
                                 " cat /root/who.txt; echo $CHILD_ENV $AENV_MARKER")
        assert result.stdout.splitlines() == [
            "child", built["marker"], workdir, "root", "root", f"child {built['marker']}"]
        procs = sbx.commands.run(f"pgrep -af ^agentenv-startup-{built['startup']}")
        assert procs.stdout.strip()
    finally:
        sbx.kill()
    # The parent is untouched by its child's build.
    parent = Sandbox.create(template=built["name"], timeout=60)
    try:
        check = _retry_run(parent, "test -e child.txt && echo yes || echo no; whoami")
        assert check.stdout.split() == ["no", "user"]
    finally:
        parent.kill()
    assert Sandbox.delete_snapshot(info.template_id) is True


def test_routes_files_tags_and_errors(build_node: NodeProcess, built: dict[str, str]) -> None:
    """The raw routes: upload by hash through the signed URL, tags, and bad requests."""
    with httpx.Client(base_url=build_node.url, headers={"X-API-KEY": build_node.api_key},
                      timeout=30) as api:
        tid = built["template_id"]
        files_hash = hashlib.sha256(b"routes-test").hexdigest()
        link = api.get(f"/templates/{tid}/files/{files_hash}")
        assert link.status_code == 201 and link.json()["present"] is False
        url = link.json()["url"]
        with httpx.Client(timeout=30) as plain:  # no API key: the URL carries the permission
            assert plain.put(url, content=b"not really a tar").status_code == 200
            assert plain.put(url.replace("signature=", "signature=0"),
                             content=b"x").status_code == 403
        # kept, not verified: it counts as present only once a build's step matched it
        # (tests/node/test_template_uploads.py)
        assert api.get(f"/templates/{tid}/files/{files_hash}").json()["present"] is False
        assert api.get(f"/templates/{tid}/files/nope$").status_code in (400, 404)
        assert api.get("/templates/unknown-template/files/abc").status_code == 404

        detail = api.get(f"/templates/{built['name']}").json()
        assert detail["templateID"] == tid and detail["buildStatus"] == "ready"
        assert detail["builds"][0]["buildID"] == built["build_id"]
        assert api.get(f"/templates/aliases/{built['name']}").json()["templateID"] == tid
        tags = api.get(f"/templates/{tid}/tags").json()
        assert tags == [{"tag": "default", "buildID": built["build_id"],
                         "createdAt": tags[0]["createdAt"]}]
        assigned = api.post("/templates/tags", json={"target": f"{built['name']}:default",
                                                     "tags": ["prod"]})
        assert assigned.status_code == 201, assigned.text
        assert assigned.json() == {"tags": ["prod"], "buildID": built["build_id"]}
        assert api.request("DELETE", "/templates/tags", json={
            "name": built["name"], "tags": ["prod"]}).status_code == 204
        assert [t["tag"] for t in api.get(f"/templates/{tid}/tags").json()] == ["default"]

        assert api.post("/v3/templates", json={"name": "bad name!"}).status_code == 400
        assert api.post("/v3/templates", json={"name": "x", "tags": ["Bad tag!"]}).status_code == 400
        assert api.post("/v3/templates", json={"name": "base"}).status_code == 400
        created = api.post("/v3/templates", json={"name": f"{built['name']}-routes"}).json()
        start = f"/v2/templates/{created['templateID']}/builds/{created['buildID']}"
        both = api.post(start, json={"fromImage": "a", "fromTemplate": "b", "steps": []})
        assert both.status_code == 400
        bad_step = api.post(start, json={"fromTemplate": built["name"],
                                         "steps": [{"type": "ENV", "args": ["ONLY_KEY"]}]})
        assert bad_step.status_code == 400 and "key, value" in bad_step.json()["message"]
        no_files = api.post(start, json={"fromTemplate": built["name"], "steps": [
            {"type": "COPY", "args": ["a", "/a"], "filesHash": "0" * 64}]})
        assert no_files.status_code == 400 and "not uploaded" in no_files.json()["message"]
        unknown = api.post(f"/v2/templates/{created['templateID']}/builds/{uuid.uuid4()}",
                           json={"fromTemplate": built["name"], "steps": []})
        assert unknown.status_code == 404
        with contextlib.suppress(Exception):
            assert api.delete(f"/templates/{created['templateID']}").status_code == 204


def _aenv(node: NodeProcess, *args: str) -> subprocess.CompletedProcess[str]:
    import sys

    return subprocess.run(
        [sys.executable, "-m", "agentenv.cli.main", "template", "--api-url", node.url,
         "--api-key", node.api_key, *args],
        capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("E2B_")})


def test_cli_build_rebuild_and_failure(build_node: NodeProcess, built: dict[str, str],
                                       tmp_path: Path) -> None:
    """`aenv template build` with a build file and a COPY; a rebuild under the same name
    replaces the template (same id, new build); a failing step exits 1 with one line."""
    from e2b import Sandbox

    (tmp_path / "notes.txt").write_text("copied by the cli\n")
    (tmp_path / "aenv.build").write_text(
        f"FROM template {built['name']}\n"
        "ENV CLI_VERSION=1\n"
        "COPY --chmod=0600 notes.txt cli/\n"
        "RUN echo cli-run-output && \\\n    printf \"$CLI_VERSION\" > cli/version\n")
    name = f"{built['name']}-cli"
    first = _aenv(build_node, "build", name, "-f", str(tmp_path / "aenv.build"))
    assert first.returncode == 0, first.stderr
    template_id = first.stdout.strip().splitlines()[-1]
    assert "cli-run-output" in first.stderr and "ready" in first.stderr
    assert "uploaded" in first.stderr

    again = _aenv(build_node, "build", name, "-f", str(tmp_path / "aenv.build"),
                  "--env", "CLI_VERSION=2", "--run", 'printf "$CLI_VERSION" > cli/version',
                  "--reclaim-after", "0")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip().splitlines()[-1] == template_id  # same template, new build
    assert "already on the node" in again.stderr  # the COPY files were not uploaded twice
    with httpx.Client(base_url=build_node.url, headers={"X-API-KEY": build_node.api_key},
                      timeout=30) as api:
        detail = api.get(f"/templates/{name}").json()
        # The rebuild took "default": the first build, named by no tag, was released.
        assert [b["status"] for b in detail["builds"]] == ["ready"]
        assert detail["buildCount"] == 1
    sbx = Sandbox.create(template=name, timeout=60)
    try:
        result = _retry_run(sbx, f"cat {built['workdir']}/cli/version; echo;"
                                 f" cat {built['workdir']}/cli/notes.txt; echo $CLI_VERSION")
        assert result.stdout.splitlines() == ["2", "copied by the cli", "2"]
        # --reclaim-after 0: this template keeps its page cache (its base reclaims).
        assert _damon(sbx)[0] == "off"
    finally:
        sbx.kill()

    failed = _aenv(build_node, "build", f"{name}-bad", "--from-template", built["name"],
                   "--run", "echo going-down; exit 3")
    assert failed.returncode == 1
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("aenv: error: build of") and "exit code 3" in last
    assert "Traceback" not in failed.stderr

    listed = _aenv(build_node, "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    by_name = {t["names"][0]: t for t in json.loads(listed.stdout)}
    assert by_name[name]["templateID"] == template_id
    # one build kept: the first was released when the rebuild took "default"
    assert by_name[name]["buildStatus"] == "ready" and by_name[name]["buildCount"] == 1
    assert by_name[f"{name}-bad"]["buildStatus"] == "error"
    removed = _aenv(build_node, "rm", name, f"{name}-bad")
    assert removed.returncode == 0, removed.stderr
    assert not _build_qemus(build_node)


def test_templates_and_build_logs_survive_a_node_restart(build_node: NodeProcess,
                                                         built: dict[str, str]) -> None:
    """Runs last: after a graceful restart the template still makes sandboxes and its build's
    status and logs are still served."""
    from e2b import Sandbox

    assert build_node.stop() in (0, -15)
    build_node.start()
    with httpx.Client(base_url=build_node.url, headers={"X-API-KEY": build_node.api_key},
                      timeout=30) as api:
        route = f"/templates/{built['template_id']}/builds/{built['build_id']}/status"
        messages: list[str] = []
        while True:  # 100 entries per call, as the SDK pages them
            status = api.get(route, params={"logsOffset": len(messages)})
            assert status.status_code == 200 and status.json()["status"] == "ready"
            entries = status.json()["logEntries"]
            if not entries:
                break
            messages += [e["message"] for e in entries]
        assert "build-output-line" in messages
    sbx = Sandbox.create(template=built["name"], timeout=60)
    try:
        result = _retry_run(sbx, f"cat {built['workdir']}/marker.txt")
        assert result.stdout == built["marker"]
        assert sbx.commands.run(f"pgrep -f ^agentenv-startup-{built['startup']}").stdout.strip()
    finally:
        sbx.kill()


def test_a_build_from_a_hostile_registry_reaches_nothing_inside(build_node: NodeProcess) -> None:
    """fromImage names a registry that redirects into the node's own network (loopback by its
    IPv4-mapped IPv6 address, which the test environment's AENV_REGISTRY_ALLOW_PRIVATE does not
    name): the build fails naming the refusal, and nothing reached the target."""
    from tests.template.test_registry_hostile import serve

    target = serve(lambda path: (200, {}, b"inside"))
    hostile = serve(lambda path: (200, {}, b"{}") if path == "/v2/" else (
        307, {"Location": f"http://[::ffff:127.0.0.1]:{target.port}/latest/meta-data"}, b""))
    try:
        with httpx.Client(base_url=build_node.url, headers={"X-API-KEY": build_node.api_key},
                          timeout=30) as api:
            made = api.post("/v3/templates", json={"name": f"hostile-{uuid.uuid4().hex[:6]}"})
            tid, bid = made.json()["templateID"], made.json()["buildID"]
            start = api.post(f"/v2/templates/{tid}/builds/{bid}", json={
                "fromImage": f"127.0.0.1:{hostile.port}/img:latest", "steps": []})
            assert start.status_code == 202, start.text
            deadline = time.monotonic() + 120
            while (status := api.get(f"/templates/{tid}/builds/{bid}/status").json()
                   )["status"] not in ("ready", "error") and time.monotonic() < deadline:
                time.sleep(0.2)
            assert status["status"] == "error", status
            assert "refused to connect to ::ffff:127.0.0.1" in status["reason"]["message"]
            assert target.hits == []
            api.delete(f"/templates/{tid}")
    finally:
        hostile.server.shutdown()
        target.server.shutdown()
