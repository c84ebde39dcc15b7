"""`aenv` commands of the template subsystem: `aenv pull`."""

from __future__ import annotations

from pathlib import Path

import click

from agentenv.template.pull import DEFAULT_STATE_DIR


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
@click.option("-q", "--quiet", is_flag=True, help="No progress bars; print only the image directory.")
def pull_command(reference: str, name: str | None, state_dir: Path, platform: str,
                 docker_config: Path | None, blockd_socket: Path | None, insecure: bool | None,
                 ca_file: Path | None, quiet: bool) -> None:
    """Pull an OCI image and turn it into overlaybd layers ready for templates.

    Tar layers are applied onto an ext4 filesystem (one overlaybd layer each, cached by chain
    ID); overlaybd-format images are used as they are.
    """
    from agentenv.template.pull import pull_image

    pulled = pull_image(reference, name=name, state_dir=state_dir, platform=platform,
                        docker_config=docker_config, blockd=blockd_socket, insecure=insecure or None,
                        ca_file=ca_file, progress=not quiet)
    if quiet:
        click.echo(str(pulled.path))
        return
    click.echo(
        f"{pulled.name}: {pulled.reference} ({pulled.manifest_digest[:19]}), "
        f"{pulled.layers_converted + pulled.layers_cached} layers ({pulled.layers_converted} new, "
        f"{pulled.layers_cached} cached{', on the ext4 base layer' if pulled.format == 'converted' else ''}), "
        f"{pulled.bytes_downloaded / 1e6:.1f} MB downloaded in {pulled.seconds:.1f} s -> {pulled.path}"
    )


COMMANDS: list[click.Command] = [pull_command]
