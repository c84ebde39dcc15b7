"""`aenv snapshot push|pull`: snapshots that move between nodes (node/snapshot_api.py)."""

from __future__ import annotations

from pathlib import Path

import click

from agentenv.cli.node import Client, node_api_options, resolve_api_key


@click.group("snapshot")
@node_api_options
@click.pass_context
def snapshot_group(ctx: click.Context, api_url: str, api_key: str | None, state_dir: Path) -> None:
    """Publish a node's snapshots to a repository, or fetch them from one.

    \b
    A repository is an OCI registry (REF = host[:port]/repo:tag) or a shared directory
    (REF = dir:///mnt/shared/snapshots/NAME, or an absolute path). The artifact holds the
    snapshot's memory layers, disk layers, device state and record.
    """
    ctx.obj = Client(api_url, resolve_api_key(api_key, state_dir))


@snapshot_group.command("push")
@click.argument("snapshot")
@click.argument("ref")
@click.pass_context
def snapshot_push(ctx: click.Context, snapshot: str, ref: str) -> None:
    """Publish SNAPSHOT (a template, an API snapshot or a paused sandbox) as REF."""
    api: Client = ctx.obj
    with_timeout = api.http.timeout
    api.http.timeout = 3600  # whole layers go up
    try:
        out = api.call("POST", "/aenv/snapshots/push", {"snapshot": snapshot, "ref": ref}).json()
    finally:
        api.http.timeout = with_timeout
    click.echo(f"{snapshot} -> {out['ref']} ({out['digest'][:19]}): {out['parts']} parts, "
               f"{out['bytes'] / 1e6:.1f} MB, {out['bytes_sent'] / 1e6:.1f} MB sent in "
               f"{out['seconds']} s")


@snapshot_group.command("pull")
@click.argument("ref")
@click.option("--name", default=None, help="Name the node gives the snapshot (a template name).")
@click.option("-q", "--quiet", is_flag=True, help="Print only the template id.")
@click.option("--download", is_flag=True,
              help="Download the memory and disk layers whole now (default from a registry: "
                   "they stay remote and a restore fetches what it touches).")
@click.pass_context
def snapshot_pull(ctx: click.Context, ref: str, name: str | None, quiet: bool,
                  download: bool) -> None:
    """Fetch the snapshot REF into the node; Sandbox.create(NAME or id) restores it."""
    api: Client = ctx.obj
    api.http.timeout = 3600
    body: dict[str, object] = {"ref": ref, **({"name": name} if name else {})}
    if download:
        body["download"] = True
    out = api.call("POST", "/aenv/snapshots/pull", body).json()
    if quiet:
        click.echo(out["templateID"])
        return
    lazy = (f", {out['lazy_parts']} layers left remote "
            f"({out['bytes_total'] / 1e6:.1f} MB in all)") if out.get("lazy_parts") else ""
    click.echo(f"{ref} -> template {out['templateID']}"
               f"{' (' + ', '.join(out['names']) + ')' if out['names'] else ''}: snapshot "
               f"{out['snapshot']}, {out['bytes_fetched'] / 1e6:.1f} MB fetched in "
               f"{out['seconds']} s{lazy}")


COMMANDS: list[click.Command] = [snapshot_group]
