"""The guest's resolver: RuntimeConfig.guest_dns (AENV_GUEST_DNS) on the boot command line,
and in the base template's key (its boot snapshot keeps the resolv.conf of its boot). The
resolution itself is tested through real guests in tests/node/test_network_policy.py."""

from __future__ import annotations

from ipaddress import IPv4Address
from pathlib import Path

import pytest

from agentenv.runtime.config import RuntimeConfig, privilege_settings_from_env
from agentenv.runtime.vm import BootSpec, _cmdline


def config(env: dict[str, str]) -> RuntimeConfig:
    return RuntimeConfig(**privilege_settings_from_env(env))


def test_default_is_e2bs_and_the_environment_sets_or_clears_it() -> None:
    assert RuntimeConfig().guest_dns == IPv4Address("8.8.8.8")
    assert config({"AENV_GUEST_DNS": "10.1.2.3"}).guest_dns == IPv4Address("10.1.2.3")
    assert config({"AENV_GUEST_DNS": "none"}).guest_dns is None
    with pytest.raises(ValueError, match="guest_dns"):
        config({"AENV_GUEST_DNS": "dns.example"})


def test_boot_command_line() -> None:
    spec = BootSpec(kernel=Path("vmlinuz"), cmdline="console=ttyS0")
    assert "aenv.dns=8.8.8.8" in _cmdline(spec, True, [], IPv4Address("8.8.8.8")).split()
    assert "aenv.dns" not in _cmdline(spec, True, [], None)
    assert "aenv.dns" not in _cmdline(spec, False, [], IPv4Address("8.8.8.8"))  # no network
    spec.dns = "10.9.9.9"  # a boot's own resolver wins
    assert "aenv.dns=10.9.9.9" in _cmdline(spec, True, [], IPv4Address("8.8.8.8")).split()
