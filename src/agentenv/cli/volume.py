"""`aenv volume`: a node's volumes (docs/volumes.md) from the command line: `import` fills a
volume from a directory through the volume content API (as the SDK's Volume would), `commit`
makes a sandbox's copy-on-write mount the volume's content."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import click
import httpx

from agentenv.cli.node import Client, node_api_options, resolve_api_key
from agentenv.errors import AgentEnvError


class Volumes:
    """The volume API (with the API key) and a volume's content API (with its token)."""

    def __init__(self, api_url: str, key: str) -> None:
        self.api = Client(api_url, key)
        self.content_url = os.environ.get("E2B_VOLUME_API_URL") or api_url

    def find(self, wanted: str) -> dict[str, Any]:
        """The volume named or numbered `wanted`, with its token."""
        for volume in self.api.call("GET", "/volumes").json():
            if wanted in (volume["volumeID"], volume["name"]):
                got: dict[str, Any] = self.api.call(
                    "GET", f"/volumes/{volume['volumeID']}").json()
                return got
        raise AgentEnvError(f"no volume named {wanted!r}")

    def content(self, volume: dict[str, Any]) -> httpx.Client:
        return httpx.Client(base_url=f"{self.content_url}/volumecontent/{volume['volumeID']}",
                            headers={"Authorization": f"Bearer {volume['token']}"},
                            timeout=3600, trust_env=False)


def _checked(answer: httpx.Response, what: str) -> None:
    if answer.status_code >= 300:
        try:
            message = answer.json()["message"]
        except (ValueError, KeyError, TypeError):
            message = answer.text
        raise AgentEnvError(f"{what}: {answer.status_code} {message}")


@click.group("volume")
@node_api_options
@click.pass_context
def volume_group(ctx: click.Context, api_url: str, api_key: str | None, state_dir: Path) -> None:
    """A node's volumes (E2B's Volume): list, create, remove, fill from a directory."""
    ctx.obj = Volumes(api_url, resolve_api_key(api_key, state_dir))


@volume_group.command("list")
@click.pass_context
def volume_list(ctx: click.Context) -> None:
    """The volumes of the API key's team."""
    for volume in ctx.obj.api.call("GET", "/volumes").json():
        click.echo(f"{volume['volumeID']}  {volume['name']}  {volume['sizeMB']} MiB")


@volume_group.command("create")
@click.argument("name")
@click.option("--size-mb", type=int, default=None,
              help="Its size (default: the node's AENV_VOLUME_SIZE_MB).")
@click.pass_context
def volume_create(ctx: click.Context, name: str, size_mb: int | None) -> None:
    """Create the volume NAME; prints its id."""
    body: dict[str, Any] = {"name": name, **({"sizeMB": size_mb} if size_mb else {})}
    click.echo(ctx.obj.api.call("POST", "/volumes", body).json()["volumeID"])


@volume_group.command("rm")
@click.argument("volume")
@click.pass_context
def volume_rm(ctx: click.Context, volume: str) -> None:
    """Delete VOLUME (a name or an id) and its content."""
    found = ctx.obj.find(volume)
    ctx.obj.api.call("DELETE", f"/volumes/{found['volumeID']}")


@volume_group.command("import")
@click.argument("name")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--size-mb", type=int, default=None,
              help="The size of the volume when it is made here (default: the node's).")
@click.pass_context
def volume_import(ctx: click.Context, name: str, directory: Path, size_mb: int | None) -> None:
    """Copy DIRECTORY into the volume NAME (made when missing): every directory and regular
    file, with its mode and owner, replacing files of the same path. Links and special files
    are skipped (the content API makes neither)."""
    volumes: Volumes = ctx.obj
    try:
        volume = volumes.find(name)
    except AgentEnvError:
        body: dict[str, Any] = {"name": name, **({"sizeMB": size_mb} if size_mb else {})}
        volume = volumes.api.call("POST", "/volumes", body).json()
    files = dirs = size = 0
    skipped: list[str] = []
    with volumes.content(volume) as content:
        for top, subdirs, names in os.walk(directory):
            rel = Path(top).relative_to(directory)
            for entry in [*subdirs, *names]:
                path = Path(top) / entry
                target = "/" + str(rel / entry) if str(rel) != "." else "/" + entry
                st = path.lstat()
                owner = {"uid": st.st_uid, "gid": st.st_gid, "mode": stat.S_IMODE(st.st_mode)}
                if stat.S_ISDIR(st.st_mode):
                    _checked(content.post("/dir", params={"path": target, "force": "true",
                                                          **owner}), f"mkdir {target}")
                    dirs += 1
                elif stat.S_ISREG(st.st_mode):
                    with open(path, "rb") as f:
                        _checked(content.put("/file", params={"path": target, "force": "true",
                                                              **owner}, content=f),
                                 f"writing {target}")
                    files += 1
                    size += st.st_size
                else:
                    skipped.append(target)
    click.echo(f"{name}: {files} files ({size / 1e6:.1f} MB) and {dirs} directories imported"
               f"{f', {len(skipped)} links or special files skipped' if skipped else ''}")


@volume_group.command("commit")
@click.argument("sandbox")
@click.argument("volume")
@click.option("--path", default=None, help="The mount's path, when the sandbox mounts VOLUME "
                                            "copy-on-write more than once.")
@click.pass_context
def volume_commit(ctx: click.Context, sandbox: str, volume: str, path: str | None) -> None:
    """VOLUME's content becomes what SANDBOX's copy-on-write mount of it holds; sandboxes
    created from now on mount that."""
    found = ctx.obj.find(volume)
    ctx.obj.api.http.timeout = 3600  # the mount is archived, downloaded and unpacked
    body: dict[str, Any] = {"sandboxID": sandbox, **({"path": path} if path else {})}
    ctx.obj.api.call("POST", f"/volumes/{found['volumeID']}/commit", body)
    click.echo(f"{found['name']}: committed from {sandbox}")


COMMANDS = [volume_group]
