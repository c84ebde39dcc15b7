"""`aenv` commands of the template subsystem: `aenv pull` and `aenv template build|ls|rm`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import click
import httpx
from rich.console import Console
from rich.table import Table

from agentenv.cli.node import DEFAULT_URL, Client, node_api_options, resolve_api_key
from agentenv.errors import AgentEnvError
from agentenv.settings import get_settings
from agentenv.template.pull import DEFAULT_STATE_DIR, pull_image

LEVEL_STYLES = {"debug": "dim", "info": "", "warn": "yellow", "error": "bold red"}


@click.command("pull")
@click.argument("reference")
@click.option("--name", default=None,
              help="Local image name (default: the manifest digest, sha256-HEX).")
@click.option("--state-dir", type=click.Path(path_type=Path), default=DEFAULT_STATE_DIR,
              show_default=True, help="Images go to STATE_DIR/images, layers to STATE_DIR/layer-cache.")
@click.option("--platform", default="linux/amd64", show_default=True,
              help="os/arch[/variant] to pick from a multi-platform image.")
@click.option("--docker-config", type=click.Path(path_type=Path), default=None,
              help="Docker config.json with registry credentials (default: $DOCKER_CONFIG or ~/.docker).")
@click.option("--blockd", "blockd_socket", type=click.Path(path_type=Path), default=None,
              help="blockd control socket (default: the host's daemon, else a private one).")
@click.option("--insecure", is_flag=True, default=None,
              help="Allow plain http and unverified TLS (always allowed for loopback registries).")
@click.option("--ca-file", type=click.Path(path_type=Path, exists=True), default=None,
              help="CA bundle to verify the registry's TLS certificate.")
@click.option("-q", "--quiet", is_flag=True,
              help="No progress bars; print only the image directory (the template id when registered).")
@click.option("--download", is_flag=True,
              help="Download overlaybd layers whole instead of leaving them in the registry "
                   "as remote layers read on demand.")
@click.option("--register/--no-register", default=None,
              help="Make it a template of the node at --api-url, so Sandbox.create(NAME) starts "
                   "it (default: when --name is given and a node answers there).")
@click.option("--api-url", default=lambda: os.environ.get("E2B_API_URL", DEFAULT_URL),
              show_default="$E2B_API_URL or " + DEFAULT_URL, help="The node's API (--register).")
@click.option("--api-key", default=None,
              help="Defaults to $E2B_API_KEY or $AENV_HOME/secrets/api-key (--register).")
def pull_command(reference: str, name: str | None, state_dir: Path, platform: str,
                 docker_config: Path | None, blockd_socket: Path | None, insecure: bool | None,
                 ca_file: Path | None, quiet: bool, download: bool, register: bool | None,
                 api_url: str, api_key: str | None) -> None:
    """Pull an OCI image and turn it into overlaybd layers ready for templates.

    Tar layers are applied onto an ext4 filesystem (one overlaybd layer each, cached by chain
    ID); overlaybd-format images are used as they are: left in the registry as remote layers
    (only their metadata is fetched; blockd reads the rest on demand), or with --download
    fetched whole.

    With --name and a running node (or --register), the node pulls the image into its own
    store and registers it as template NAME (a build with no steps: the image booted once and
    snapshotted), so `Sandbox.create(NAME)` works right after; otherwise the image goes to the
    local store (STATE_DIR/images) as before.
    """
    if register is None:
        register = name is not None and _node_answers(api_url)
    if register:
        key = resolve_api_key(api_key, get_settings().state_home)
        template_name = name or _template_name(reference)
        console = Console(stderr=True, quiet=quiet)
        api = Client(api_url, key)
        created = api.call("POST", "/v3/templates", {"name": template_name}).json()
        tid, bid = created["templateID"], created["buildID"]
        console.print(f"registering {reference} as template [bold]{template_name}[/] ({tid}) "
                      f"on {api_url}: the node pulls it and boots it once")
        api.call("POST", f"/v2/templates/{tid}/builds/{bid}",
                 {"fromImage": reference, "steps": [], "force": True})
        _follow_build(api, console, template_name, tid, bid)
        click.echo(tid if quiet else f"{template_name}: template {tid} on {api_url}")
        return

    pulled = pull_image(reference, name=name, state_dir=state_dir, platform=platform,
                        docker_config=docker_config, blockd=blockd_socket, insecure=insecure or None,
                        ca_file=ca_file, progress=not quiet, lazy=not download)
    if quiet:
        click.echo(str(pulled.path))
        return
    click.echo(
        f"{pulled.name}: {pulled.reference} ({pulled.manifest_digest[:19]}), "
        f"{pulled.layers_converted + pulled.layers_fetched + pulled.layers_cached} layers "
        f"({pulled.layers_converted + pulled.layers_fetched} new, "
        f"{pulled.layers_cached} cached{', on the ext4 base layer' if pulled.format == 'converted' else ''}), "
        f"{pulled.bytes_downloaded / 1e6:.1f} MB downloaded in {pulled.seconds:.1f} s -> {pulled.path}"
    )


def _node_answers(url: str) -> bool:
    try:
        return httpx.get(f"{url.rstrip('/')}/health", timeout=2.0, trust_env=False).status_code < 500
    except httpx.HTTPError:
        return False


def _template_name(reference: str) -> str:
    """A template name from an image reference: its last path component and tag."""
    import re

    rest = reference.split("@", 1)[0].rsplit("/", 1)[-1]
    name = re.sub(r"[^a-z0-9_-]+", "-", rest.replace(":", "-").lower()).strip("-")
    if not name:
        raise AgentEnvError(f"cannot make a template name of {reference!r}: give --name")
    return name


def _follow_build(api: Client, console: Console, name: str, tid: str, bid: str) -> None:
    """Print a node build's log until it ends; a failed build raises with its reason."""
    t0 = time.monotonic()
    offset = 0
    status: dict[str, Any] = {}
    with console.status(f"building {name}...") as spinner:
        while True:
            status = api.call("GET", f"/templates/{tid}/builds/{bid}/status",
                              logsOffset=offset).json()
            entries = status.get("logEntries") or []
            offset += len(entries)
            for entry in entries:
                step = f"[{entry['step']}] " if entry.get("step") else ""
                style = LEVEL_STYLES.get(entry.get("level", "info"), "")
                console.print(f"{step}{entry['message']}", style=style, markup=False,
                              highlight=False)
            spinner.update(f"building {name}... {time.monotonic() - t0:.0f} s")
            if status["status"] in ("ready", "error") and not entries:
                break
            if not entries:
                time.sleep(0.5)
    if status["status"] == "error":
        reason = status.get("reason") or {}
        where = f" at step {reason['step']}" if reason.get("step") else ""
        raise AgentEnvError(f"build of {name} failed{where}: {reason.get('message', 'unknown')}")
    console.print(f"[green]template {name} ({tid}) ready[/] in {time.monotonic() - t0:.1f} s")


# --- template builds through a node's API ---------------------------------------------------------


@click.group("template")
@node_api_options
@click.pass_context
def template_group(ctx: click.Context, api_url: str, api_key: str | None, state_dir: Path) -> None:
    """Build, list and delete a node's templates."""
    ctx.obj = Client(api_url, resolve_api_key(api_key, state_dir))


def _pairs(items: tuple[str, ...], what: str) -> list[str]:
    args: list[str] = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise AgentEnvError(f"{what} {item!r} must look like KEY=VALUE")
        args += [key, value]
    return args


@template_group.command("build")
@click.argument("name")
@click.option("-f", "--file", "build_file", type=click.Path(exists=True, dir_okay=False,
              path_type=Path), default=None, help="Build file (a Dockerfile subset, see below).")
@click.option("-c", "--context", "context_dir", type=click.Path(exists=True, file_okay=False,
              path_type=Path), default=None,
              help="Directory COPY sources are relative to (default: the build file's, else .).")
@click.option("--from-image", default=None, help="Base image (overrides the file's FROM).")
@click.option("--from-template", default=None, help="Base template (overrides the file's FROM).")
@click.option("--env", "envs", multiple=True, help="KEY=VALUE, repeatable (an ENV step).")
@click.option("--workdir", default=None, help="A WORKDIR step.")
@click.option("--user", default=None, help="A USER step.")
@click.option("--copy", "copies", multiple=True, help="SRC:DEST, repeatable (a COPY step).")
@click.option("--run", "runs", multiple=True, help="A RUN step, repeatable.")
@click.option("--start-cmd", default=None, help="Start command (runs in every sandbox).")
@click.option("--ready-cmd", default=None, help="Ready command (polled until it exits 0).")
@click.option("--cpu", "cpu_count", type=int, default=None, help="vCPUs (default 2).")
@click.option("--memory", "memory_mb", type=int, default=None, help="Memory in MiB (default 1024).")
@click.option("--reclaim-after", "reclaim_after", type=click.IntRange(min=0), default=None,
              help="Seconds a page sits untouched before the guest gives it back to the host "
                   "(0: keep the page cache hot; default: the node's, 30).")
@click.option("-d", "--detach", is_flag=True, help="Start the build and return at once.")
@click.option("-q", "--quiet", is_flag=True, help="No build log; print only the template id.")
@click.pass_context
def template_build(ctx: click.Context, name: str, build_file: Path | None,
                   context_dir: Path | None, from_image: str | None, from_template: str | None,
                   envs: tuple[str, ...], workdir: str | None, user: str | None,
                   copies: tuple[str, ...], runs: tuple[str, ...], start_cmd: str | None,
                   ready_cmd: str | None, cpu_count: int | None, memory_mb: int | None,
                   reclaim_after: int | None, detach: bool, quiet: bool) -> None:
    """Build template NAME on the node (a VM runs the steps; sandboxes restore its snapshot).

    \b
    The build file is a Dockerfile subset:
      FROM debian:bookworm            an image, or: FROM template <name>
      RUN apt-get install -y curl     ENV KEY=value   ARG KEY=value
      WORKDIR /app                    USER user
      COPY [--chown=u] [--chmod=0755] src... dest   (relative to the context directory)
      START python -m http.server     (CMD / ENTRYPOINT work too)
      READY curl -fs localhost:8000
    Options add steps after the file's, in this order: --env, --workdir, --user, --copy, --run.
    Example: aenv template build web --from-image python:3.12 --run 'pip install flask'
             --start-cmd 'flask run' --ready-cmd 'curl -fs localhost:5000'
    """
    # lazy: `aenv --help` loads only what every command needs (cli/main.py imports this)
    from agentenv.template.buildfile import (
        BuildPlan,
        CopySource,
        files_archive,
        parse_build_file,
    )

    api: Client = ctx.obj
    plan = parse_build_file(build_file.read_text()) if build_file else BuildPlan()
    context = context_dir or (build_file.parent if build_file else Path("."))
    if from_image and from_template:
        raise AgentEnvError("give --from-image or --from-template, not both")
    if from_image:
        plan.from_image, plan.from_template = from_image, None
    if from_template:
        plan.from_template, plan.from_image = from_template, None
    if envs:
        plan.add("ENV", _pairs(envs, "--env"))
    if workdir:
        plan.add("WORKDIR", [workdir])
    if user:
        plan.add("USER", [user])
    for item in copies:
        src, sep, dest = item.partition(":")
        if not sep or not src or not dest:
            raise AgentEnvError(f"--copy {item!r} must look like SRC:DEST")
        plan.add_copy(CopySource(src, dest))
    for command in runs:
        plan.add("RUN", [command])
    plan.start_cmd = start_cmd or plan.start_cmd
    plan.ready_cmd = ready_cmd or plan.ready_cmd
    if not plan.from_image and not plan.from_template:
        raise AgentEnvError("no base: give a FROM line, --from-image or --from-template")
    request = plan.request(context)

    console = Console(stderr=True, quiet=quiet)
    created = api.call("POST", "/v3/templates", {
        "name": name, **({"cpuCount": cpu_count} if cpu_count else {}),
        **({"memoryMB": memory_mb} if memory_mb else {}),
        **({} if reclaim_after is None else {"coldMemory": (
            {"reclaim": True, "minAgeSeconds": reclaim_after} if reclaim_after
            else {"reclaim": False})})}).json()
    tid, bid = created["templateID"], created["buildID"]
    console.print(f"template [bold]{name}[/] ({tid}), build {bid}")
    for index, copy in plan.copies.items():
        step = request["steps"][index]
        link = api.call("GET", f"/templates/{tid}/files/{step['filesHash']}").json()
        if link.get("present"):
            console.print(f"  files of COPY {copy.src}: already on the node")
            continue
        data = files_archive(context, copy)
        try:
            answer = httpx.put(link["url"], content=data, headers=link.get("headers") or {},
                               timeout=3600, trust_env=False)
        except httpx.HTTPError as exc:
            raise AgentEnvError(f"uploading the files of COPY {copy.src} failed: {exc}") from exc
        if answer.status_code >= 300:
            raise AgentEnvError(f"uploading the files of COPY {copy.src} failed: "
                                f"{answer.status_code} {answer.text[:200]}")
        console.print(f"  files of COPY {copy.src}: uploaded {len(data) / 1e3:.1f} kB")
    api.call("POST", f"/v2/templates/{tid}/builds/{bid}", request)
    if detach:
        click.echo(tid)
        return
    _follow_build(api, console, name, tid, bid)
    click.echo(tid)


@template_group.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def template_ls(ctx: click.Context, as_json: bool) -> None:
    """List the node's templates with their latest build."""
    items = ctx.obj.call("GET", "/templates").json()
    if as_json:
        click.echo(json.dumps(items, indent=2))
        return
    table = Table("template", "names", "status", "vCPUs", "MiB", "builds", "updated")
    for item in items:
        table.add_row(item["templateID"], ", ".join(item.get("names") or []),
                      item.get("buildStatus", ""), str(item["cpuCount"]), str(item["memoryMB"]),
                      str(item.get("buildCount", 1)), item.get("updatedAt", ""))
    Console().print(table)


@template_group.command("rm")
@click.argument("templates", nargs=-1, required=True)
@click.pass_context
def template_rm(ctx: click.Context, templates: tuple[str, ...]) -> None:
    """Delete templates (by id or name); a build under way is cancelled."""
    for template in templates:
        ctx.obj.call("DELETE", f"/templates/{template}")
        click.echo(f"deleted {template}")


COMMANDS: list[click.Command] = [pull_command, template_group]
