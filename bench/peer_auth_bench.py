"""What making and checking a peer credential costs per chunk request: this tree against the code
at a git revision (docs/security.md §5, docs/remote-layers.md §4).

Both ends of one chunk request, in process, no network: what the asking blockd does to make
the Authorization header and what the serving blockd does to check it.

- this tree (s3/r2, each credential taken once): a static peer signs each request (Ed25519 over
  the node, target, time, a fresh 16-byte nonce and the request's SHA-256), the server hashes
  the request, verifies, and records (node, nonce) in its record of credentials taken
  (blockd/remote/nonces.py); a cluster node makes an HMAC over the time, a fresh nonce and the
  request keyed with the issued MAC, and the server computes the issued MAC and the request's,
  then records the nonce.
- --before, a base of one of two kinds, found from its code (loaded from git):
  - bound to the request, no nonce (s2/r1, e.g. 48dbf50): as this tree without the nonce, its
    random bytes and the record;
  - unbound (s1/v1, e.g. f5af0ea): a static peer's credential signed once per 60 s (a dict
    lookup per request) and verified per request; a cluster node sent the scheduler's HMAC
    credential as it was and the server checked one HMAC.

Rounds alternate before/after so that load on the host hits both alike; the median round is
reported. A last line times the record alone in its steady state (entries expiring as new ones
come, 64k live).

    PYTHONPATH=src .venv/bin/python bench/peer_auth_bench.py [--before REV] [--n 5000]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agentenv import cluster_keys as new_keys
from agentenv.blockd.remote import identity as new_identity
from agentenv.blockd.remote.nonces import Use, UsedNonces

ROOT = Path(__file__).resolve().parent.parent
SERVE_KEY = "5e" * 32
DIGEST = "sha256:" + "ab" * 32


def old_module(rev: str, path: str, name: str) -> types.ModuleType:
    """The module at `path` as it was at `rev` (git show), loaded under `name`."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType(name)
    module.__file__ = f"{rev}:{path}"
    sys.modules[name] = module  # (dataclasses look their module up)
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def per_call_us(fn: Callable[[int], None], n: int) -> float:
    started = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - started) / n * 1e6


def make_cases(old_identity: types.ModuleType, old_keys: types.ModuleType,
               key: Ed25519PrivateKey, now: float,
               chunks: int) -> dict[str, dict[str, Callable[[int], None]]]:
    """Both ends of a request for `chunks` chunks, before and after, per kind of credential."""
    claim = ",".join(["cd" * 32] * chunks)
    byte_range = f"bytes=0-{chunks * (1 << 20) - 1}"
    path = f"/blobs/{DIGEST}"
    bound_before = hasattr(old_keys, "peer_request")  # s2/r1; else s1/v1

    # static peers
    old_me = old_identity.NodeIdentity("x", key)
    old_trust = old_identity.TrustedPeers(text=old_me.trust_line() + "\n")
    new_me = new_identity.NodeIdentity("x", key)
    new_trust = new_identity.TrustedPeers(text=new_me.trust_line() + "\n")
    static_record, cluster_record = UsedNonces(), UsedNonces()  # (each server's)

    def static_before(_: int) -> None:
        if bound_before:
            request = old_keys.peer_request("GET", path, byte_range, claim)
            credential = old_me.credential_for("p1", request, now)
            seen = old_keys.peer_request("GET", path, byte_range, claim)
            node, _why = old_identity.check_signed_credential(old_trust, "p1", credential, now,
                                                              seen)
        else:
            credential = old_me.credential_for("p1", now)  # cached: signed once per 60 s
            node, _why = old_identity.check_signed_credential(old_trust, "p1", credential, now)
        assert node == "x"

    def static_after(_: int) -> None:
        request = new_keys.peer_request("GET", path, byte_range, claim)  # the client's
        credential = new_me.credential_for("p1", request)
        seen = new_keys.peer_request("GET", path, byte_range, claim)  # the server's
        at = time.time()
        auth, _why = new_identity.check_signed_credential(new_trust, "p1", credential, at,
                                                          seen)
        assert auth is not None and auth.node == "x"
        used = static_record.use("static/" + auth.node, auth.nonce, auth.until, at)
        assert used is Use.FIRST

    # the scheduler's credentials
    issued_old = old_keys.peer_credential(SERVE_KEY, "x", int(now) + 120)
    issued_new = new_keys.peer_credential(SERVE_KEY, "x", int(now) + 120)

    def cluster_before(_: int) -> None:
        if bound_before:
            request = old_keys.peer_request("GET", path, byte_range, claim)
            credential = old_keys.peer_request_credential(issued_old, request)
            seen = old_keys.peer_request("GET", path, byte_range, claim)
            node, _why = old_keys.check_peer_credential(SERVE_KEY, credential, now, seen)
        else:
            node, _why = old_keys.check_peer_credential(SERVE_KEY, issued_old, now)
        assert node == "x"

    def cluster_after(_: int) -> None:
        request = new_keys.peer_request("GET", path, byte_range, claim)
        credential = new_keys.peer_request_credential(issued_new, request)
        seen = new_keys.peer_request("GET", path, byte_range, claim)
        at = time.time()
        auth, _why = new_keys.check_peer_credential(SERVE_KEY, credential, at, seen)
        assert auth is not None and auth.node == "x"
        used = cluster_record.use("cluster/" + auth.node, auth.nonce, auth.until, at)
        assert used is Use.FIRST

    return {f"static peer, {chunks} chunk(s)": {"before": static_before,
                                                "after": static_after},
            f"scheduler credential, {chunks} chunk(s)": {"before": cluster_before,
                                                         "after": cluster_after}}


def record_steady_state_us(n: int, live: int = 1 << 16) -> float:
    """µs per UsedNonces.use in its steady state: `live` entries held, each new one pushing the
    oldest out by its time (a fake clock: 1000 requests a second, entries good for live/1000
    s)."""
    record = UsedNonces(per_node=live + 1, total=live + 1)
    rate, life = 1000.0, live / 1000.0
    nonces = [new_keys.new_nonce() for _ in range(live + n)]
    for i in range(live):  # fill
        record.use("static/x", nonces[i], i / rate + life, i / rate)
    started = time.perf_counter()
    for i in range(live, live + n):
        record.use("static/x", nonces[i], i / rate + life, i / rate)
    took = time.perf_counter() - started
    assert live - 1000 <= record.size <= live + 1, record.size
    return took / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="6409a85",
                        help="the commit whose credentials are the baseline (6409a85: main "
                             "before credentials were taken once; f5af0ea: before they were "
                             "bound to their request)")
    parser.add_argument("--n", type=int, default=5000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    old_identity = old_module(args.before, "src/agentenv/blockd/remote/identity.py",
                              "old_identity")
    old_keys = old_module(args.before, "src/agentenv/cluster_keys.py", "old_cluster_keys")
    key = Ed25519PrivateKey.generate()
    now = time.time()

    cases: dict[str, dict[str, Callable[[int], None]]] = {}
    for chunks in (1, 64):  # one 1 MiB chunk (what a fetch asks); 64 (the largest range)
        cases.update(make_cases(old_identity, old_keys, key, now, chunks))

    print(f"before = {args.before} (git), after = this tree; {args.n} requests x "
          f"{args.rounds} rounds, median round; µs per request, both ends")
    print(f"{'case':40} {'before':>9} {'after':>9} {'added':>9} {'ratio':>7}")
    for name, pair in cases.items():
        times: dict[str, list[float]] = {"before": [], "after": []}
        for fn in pair.values():  # warm up
            per_call_us(fn, 200)
        for _ in range(args.rounds):
            for which, fn in pair.items():
                times[which].append(per_call_us(fn, args.n))
        before = statistics.median(times["before"])
        after = statistics.median(times["after"])
        print(f"{name:40} {before:9.1f} {after:9.1f} {after - before:9.1f} "
              f"{after / before:7.2f}")
    steady = statistics.median(record_steady_state_us(args.n * 4) for _ in range(args.rounds))
    print(f"{'the record alone, 64k live (of after)':40} {'':9} {steady:9.2f}")


if __name__ == "__main__":
    main()
