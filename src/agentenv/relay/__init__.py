"""Relaying HTTP and WebSocket exchanges to an upstream, streamed both ways: the one relay
the node's sandbox proxy (node/proxy.py) and the cluster gateway (control/gateway/) share.

`relay.server` holds the hardened HTTP/1.1 protocol and the origin-form target rule, `relay.stream`
the relay itself. Nothing here knows about sandboxes' records, nodes or teams.
"""
