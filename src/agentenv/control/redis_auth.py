"""How the gateway, the scheduler and `aenv team` log in to the cluster's Redis: a user (an ACL
user per component, e.g. `gateway`, `scheduler`; none: Redis's `default` user, as with
`requirepass`) and a password read from a file, so it is in neither the URL nor the command line.
`scripts/redis-acl.sh` writes the matching ACL file (used by `make cluster-up` and
deploy/kubernetes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from agentenv.errors import AgentEnvError


@dataclass(frozen=True)
class RedisAuth:
    username: str | None = None
    password: str | None = None

    @classmethod
    def load(cls, username: str | None, password_file: Path | None) -> RedisAuth:
        if password_file is None:
            if username:
                raise AgentEnvError(f"Redis user {username!r} given without a password file "
                                    "(--redis-password-file or AENV_REDIS_PASSWORD_FILE)")
            return cls()
        try:
            password = password_file.read_text().strip()
        except OSError as exc:
            raise AgentEnvError(f"cannot read the Redis password file {password_file}: "
                                f"{exc.strerror or exc}") from exc
        if not password or any(c.isspace() for c in password):
            raise AgentEnvError(f"the Redis password file {password_file} must hold one word "
                                "(the password, no white space)")
        return cls(username or None, password)

    def connect_kwargs(self) -> dict[str, str]:
        """For redis-py's from_url (a password in the URL itself still wins)."""
        out = {}
        if self.username:
            out["username"] = self.username
        if self.password:
            out["password"] = self.password
        return out


def shown_url(url: str) -> str:
    """`url` fit for logs and error answers: a password in it (redis://user:PASSWORD@host)
    replaced by `***`."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(a Redis URL that does not parse)"
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
