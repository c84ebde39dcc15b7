"""The Redis login options shared by `aenv scheduler`, `aenv gateway` and `aenv team`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click

from agentenv.settings import get_settings

F = TypeVar("F", bound=Callable[..., object])


def redis_auth_options(fn: F) -> F:
    fn = click.option(
        "--redis-password-file", type=click.Path(dir_okay=False, path_type=Path),
        default=lambda: get_settings().redis_password_file,
        help="File holding the Redis password of --redis-user (env AENV_REDIS_PASSWORD_FILE).",
    )(fn)
    return click.option(
        "--redis-user", default=lambda: get_settings().redis_user or None,
        help="Redis ACL user to log in as (env AENV_REDIS_USER; default: Redis's `default` "
        "user, i.e. requirepass).",
    )(fn)
