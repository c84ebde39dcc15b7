"""EgressPolicy: E2B's `network` semantics, validation messages, and the wire round trip."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentenv.network.policy import (
    MAX_ENTRIES,
    EgressPolicy,
    PolicyError,
    name_matches,
)


def test_default_allows_everything_and_proxies_nothing() -> None:
    policy = EgressPolicy.from_wire(None)
    assert policy.is_default and policy.to_wire() == {}
    assert policy.allows("1.2.3.4") and policy.allows("1.2.3.4", "example.com")
    assert policy.proxied_ports == "none" and policy.dns_allowed() == ()


def test_deny_address_and_cidr() -> None:
    policy = EgressPolicy.from_wire({"denyOut": ["1.2.3.4", "10.0.0.0/8"]})
    assert not policy.allows("1.2.3.4") and not policy.allows("10.9.8.7")
    assert policy.allows("1.2.3.5")
    assert policy.proxied_ports == "none"  # addresses only: decided in the kernel


def test_allow_beats_deny_and_internet_off() -> None:
    only = EgressPolicy.from_wire({"allowOut": ["1.2.3.0/24"]}, allow_internet_access=False)
    assert only.allows("1.2.3.9") and not only.allows("1.2.4.1")
    assert only.to_wire() == {"allowOut": ["1.2.3.0/24"], "denyOut": ["0.0.0.0/0"]}
    off = EgressPolicy.from_wire(None, allow_internet_access=False)
    assert not off.allows("8.8.4.4") and off.deny_nets == (IPv4Network("0.0.0.0/0"),)


def test_names_exact_and_wildcard() -> None:
    policy = EgressPolicy.from_wire({"allowOut": ["Example-Allowed.test.", "*.good.test"],
                                     "denyOut": ["0.0.0.0/0"]})
    assert policy.allow_names == ("example-allowed.test", "*.good.test")
    assert policy.allows("9.9.9.9", "example-allowed.test")
    assert policy.allows("9.9.9.9", "a.b.good.test")
    assert not policy.allows("9.9.9.9", "good.test")  # *.x does not match x itself
    assert not policy.allows("9.9.9.9", "example-denied.test")
    assert not policy.allows("9.9.9.9")  # no name known: only addresses decide
    assert policy.proxied_ports == "web"
    assert name_matches("*.a.test", "x.a.test") and not name_matches("*.a.test", "xa.test")


def test_names_alone_do_not_need_the_proxy() -> None:
    # An allow of a name with nothing denied changes no decision: everything goes out.
    assert EgressPolicy.from_wire({"allowOut": ["a.test"]}).proxied_ports == "none"
    assert EgressPolicy.from_wire({"denyOut": ["a.test"]}).proxied_ports == "web"


def test_dns_servers() -> None:
    named = EgressPolicy.from_wire({"allowOut": ["a.test"], "denyOut": ["0.0.0.0/0"]})
    assert named.dns_allowed() == (IPv4Address("8.8.8.8"),)  # the SDK's default resolver
    none = EgressPolicy.from_wire({"allowOut": ["a.test"], "dnsServers": []})
    assert none.dns_allowed() == ()
    mine = EgressPolicy.from_wire({"allowOut": ["a.test"], "dnsServers": ["1.1.1.1"]})
    assert mine.dns_allowed() == (IPv4Address("1.1.1.1"),)
    # Without a name in allowOut the resolvers are not opened.
    assert EgressPolicy.from_wire({"dnsServers": ["1.1.1.1"]}).dns_allowed() == ()


def test_egress_proxy_and_rules() -> None:
    policy = EgressPolicy.from_wire({
        "egressProxy": {"address": "198.51.100.7:1080", "username": "u", "password": "p",
                        "tls": {"serverName": "proxy.test", "caCert": "PEM"}},
        "rules": {"http://api.test": [{"transform": {"headers": {"X-Token": "t"}}}]}})
    assert policy.proxied_ports == "all"
    shown = policy.to_wire()
    assert shown["egressProxy"] == {"address": "198.51.100.7:1080", "username": "u",
                                    "tls": {"enabled": True, "serverName": "proxy.test"}}
    kept = policy.to_wire(secrets=True)
    assert kept["egressProxy"]["password"] == "p" and kept["egressProxy"]["tls"]["caCert"] == "PEM"
    assert EgressPolicy.from_wire(kept) == policy
    assert policy.header_rules("API.test") == (("X-Token", "t"),)
    assert shown["rules"] == {"http://api.test": [{"transform": {"headers": {"X-Token": "t"}}}]}


@pytest.mark.parametrize("key", ["api.test", "https://api.test", "api.test:443", "HTTPS://Api.Test"])
def test_rules_that_would_cover_https_are_refused(key: str) -> None:
    """E2B applies a bare host's rules to HTTPS too; we cannot without decrypting: refused,
    naming the key and the way to ask for plain HTTP only."""
    with pytest.raises(PolicyError) as caught:
        EgressPolicy.from_wire({"allowOut": ["api.test"], "rules": {
            key: [{"transform": {"headers": {"X-Token": "t"}}}]}})
    text = str(caught.value)
    assert f"rules[{key!r}]" in text and "plain HTTP only" in text and "'http://api.test'" in text


@pytest.mark.parametrize("network, named", [
    ({"denyOut": ["10.0.0.0/33"]}, "'10.0.0.0/33' is not a valid CIDR"),
    ({"allowOut": ["https://example.com/x"]}, "no scheme or path"),
    ({"allowOut": ["example.com:443"]}, "no port"),
    ({"allowOut": ["2001:db8::1"]}, "IPv6"),
    ({"denyOut": ["::/0"]}, "IPv6"),
    ({"allowOut": ["bad_name!"]}, "'bad_name!' is not a valid host name"),
    ({"allowOut": ["300.1.2.3"]}, "'300.1.2.3'"),
    ({"allowOut": [""]}, "allowOut"),
    ({"allowOut": "1.2.3.4"}, "allowOut must be a list"),
    ({"dnsServers": ["x"]}, "dnsServers: 'x'"),
    ({"dnsServers": ["1.1.1.1"] * 11}, "at most 10"),
    ({"egressProxy": {"address": "nohost"}}, "is not host:port"),
    ({"egressProxy": {"address": "p.test:1", "password": "x"}}, "only valid together"),
    ({"rules": {"http://a.test": [{"transform": {"headers": {"Bad Header": "x"}}}]}},
     "Bad Header"),
    ({"rules": {"http://a.test/x": []}}, "no scheme or path"),
    ({"rules": {"198.51.100.7": []}}, "addresses and CIDRs are not supported"),
    ({"rules": {"http://a.test": [{"transform": {"headers": {"X": "a\r\nB: c"}}}]}},
     "value of 'X'"),
    ({"allowOut": [f"198.18.{i // 256}.{i % 256}" for i in range(MAX_ENTRIES + 1)]},
     f"at most {MAX_ENTRIES}"),
])
def test_validation_names_the_bad_entry(network: dict[str, object], named: str) -> None:
    with pytest.raises(PolicyError) as caught:
        EgressPolicy.from_wire(network)
    assert named in str(caught.value)


LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
NAMES = st.builds(lambda labels, wild: ("*." if wild else "") + ".".join(labels),
                  st.lists(LABEL, min_size=1, max_size=4), st.booleans()).filter(
    lambda n: not all(part.isdigit() for part in n.removeprefix("*.").split(".")))
NETS = st.builds(lambda a, p: str(IPv4Network((a, p), strict=False)),
                 st.integers(0, 2**32 - 1), st.integers(0, 32))
ENTRIES = st.lists(st.one_of(NETS, NAMES), max_size=20)


@settings(max_examples=200, deadline=None)
@given(allow=ENTRIES, deny=ENTRIES,
       dns=st.one_of(st.none(), st.lists(st.ip_addresses(v=4).map(str), max_size=10)),
       internet=st.one_of(st.none(), st.booleans()))
def test_wire_round_trip(allow: list[str], deny: list[str], dns: list[str] | None,
                         internet: bool | None) -> None:
    wire: dict[str, object] = {"allowOut": allow, "denyOut": deny}
    if dns is not None:
        wire["dnsServers"] = dns
    policy = EgressPolicy.from_wire(wire, internet)
    again = EgressPolicy.from_wire(policy.to_wire(secrets=True))
    assert again == policy
    assert again.to_wire() == policy.to_wire()


@settings(max_examples=200, deadline=None)
@given(allow=st.lists(NETS, max_size=5), deny=st.lists(NETS, max_size=5),
       address=st.ip_addresses(v=4))
def test_address_decision_matches_e2b(allow: list[str], deny: list[str],
                                      address: IPv4Address) -> None:
    policy = EgressPolicy.from_wire({"allowOut": allow, "denyOut": deny})
    in_allow = any(address in IPv4Network(n, strict=False) for n in allow)
    in_deny = any(address in IPv4Network(n, strict=False) for n in deny)
    assert policy.allows(address) == (in_allow or not in_deny)


def test_decisions_bind_names_to_addresses() -> None:
    only = EgressPolicy.from_wire({"allowOut": ["a.test", "1.2.3.4"], "denyOut": ["0.0.0.0/0"],
                                   "dnsServers": ["9.9.9.9"]})
    assert only.decide("5.5.5.5", 443, "a.test").verdict == "bind"  # if a.test is 5.5.5.5
    assert only.decide("1.2.3.4", 443, "b.test").verdict == "allow"  # the address: any name
    assert only.decide("5.5.5.5", 443, "b.test").verdict == "deny"
    # The DNS server is open on port 53 only.
    assert only.decide("9.9.9.9", 53).verdict == "allow"
    assert only.decide("9.9.9.9", 443, "b.test").verdict == "deny"
    assert not only.allows_unnamed("9.9.9.9", 443) and only.allows_unnamed("9.9.9.9", 53)
    deny_list = EgressPolicy.from_wire({"denyOut": ["bad.test"]})
    assert deny_list.decide("5.5.5.5", 443, "bad.test").verdict == "deny"
    assert deny_list.decide("5.5.5.5", 443, "good.test").verdict == "bind"
    # No readable name on a web port: refused while a name could be denied.
    assert deny_list.decide("5.5.5.5", 443, unnamed=True).verdict == "deny"
    assert deny_list.decide("5.5.5.5", 8080).verdict == "allow"  # other ports: by address
    assert deny_list.filters_quic and not only.filters_quic
    # Nothing denied: a name changes nothing, so it is not bound either.
    rules = EgressPolicy.from_wire({"allowOut": ["a.test"],
                                    "rules": {"http://a.test": [{"transform": {"headers": {}}}]}})
    assert rules.decide("5.5.5.5", 80, "a.test").verdict == "allow"
    assert rules.decide("5.5.5.5", 80, unnamed=True).verdict == "allow"
