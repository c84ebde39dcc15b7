"""A Docker token server for tests: issues RS256 JWTs that docker-registry's `token` auth accepts.

Signed with the openssl CLI (no Python crypto library needed); the certificate travels in the
token's x5c header and is the registry's rootcertbundle.
"""

from __future__ import annotations

import base64
import json
import secrets
import subprocess
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SERVICE = "aenv-test-registry"
ISSUER = "aenv-test-issuer"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    def __init__(self, cert: Path, key: Path, user: str, password: str,
                 refresh_token: str | None = None) -> None:
        self.cert, self.key = cert, key
        self.credentials = (user, password)
        # The OAuth refresh token (docker's identity token) the POST flow accepts.
        self.refresh_token = refresh_token
        self.oauth_requests: list[dict[str, str]] = []  # each POST's form, as received
        self.rotate_refresh_token = False  # answer each grant with a new refresh token
        der = subprocess.run(["openssl", "x509", "-in", str(cert), "-outform", "DER"],
                             check=True, capture_output=True).stdout
        self.x5c = base64.b64encode(der).decode()
        self.issued = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                header = self.headers.get("Authorization", "")
                expected = "Basic " + base64.b64encode(":".join(server.credentials).encode()).decode()
                if header != expected:
                    self.send_response(401)
                    self.end_headers()
                    return
                token = server.token(query.get("scope", []), query.get("service", [""])[0])
                self._reply({"token": token, "expires_in": 300})

            def do_POST(self) -> None:
                # docker's OAuth2 refresh-token grant: a form with grant_type, refresh_token,
                # client_id, service and space-separated scopes; answers access_token.
                length = int(self.headers.get("Content-Length", "0"))
                raw = self.rfile.read(length).decode()
                form = {k: v[0] for k, v in urllib.parse.parse_qs(raw).items()}
                server.oauth_requests.append(form)
                content_type = self.headers.get("Content-Type", "").split(";")[0].strip()
                if server.refresh_token is None:
                    # Without OAuth configured this is a GET-only token server, as old ones are.
                    self._reply({"error": "method not allowed"}, 405)
                    return
                if (content_type != "application/x-www-form-urlencoded"
                        or form.get("grant_type") != "refresh_token" or not form.get("client_id")
                        or form.get("refresh_token") != server.refresh_token):
                    self._reply({"error": "invalid_grant"}, 401)
                    return
                token = server.token(form.get("scope", "").split(), form.get("service", ""))
                reply: dict[str, object] = {"access_token": token, "expires_in": 300,
                                            "scope": form.get("scope")}
                if server.rotate_refresh_token:
                    # Strict rotation: the old refresh token stops working at once.
                    server.refresh_token = reply["refresh_token"] = "rt-" + secrets.token_hex(16)
                self._reply(reply)

            def _reply(self, reply: dict[str, object], status: int = 200) -> None:
                body = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def token(self, scopes: list[str], service: str) -> str:
        access = []
        for scope in scopes:
            kind, name, actions = scope.split(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        claims = {"iss": ISSUER, "sub": self.credentials[0], "aud": service, "exp": now + 300,
                  "nbf": now - 10, "iat": now, "jti": secrets.token_hex(8), "access": access}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        signature = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(self.key)],
                                   input=signing_input.encode(), check=True,
                                   capture_output=True).stdout
        self.issued += 1
        return f"{signing_input}.{_b64url(signature)}"

    def registry_config(self) -> str:
        return (f"auth:\n  token:\n    realm: {self.realm}\n    service: {SERVICE}\n"
                f"    issuer: {ISSUER}\n    rootcertbundle: {self.cert}\n")

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
