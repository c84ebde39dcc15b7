"""The Prometheus port of blockd and the scheduler: prometheus_client's exposition server with
a deadline on each connection. Its own `start_http_server` gives a connection no timeout and
a thread each, so connections that never send a request (anyone who reaches the port, where
`--metrics-bind` opens it beyond loopback) each held a thread of the process for ever."""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

#: seconds a connection may wait for a read or a write (a scrape is one short request)
IDLE_TIMEOUT = 10.0


class _Handler(_SilentHandler):
    timeout = IDLE_TIMEOUT  # socketserver.StreamRequestHandler: the connection's timeout


class _Server6(ThreadingWSGIServer):
    address_family = socket.AF_INET6


def serve(port: int, bind: str, registry: CollectorRegistry) -> WSGIServer:
    """Serve `registry` on bind:port from a daemon thread; shutdown() and server_close() stop
    it."""
    server = _Server6 if ":" in bind else ThreadingWSGIServer  # an IPv6 address
    httpd = make_server(bind, port, make_wsgi_app(registry), server, handler_class=_Handler)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd
