"""`aenv serve` runs the node server; `aenv sandbox ...` talks to a running node's API."""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path
from typing import Any, TypeVar

import click
import httpx
from rich.console import Console
from rich.table import Table

from agentenv import logs
from agentenv.envd_client import EnvdClient, EnvdClientError
from agentenv.errors import AgentEnvError
from agentenv.settings import get_settings, warn_unknown

F = TypeVar("F", bound=Any)
DEFAULT_URL = "http://127.0.0.1:8000"


def _check_domain(value: str | None) -> str | None:
    """A host name with an optional port: what the SDK puts after `{port}-{id}.`."""
    if not value:
        return None
    if not re.fullmatch(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:\d{1,5})?", value.lower()):
        raise click.BadParameter(
            f"{value!r} is not a host name with an optional port (e.g. localhost:8000)"
        )
    return value.lower()


@click.command("serve")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=lambda: str(get_settings().state_home),
    show_default="$AENV_HOME or /var/lib/aenv",
    help="Where records, sandboxes, templates and the API key live.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option(
    "--backend",
    type=click.Choice(["vm", "process"]),
    default="vm",
    show_default=True,
    help="What runs sandboxes: 'vm' = QEMU VMs (the product; root; builds the guest and the "
    "base template on first start); 'process' = envd processes on this host, no VM "
    "(development and tests only: no isolation, pause keeps files only).",
)
@click.option(
    "--domain",
    default=lambda: get_settings().domain or None,
    callback=lambda ctx, param, value: _check_domain(value),
    help="Sandbox domain returned to SDKs as `domain` ({port}-{id}.DOMAIN is then routed to "
    "that sandbox port), e.g. localhost:8000. Default: $AENV_DOMAIN, else none.",
)
@click.option(
    "--scheduler",
    default=lambda: get_settings().scheduler or None,
    help="HOST:PORT of the control plane's scheduler: heartbeats go there every 2 s. "
    "Default: $AENV_SCHEDULER, else none (a standalone node).",
)
@click.option("--node-id", default=lambda: get_settings().node_id or None,
              help="This node's id for the scheduler. Default: the host name.")
@click.option("--advertise", default=lambda: get_settings().advertise or None,
              help="HOST:PORT the gateway reaches this node at. Default: --host:--port "
              "(required when --host is 0.0.0.0 or ::).")
@click.option(
    "--node-key-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=lambda: get_settings().node_key_file,
    help="Part of a cluster: this node's key (`aenv node-key --node-id ID`): serve only "
    "requests carrying it (the gateway's), and call the scheduler with it. "
    "Default: $AENV_NODE_KEY_FILE, $AENV_NODE_KEY, else none (a standalone node).",
)
@click.option(
    "--cluster-secret-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A one-machine development cluster only: derive this node's key (and the metrics "
    "token) from the cluster secret itself. Default: $AENV_CLUSTER_SECRET.",
)
@click.option("--metrics-token-file", type=click.Path(dir_okay=False, path_type=Path),
              default=lambda: get_settings().metrics_token_file,
              help="The cluster's metrics token (`aenv metrics-token`): /metrics for a scraper "
              "with `Authorization: Bearer` it. Default: $AENV_METRICS_TOKEN_FILE.")
@click.option("--public-metrics/--no-public-metrics",
              default=lambda: get_settings().public_metrics, show_default="$AENV_PUBLIC_METRICS",
              help="Serve /metrics without a credential (default: the API key, or in a cluster "
              "the node key or the metrics token).")
@click.option("--idle-pause-after", type=click.IntRange(0, 30 * 24 * 3600),
              default=lambda: get_settings().idle_pause_after,
              show_default="$AENV_IDLE_PAUSE_AFTER or 0",
              help="Pause a sandbox after this many seconds without traffic (the next request "
              "resumes it), unless its create or template says otherwise; 0: never (E2B's "
              "behaviour).")
@click.option("--log-level", default="info", show_default=True)
def serve_command(
    state_dir: Path, host: str, port: int, backend: str, domain: str | None,
    scheduler: str | None, node_id: str | None, advertise: str | None,
    node_key_file: Path | None, cluster_secret_file: Path | None,
    metrics_token_file: Path | None, public_metrics: bool, idle_pause_after: int,
    log_level: str
) -> None:
    """Run the node server: E2B-compatible API and sandbox proxy on one port."""
    # lazy: keeps `aenv --help` fast (cli/main.py imports every command module)
    from agentenv.cluster_keys import load_cluster_secret
    from agentenv.node.orchestrator import NodeConfig  # lazy: as above
    from agentenv.node.security import (  # lazy: as above
        api_key_path,
        load_api_key,
        secure_state_dir,
    )
    from agentenv.node.server import ServeOptions, cluster_credentials, serve  # lazy: as above

    logs.setup(log_level)
    warn_unknown("node")  # a mistyped AENV_ name would be ignored silently
    if scheduler and not advertise and host in ("0.0.0.0", "::", ""):
        raise click.UsageError(
            f"--host {host} is no address the gateway can reach: give --advertise HOST:PORT"
        )
    if advertise and not re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):\d{1,5}", advertise):
        raise click.BadParameter(f"{advertise!r} is not HOST:PORT", param_hint="--advertise")
    if node_id and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}", node_id):
        raise click.BadParameter(
            f"{node_id!r}: letters, digits, '.', '_', ':', '-' (at most 128)",
            param_hint="--node-id",
        )
    node_id = node_id or socket.gethostname()
    cluster_secret = load_cluster_secret(cluster_secret_file)
    try:
        node_key, metrics_token = cluster_credentials(node_id, node_key_file, cluster_secret,
                                                      metrics_token_file)
    except AgentEnvError as exc:
        raise click.UsageError(str(exc)) from None
    if cluster_secret is not None:
        click.echo("this node holds the cluster secret (a one-machine development cluster): "
                   "anyone who takes it can act as the gateway to every node; give a node of "
                   "a real cluster only its key (--node-key-file, `aenv node-key`)", err=True)
    if scheduler and node_key is None:
        raise click.UsageError(
            "--scheduler needs the cluster secret (--cluster-secret-file, a one-machine cluster) "
            "or this node's key (--node-key-file, AENV_NODE_KEY[_FILE]; `aenv node-key "
            "--node-id ID` prints it): the scheduler answers only its cluster")
    secure_state_dir(state_dir)
    load_api_key(state_dir)
    if not get_settings().api_key:
        click.echo(f"API key in {api_key_path(state_dir)}", err=True)
    serve(
        ServeOptions(
            state_dir=state_dir,
            host=host,
            port=port,
            backend=backend,
            config=NodeConfig(domain=domain, idle_pause_after=idle_pause_after),
            node_key=node_key,
            metrics_token=metrics_token,
            public_metrics=public_metrics,
            scheduler=scheduler or None,
            node_id=node_id,
            advertise=advertise or "",
        )
    )


# --- API client commands -----------------------------------------------------------------------


class Client:
    def __init__(self, url: str, key: str) -> None:
        self.http = httpx.Client(
            base_url=url, headers={"X-API-KEY": key}, timeout=120.0, trust_env=False
        )

    def call(self, method: str, path: str, body: Any = None, **params: Any) -> httpx.Response:
        try:
            answer = self.http.request(
                method, path, json=body, params={k: v for k, v in params.items() if v is not None}
            )
        except httpx.HTTPError as exc:
            raise AgentEnvError(f"cannot reach the node at {self.http.base_url}: {exc}") from exc
        if answer.status_code >= 300:
            try:
                message = answer.json()["message"]
            except (ValueError, KeyError, TypeError):
                message = answer.text
            raise AgentEnvError(f"{method} {path}: {answer.status_code} {message}")
        return answer


def resolve_api_key(explicit: str | None, state_dir: Path) -> str:
    for candidate in (explicit, os.environ.get("E2B_API_KEY"), get_settings().api_key):
        if candidate:
            return candidate
    path = state_dir / "secrets" / "api-key"
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise AgentEnvError(
            f"no API key: pass --api-key, set E2B_API_KEY, or make {path} readable"
        ) from exc


def node_api_options(command: F) -> F:
    """--api-url, --api-key and --state-dir (where the key is found) of a command group that
    talks to a node's API."""
    for option in reversed((
        click.option("--api-url", default=lambda: os.environ.get("E2B_API_URL", DEFAULT_URL),
                     show_default="$E2B_API_URL or " + DEFAULT_URL, help="The node's API."),
        click.option("--api-key", default=None,
                     help="Defaults to $E2B_API_KEY or the state dir's key."),
        click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path),
                     default=lambda: str(get_settings().state_home),
                     show_default="$AENV_HOME or /var/lib/aenv", help="Where to find the API key."),
    )):
        command = option(command)
    return command


@click.group("sandbox")
@click.option(
    "--api-url",
    default=lambda: os.environ.get("E2B_API_URL", DEFAULT_URL),
    show_default="$E2B_API_URL or " + DEFAULT_URL,
)
@click.option("--api-key", default=None, help="Defaults to $E2B_API_KEY or the state dir's key.")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=lambda: str(get_settings().state_home),
)
@click.pass_context
def sandbox_group(ctx: click.Context, api_url: str, api_key: str | None, state_dir: Path) -> None:
    """Manage the sandboxes of a node."""
    ctx.obj = Client(api_url, resolve_api_key(api_key, state_dir))


def _client(ctx: click.Context) -> Client:
    """The group's client; top-level shortcuts (`aenv ls`, ...) take URL and key from the
    environment and the default state dir."""
    client = ctx.find_object(Client)
    if client is None:
        client = Client(
            os.environ.get("E2B_API_URL", DEFAULT_URL),
            resolve_api_key(None, get_settings().state_home))
        ctx.obj = client
    return client


@sandbox_group.command("ls")
@click.option("--state", "states", multiple=True, type=click.Choice(["running", "paused"]))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def sandbox_ls(ctx: click.Context, states: tuple[str, ...], as_json: bool) -> None:
    """List sandboxes (all pages)."""
    client = _client(ctx)
    items: list[dict[str, Any]] = []
    token = None
    while True:
        answer = client.call(
            "GET", "/v2/sandboxes", state=",".join(states) or None, nextToken=token
        )
        items += answer.json()
        token = answer.headers.get("x-next-token")
        if not token:
            break
    if as_json:
        click.echo(json.dumps(items, indent=2))
        return
    table = Table("sandbox", "state", "template", "started", "ends", "metadata")
    for item in items:
        table.add_row(
            item["sandboxID"],
            item["state"],
            item.get("alias") or item["templateID"],
            item["startedAt"],
            item["endAt"],
            json.dumps(item.get("metadata") or {}),
        )
    Console().print(table)


#: the CLI's sandboxes pause while nobody uses them (the node's own default is off, as E2B's)
IDLE_PAUSE_OPTION = click.option(
    "--idle-pause-after", type=click.IntRange(0, 30 * 24 * 3600), default=60, show_default=True,
    help="Seconds without traffic before the node pauses the sandbox (memory kept); the next "
    "command, file access or request to one of its ports resumes it. 0: never.")


@sandbox_group.command("create")
@click.argument("template", default="base")
@click.option("--timeout", type=int, default=None, help="Seconds to live (server default 300).")
@click.option("--metadata", "-m", multiple=True, help="KEY=VALUE, repeatable.")
@click.option("--env", "-e", multiple=True, help="KEY=VALUE, repeatable.")
@click.option("--auto-pause", is_flag=True, help="Pause instead of kill at the timeout.")
@IDLE_PAUSE_OPTION
@click.pass_context
def sandbox_create(
    ctx: click.Context,
    template: str,
    timeout: int | None,
    metadata: tuple[str, ...],
    env: tuple[str, ...],
    auto_pause: bool,
    idle_pause_after: int,
) -> None:
    """Create a sandbox from TEMPLATE and print its id."""

    def pairs(items: tuple[str, ...], what: str) -> dict[str, str]:
        out = {}
        for item in items:
            if "=" not in item:
                raise AgentEnvError(f"{what} {item!r} must look like KEY=VALUE")
            key, value = item.split("=", 1)
            out[key] = value
        return out

    body: dict[str, Any] = {
        "templateID": template,
        "metadata": pairs(metadata, "--metadata"),
        "envVars": pairs(env, "--env"),
        "idlePauseAfter": idle_pause_after,
    }
    if timeout is not None:
        body["timeout"] = timeout
    if auto_pause:
        body["autoPause"] = True
    click.echo(_client(ctx).call("POST", "/v2/sandboxes", body).json()["sandboxID"])


@sandbox_group.command("info")
@click.argument("sandbox_id")
@click.pass_context
def sandbox_info(ctx: click.Context, sandbox_id: str) -> None:
    """Print a sandbox's details as JSON."""
    click.echo(json.dumps(_client(ctx).call("GET", f"/sandboxes/{sandbox_id}").json(), indent=2))


@sandbox_group.command("kill")
@click.argument("sandbox_ids", nargs=-1, required=True)
@click.pass_context
def sandbox_kill(ctx: click.Context, sandbox_ids: tuple[str, ...]) -> None:
    """Kill sandboxes (running or paused)."""
    for sid in sandbox_ids:
        _client(ctx).call("DELETE", f"/sandboxes/{sid}")
        click.echo(f"killed {sid}")


@sandbox_group.command("pause")
@click.argument("sandbox_id")
@click.option("--filesystem", is_flag=True,
              help="Keep the disk only (no memory): resume cold-boots the sandbox from it.")
@click.pass_context
def sandbox_pause(ctx: click.Context, sandbox_id: str, filesystem: bool) -> None:
    """Pause a running sandbox (memory and disk kept, unless --filesystem)."""
    _client(ctx).call("POST", f"/sandboxes/{sandbox_id}/pause",
                      {"memory": False} if filesystem else {})
    click.echo(f"paused {sandbox_id}")


@sandbox_group.command("resume")
@click.argument("sandbox_id")
@click.option("--timeout", type=int, default=300, show_default=True)
@click.pass_context
def sandbox_resume(ctx: click.Context, sandbox_id: str, timeout: int) -> None:
    """Resume a paused sandbox (or extend a running one's timeout)."""
    answer = _client(ctx).call("POST", f"/v2/sandboxes/{sandbox_id}/connect", {"timeout": timeout})
    click.echo(f"{'resumed' if answer.status_code == 201 else 'running'} {sandbox_id}")


@sandbox_group.command("timeout")
@click.argument("sandbox_id")
@click.argument("seconds", type=int)
@click.pass_context
def sandbox_timeout(ctx: click.Context, sandbox_id: str, seconds: int) -> None:
    """Set a running sandbox to end SECONDS from now."""
    _client(ctx).call("POST", f"/sandboxes/{sandbox_id}/timeout", {"timeout": seconds})


@sandbox_group.command("fork")
@click.argument("sandbox_id")
@click.option("--count", "-n", type=click.IntRange(1, 100), default=1, show_default=True)
@click.pass_context
def sandbox_fork(ctx: click.Context, sandbox_id: str, count: int) -> None:
    """Fork a sandbox into COUNT children (a paused one stays paused); prints one child id
    per line."""
    results = _client(ctx).call("POST", f"/sandboxes/{sandbox_id}/fork", {"count": count}).json()
    failed = [r["error"] for r in results if "error" in r]
    for result in results:
        if "sandbox" in result:
            click.echo(result["sandbox"]["sandboxID"])
    if failed:
        raise AgentEnvError(f"{len(failed)} of {count} children failed: {failed[0]['message']}")


@sandbox_group.command("rollback")
@click.argument("sandbox_id")
@click.option("--snapshot", "snapshot_id", default=None,
              help="A snapshot of this sandbox (default: its last pause).")
@click.pass_context
def sandbox_rollback(ctx: click.Context, sandbox_id: str, snapshot_id: str | None) -> None:
    """Restore a sandbox in place to one of its snapshots (or its last pause): same id, a new
    envd token; what it wrote or started after the snapshot is gone. It runs afterwards."""
    _client(ctx).call("POST", f"/sandboxes/{sandbox_id}/rollback",
                      {"snapshotID": snapshot_id} if snapshot_id else {})
    click.echo(f"rolled back {sandbox_id}")


@sandbox_group.command("snapshot")
@click.argument("sandbox_id")
@click.option("--name", default=None, help="Name the snapshot (usable as a template).")
@click.pass_context
def sandbox_snapshot(ctx: click.Context, sandbox_id: str, name: str | None) -> None:
    """Snapshot a running sandbox (it keeps running); prints the snapshot id."""
    body = {"name": name} if name else {}
    answer = _client(ctx).call("POST", f"/sandboxes/{sandbox_id}/snapshots", body).json()
    click.echo(answer["snapshotID"])


@sandbox_group.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--user", default=None, help="Run as this user (default: the template's).")
@click.option("--cwd", default=None, help="Working directory.")
@click.pass_context
def sandbox_exec(ctx: click.Context, sandbox_id: str, command: tuple[str, ...],
                 user: str | None, cwd: str | None) -> None:
    """Run COMMAND in the sandbox through envd, streaming its output; exits with its code.

    Like ssh, the words of COMMAND are joined with spaces and run by /bin/sh -c."""
    import asyncio
    import sys

    client = _client(ctx)
    info = client.call("GET", f"/sandboxes/{sandbox_id}").json()

    def show(stream: str, text: str) -> None:
        (sys.stdout if stream == "stdout" else sys.stderr).write(text)
        (sys.stdout if stream == "stdout" else sys.stderr).flush()

    async def run() -> int:
        # Through the node's proxy, addressed by header as the E2B SDK does.
        envd = EnvdClient(str(client.http.base_url), info.get("envdAccessToken"),
                          headers={"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983"})
        try:
            result = await envd.run("/bin/sh", ["-c", " ".join(command)], user=user, cwd=cwd,
                                    on_output=show)
        except EnvdClientError as exc:
            raise AgentEnvError(f"exec in {sandbox_id}: {exc}") from exc
        finally:
            await envd.close()
        return result.exit_code

    ctx.exit(asyncio.run(run()))


@sandbox_group.command("start")
@click.argument("template", default="base")
@click.option("--detach", "-d", is_flag=True, help="Print the new sandbox's id instead of attaching.")
@click.option("--timeout", type=int, default=None, help="Seconds to live (server default 300).")
@click.option("--keep", is_flag=True, help="Leave the sandbox running when the shell exits.")
@IDLE_PAUSE_OPTION
@click.pass_context
def sandbox_start(ctx: click.Context, template: str, detach: bool, timeout: int | None,
                  keep: bool, idle_pause_after: int) -> None:
    """Start a sandbox from TEMPLATE and attach an interactive shell (envd's PTY).

    The sandbox is killed when the shell exits, unless --keep; the shell's exit code is
    passed through."""
    client = _client(ctx)
    body: dict[str, Any] = {"templateID": template, "idlePauseAfter": idle_pause_after}
    if timeout is not None:
        body["timeout"] = timeout
    created = client.call("POST", "/v2/sandboxes", body).json()
    sandbox_id = created["sandboxID"]
    if detach:
        click.echo(sandbox_id)
        return
    click.echo(f"sandbox {sandbox_id}", err=True)
    try:
        code = _attach_shell(client, sandbox_id, created.get("envdAccessToken"))
    finally:
        if not keep:
            client.call("DELETE", f"/sandboxes/{sandbox_id}")
    ctx.exit(code)


def _attach_shell(client: Client, sandbox_id: str, token: str | None) -> int:
    import asyncio
    import contextlib
    import shutil
    import sys
    import termios
    import tty

    stdin = sys.stdin.fileno()
    interactive = os.isatty(stdin)
    size = shutil.get_terminal_size()

    async def run() -> int:
        loop = asyncio.get_running_loop()
        envd = EnvdClient(str(client.http.base_url), token,
                          headers={"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983"})
        started: asyncio.Future[int] = loop.create_future()
        pending: set[asyncio.Task[None]] = set()

        def on_input() -> None:
            data = os.read(stdin, 65536)
            if not data:  # end of a piped stdin: the shell sees ^D
                loop.remove_reader(stdin)
                data = b"\x04"
            if started.done():
                task = loop.create_task(envd.send_pty(started.result(), data))
                pending.add(task)
                task.add_done_callback(pending.discard)

        def on_pty(data: bytes) -> None:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()

        shell = "if command -v bash >/dev/null; then exec bash -l; else exec sh -l; fi"
        run_task = loop.create_task(envd.run(
            "/bin/sh", ["-c", shell], pty_size=(size.columns, size.lines), on_pty=on_pty,
            on_start=lambda pid: started.set_result(pid)))
        try:
            await asyncio.wait({run_task, started}, return_when=asyncio.FIRST_COMPLETED)
            if not run_task.done():
                loop.add_reader(stdin, on_input)
            result = await run_task
        except EnvdClientError as exc:
            raise AgentEnvError(f"shell in {sandbox_id}: {exc}") from exc
        finally:
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(stdin)
            await envd.close()
        return result.exit_code

    saved = termios.tcgetattr(stdin) if interactive else None
    try:
        if interactive:
            tty.setraw(stdin)
        return asyncio.run(run())
    finally:
        if saved is not None:
            termios.tcsetattr(stdin, termios.TCSADRAIN, saved)


@click.command("auth")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path),
              default=lambda: str(get_settings().state_home),
              show_default="$AENV_HOME or /var/lib/aenv")
@click.option("--api-url", default=lambda: os.environ.get("E2B_API_URL", DEFAULT_URL),
              show_default="$E2B_API_URL or " + DEFAULT_URL)
def auth_command(state_dir: Path, api_url: str) -> None:
    """Check the node's API key and print the E2B environment to export."""
    key = resolve_api_key(None, state_dir)
    Client(api_url, key).call("GET", "/sandboxes")
    click.echo(f"export E2B_API_URL={api_url}\nexport E2B_SANDBOX_URL={api_url}\n"
               f"export E2B_API_KEY={key}")


class _Shortcut(click.Command):
    """A sandbox subcommand also reachable at the top level: `aenv ls` = `aenv sandbox ls`."""

    def __init__(self, name: str, target: click.Command) -> None:
        super().__init__(name, callback=target.callback, params=target.params,
                         help=target.help, context_settings=target.context_settings)


_SHORTCUTS = {"ls": sandbox_ls, "start": sandbox_start, "exec": sandbox_exec, "pause": sandbox_pause,
              "resume": sandbox_resume, "timeout": sandbox_timeout, "rm": sandbox_kill,
              "fork": sandbox_fork, "rollback": sandbox_rollback, "snapshot": sandbox_snapshot}

COMMANDS: list[click.Command] = [
    serve_command, sandbox_group, auth_command,
    *(_Shortcut(name, target) for name, target in _SHORTCUTS.items()),
]
