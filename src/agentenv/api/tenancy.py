"""Which team a request to the node acts for.

A standalone node has one team, `LOCAL_TEAM`: whoever holds its API key. A node of a cluster
serves only its gateway (its node key), and the gateway names the team it authorised in
`TEAM_HEADER`; the node applies that team's scope itself, so one gateway bug does not open every
team. The gateway strips the header from what clients send: only it sets the header.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

#: set by the gateway on every request it relays, next to the node key
TEAM_HEADER = b"x-agentenv-team"
#: the ASGI scope key under which the node's app records the request's team
SCOPE_KEY = "agentenv.team"
#: the team of a standalone node's API-key holder (no cluster team may be called so)
LOCAL_TEAM = "local"
#: the "team" of what every team may use: a node's built-in templates (`base`)
SHARED = ""
#: a team's name, as the gateway makes them (and the only form TEAM_HEADER may carry)
TEAM_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")


def scope_team(scope: Mapping[str, Any]) -> str:
    """The team a request acts for (set by the node's app before routing)."""
    team = scope.get(SCOPE_KEY)
    return team if isinstance(team, str) and team else LOCAL_TEAM
