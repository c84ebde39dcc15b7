"""The control socket (network/control.py's protocol, one JSON request a line): ping, set,
remove and sync of the slot table, answered by the proxy."""

from __future__ import annotations

import asyncio
import functools
import json
from ipaddress import IPv4Address
from typing import Any, Protocol

from agentenv.network.control import SlotEntry, SlotIdentity
from agentenv.network.policy import EgressPolicy, PolicyError


class SlotTable(Protocol):
    """What the control socket changes and reads (the proxy)."""

    def stats(self) -> dict[str, Any]: ...

    def set_slot(self, entry: SlotEntry) -> int: ...

    def remove_slot(self, source: str) -> int: ...

    def sync(self, entries: list[SlotEntry]) -> None: ...


def handle_request(proxy: SlotTable, request: Any) -> dict[str, Any]:
    if not isinstance(request, dict):
        raise ValueError("a request is a JSON object with an op")
    op = request.get("op")
    if op == "ping":
        return {"ok": True, **proxy.stats()}
    if op == "set":
        entry = slot_entry(request.get("slot"))
        return {"ok": True, "cut": proxy.set_slot(entry)}
    if op == "remove":
        source = request.get("source")
        if not isinstance(source, str):
            raise ValueError("remove needs source (the slot's guest address)")
        source_address(source)
        return {"ok": True, "cut": proxy.remove_slot(source)}
    if op == "sync":
        raw = request.get("slots")
        if not isinstance(raw, list):
            raise ValueError("sync needs slots, a list")
        entries = [slot_entry(item, f"slots[{i}]") for i, item in enumerate(raw)]
        if len({e.source for e in entries}) != len(entries):
            raise ValueError("sync: a source appears twice")
        proxy.sync(entries)
        return {"ok": True}
    raise ValueError(f"unknown op {op!r} (ping, set, remove, sync)")


async def serve_control_client(proxy: SlotTable, reader: asyncio.StreamReader,
                               writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            try:
                line = await reader.readline()
            except (ValueError, asyncio.LimitOverrunError):
                writer.write(json.dumps({"ok": False, "error": "request line too long"})
                             .encode() + b"\n")
                await writer.drain()
                return
            if not line:
                return
            try:
                answer = handle_request(proxy, json.loads(line))
            except (ValueError, TypeError, KeyError, PolicyError, OSError) as exc:
                answer = {"ok": False, "error": str(exc) or type(exc).__name__}
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


def source_address(text: str) -> str:
    try:
        return str(IPv4Address(text))
    except ValueError:
        raise ValueError(f"source {text!r} is not an IPv4 address") from None


def slot_entry(raw: Any, where: str = "slot") -> SlotEntry:
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object with source, identity and policy")
    source = raw.get("source")
    if not isinstance(source, str):
        raise ValueError(f"{where}.source is required (the slot's guest address)")
    identity = raw.get("identity")
    if not isinstance(identity, dict):
        raise ValueError(f"{where}.identity is required")
    try:
        return SlotEntry(source_address(source), SlotIdentity(**identity),
                         parsed_policy(json.dumps(raw.get("policy") or {}, sort_keys=True)))
    except TypeError as exc:
        raise ValueError(f"{where}.identity: {exc}") from None
    except PolicyError as exc:
        raise ValueError(f"{where}.policy: {exc}") from None


@functools.lru_cache(maxsize=256)
def parsed_policy(wire: str) -> EgressPolicy:
    """Parsed once per distinct policy: the sandboxes of one training run mostly share one, and
    a 1,000-entry policy takes tens of ms to parse (and its lookups to build)."""
    return EgressPolicy.from_wire(json.loads(wire))
