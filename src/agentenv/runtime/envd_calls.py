"""The runtime's calls to a VM's envd that race its QEMU: waiting for envd to answer after a
boot, and POST /init after a restore (env vars, tokens, the clock, volume mounts). The requests
are envd_client's; they are sent from here because each gives up as soon as QEMU exits."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import httpx

from agentenv.envd_client import (
    GuestReplyError,
    GuestReplyTimeout,
    init_body,
    init_headers,
    read_reply,
)
from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.errors import GuestNotReadyError, GuestRefusedError, VMDiedError
from agentenv.runtime.machine import VM

T = TypeVar("T")


class EnvdCalls:
    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        # No keep-alive: a restored guest carries the TCP state of its snapshot, so a pooled
        # connection to a reused slot address belongs to another incarnation of the guest and
        # hangs until the timeout (seen: 2.2 s on every second restore of one snapshot).
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(5.0, connect=1.0),
                                      limits=httpx.Limits(max_keepalive_connections=0))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def wait_ready(self, vm: VM, timeout: float) -> None:
        """Returns once envd answers its health path (after a boot)."""
        url = vm.envd_url + self.config.envd_health_path
        deadline = time.monotonic() + timeout
        while True:
            if vm.process.died.is_set():
                raise VMDiedError(vm.process.exit_reason())
            try:
                answer = await read_reply(self.http, "GET", url, what=f"envd of VM {vm.id}",
                                          timeout=1.0)
                if answer.is_success:
                    return
            except (httpx.HTTPError, GuestReplyTimeout):
                pass  # not up yet (or slow under load): polled again until the deadline
            except GuestReplyError as exc:
                raise GuestNotReadyError(str(exc)) from None
            if time.monotonic() > deadline:
                raise GuestNotReadyError(f"envd of VM {vm.id} did not answer within {timeout:.0f} s")
            await asyncio.sleep(0.02)

    async def init(self, vm: VM, env_vars: dict[str, str] | None = None,
                   access_token: str | None = None, *,
                   guest_token: str | None = None,
                   mounts: list[dict[str, Any]] | None = None) -> None:
        """POST /init: env vars, access token, and the host's time (the guest clock stood still).

        `guest_token` is the token envd already holds in the snapshot (a fork child wakes up
        with its parent's): envd takes a new token only when the current one comes along.
        `mounts`: volume disks envd mounts before it answers (docs/volumes.md §6).
        """
        headers = init_headers(guest_token) or None
        url = vm.envd_url + self.config.envd_init_path
        deadline = time.monotonic() + self.config.restore_timeout
        while True:
            if vm.process.died.is_set():
                raise VMDiedError(vm.process.exit_reason())
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GuestNotReadyError(f"envd of VM {vm.id} unreachable after restore")
            body = init_body(env_vars=env_vars, access_token=access_token,
                             volume_mounts=mounts)
            try:
                # Connecting is retried quickly (envd may not listen yet), but once the request
                # is in, the answer is awaited until the deadline: under TCG with many guests
                # starting at once it takes seconds, and sending it again only adds work.
                answer = await self.while_alive(vm, read_reply(
                    self.http, "POST", url, what=f"envd /init of VM {vm.id}",
                    timeout=remaining, connect_timeout=1.0, json=body, headers=headers))
            except GuestReplyError as exc:
                # what answers on envd's port is the guest's: an endless or dripping reply
                raise GuestNotReadyError(str(exc)) from None
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError,
                    httpx.RemoteProtocolError):
                await asyncio.sleep(0.005)
                continue
            except httpx.HTTPError as exc:
                raise GuestNotReadyError(
                    f"envd /init of VM {vm.id} did not answer within "
                    f"{self.config.restore_timeout:.0f} s: {exc!r}") from None
            if answer.is_success:
                return
            # envd's message says why (a volume it could not mount): bounded, one line
            why = "".join(c if c.isprintable() else " " for c in answer.text[:300]).strip()
            message = f"envd /init of VM {vm.id} answered {answer.status_code}: {why}"
            if 400 <= answer.status_code < 500:
                raise GuestRefusedError(message, answer.status_code)
            raise GuestNotReadyError(message)

    async def while_alive(self, vm: VM, call: Awaitable[T]) -> T:
        """`call`'s result, but give up as soon as the VM's QEMU exits (VMDiedError)."""
        post = asyncio.ensure_future(call)
        died = asyncio.ensure_future(vm.process.died.wait())
        try:
            await asyncio.wait({post, died}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            died.cancel()
            if not post.done():
                post.cancel()
                with contextlib.suppress(BaseException):
                    await post
        if post.cancelled():
            raise VMDiedError(vm.process.exit_reason())
        return post.result()
