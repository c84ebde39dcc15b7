"""Policy decisions on one connection: what the slot's policy says of its destination, port and
name, and whether a name-bound decision holds (the destination among the name's addresses)."""

from __future__ import annotations

from ipaddress import IPv4Address
from typing import TYPE_CHECKING, Any

from agentenv.network.policy import WEB_PORTS, Decision, EgressPolicy

if TYPE_CHECKING:
    from agentenv.network.egress.conn import Conn


class Refused(Exception):
    """A connection the proxy will not carry; the message is the logged reason, `kind` the
    Counters field that counts it besides `denied` (if any)."""

    def __init__(self, reason: str, kind: str | None = None,
                 fields: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.kind = kind
        self.fields = fields or {}



def policy_decision(conn: Conn, policy: EgressPolicy, name: str | None) -> Decision:
    # On a web port a connection without a readable name could carry any name.
    return policy.decide(conn.dst_ip, conn.dst_port, name,
                         unnamed=name is None and conn.dst_port in WEB_PORTS)


def judge(conn: Conn, decision: Decision, name: str | None,
          answers: frozenset[IPv4Address] | None) -> None:
    """Raises Refused (saying why) unless `decision` lets `conn` out; a "bind" decision only
    when the destination is among `answers`, the name's addresses here (None: not known)."""
    if decision.verdict == "allow":
        return
    if decision.verdict == "deny":
        kind = "denied_unnamed" if name is None and conn.dst_port in WEB_PORTS else None
        raise Refused(f"policy: {decision.reason}", kind)
    if answers is not None and conn.dst_ip in answers:
        return
    found = "is not resolved here yet" if answers is None else (
        f"resolves here to {', '.join(sorted(map(str, answers)))}" if answers
        else "does not resolve here")
    raise Refused(f"policy: {decision.reason}, but {name} {found}, not to {conn.dst_ip}",
                  "denied_name_address",
                  {"answers": sorted(map(str, answers)) if answers is not None else None})
