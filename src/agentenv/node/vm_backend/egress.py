"""The VM backend's side of egress policies (runtime/network.py, node/network_policy.py): the
node-wide egress proxy, and what it is told about each VM's network slot (who the sandbox is,
what it may reach). The kernel's rules of a slot are the runtime's (Runtime.set_policy)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from agentenv.network.control import SlotEntry, SlotIdentity
from agentenv.network.policy import EgressPolicy
from agentenv.node.backend import SandboxSpec
from agentenv.node.network_policy import EgressProxySupervisor
from agentenv.runtime.network import parse_open_ranges, require_tools
from agentenv.runtime.vm import VM
from agentenv.settings import get_settings

log = logging.getLogger("agentenv.node.vm_backend")


def egress_of(spec: SandboxSpec) -> EgressPolicy:
    """The spec's policy; a spec made without one (allow_internet_access only) still gets its
    outbound switch."""
    if spec.egress.is_default and not spec.allow_internet_access:
        return EgressPolicy.from_wire(None, False)
    return spec.egress


class EgressGlue:
    def __init__(self, base: Path, state_dir: Path) -> None:
        settings = get_settings()
        self._control = base / "egress" / "control.sock"
        self._log = state_dir / "logs" / "egress-proxy.log"
        #: the node-wide egress proxy (made in start()); AENV_EGRESS_PROXY=0 runs without it
        #: (then names in policies cannot be allowed: their TCP 80/443 is reset)
        self.proxy: EgressProxySupervisor | None = None
        self.port = settings.egress_proxy_port
        self.enabled = settings.egress_proxy
        self.open_ranges = [x for x in settings.net_open_ranges.split(",") if x]
        self._sources: dict[str, str] = {}  # sandbox id -> its slot's source address

    def leftover_pids(self) -> list[int]:
        """Blocking: the egress proxy a previous node run left running (to adopt, not reap)."""
        if not self.enabled:
            return []
        try:
            from agentenv.network.process import running_for  # a build may leave it out
        except ImportError:
            return []
        return running_for(self._control)

    async def start(self) -> int | None:
        """The egress proxy, before the host's rules that redirect to its port are made; its
        port (None: no proxy)."""
        require_tools()
        if not self.enabled:
            log.warning("egress proxy off (AENV_EGRESS_PROXY=0): no metadata service, and "
                        "TCP 80/443 of policies that name hosts is reset")
            return None
        try:
            # A presence check, so it stays here: a build may leave the egress proxy out.
            import agentenv.network.process  # noqa: F401
        except ImportError:
            log.error("the egress proxy is not part of this build: running without it (no "
                      "metadata service; TCP 80/443 of policies that name hosts is reset)")
            return None
        opened = tuple(str(n) for n in parse_open_ranges(self.open_ranges))  # checked here
        proxy = EgressProxySupervisor(self._control, self.port, log_path=self._log,
                                      open_ranges=opened)
        port = await proxy.start()
        self.proxy = proxy
        return port

    async def close(self) -> None:
        if self.proxy is not None:
            with contextlib.suppress(Exception):
                await self.proxy.close()
            self.proxy = None

    def entry(self, source: str) -> SlotEntry | None:
        """What the proxy was last told about slot address `source`."""
        return self.proxy.entries.get(source) if self.proxy is not None else None

    async def announce(self, sandbox_id: str, vm: VM, spec: SandboxSpec) -> None:
        """Tell the egress proxy who the VM's slot is and what it may reach."""
        if vm.slot is None:
            return
        identity = spec.identity or SlotIdentity(spec.sandbox_id, spec.template_id, None,
                                                 None, "")
        await self.announce_entry(sandbox_id, SlotEntry(vm.slot.guest_address, identity,
                                                        spec.egress))

    async def announce_entry(self, sandbox_id: str, entry: SlotEntry) -> None:
        old = self._sources.get(sandbox_id)
        self._sources[sandbox_id] = entry.source
        if self.proxy is not None:
            if old is not None and old != entry.source:
                await self.proxy.remove(old)
            await self.proxy.set(entry)

    async def forget(self, sandbox_id: str) -> None:
        source = self._sources.pop(sandbox_id, None)
        if source is not None and self.proxy is not None:
            await self.proxy.remove(source)
