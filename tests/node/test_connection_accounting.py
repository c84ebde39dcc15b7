"""The accounting of relay/connections.py against a simple model (hypothesis, stateful): any
sequence of connections admitted, moving between idle, busy and stalled, and released, from a
few clients (one a trusted proxy, two sharing an IPv6 /64). What the limits close or abort to
make room, and when they refuse, must be what the rules say:

- at the total, an idle connection of a client holding the most idle ones goes (that client's
  least recently active), else the longest stalled connection anywhere, else the newcomer is
  refused;
- a client (not a trusted proxy) opening one more while holding its bound of idle connections
  loses its least recently active idle one;
- a client (not a trusted proxy) with more stalled connections than its bound loses its longest
  stalled one;
- a request body counts against the client X-Forwarded-For names when a trusted proxy sends it
  or the request is vouched for (a node's gateway), else against the peer; one past the
  client's bound is refused, a trusted proxy's own are not bounded;
- nothing else is ever closed, and the counts are the model's.

The limits keep idle and stalled connections in their own ordered structures, so none of this
scans the connections (a red-team finding: admit walked every busy connection to find an idle
one)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentenv.relay.connections import ConnectionLimits, State, client_key

TRUSTED = "127.0.0.9"
ADDRESSES = ["127.0.0.1", "127.0.0.2", TRUSTED, "2001:db8::1", "2001:db8::2"]
#: clients a proxy may name (one shares 2001:db8::1's /64, one is a direct client)
FORWARDED = [None, "198.51.100.1", "127.0.0.1", "2001:db8::5"]
VOUCHER = (b"x-vouched", b"yes")


class Fake:
    """A connection as the limits see it: closing or aborting it only records that."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.ended: str | None = None

    def close_idle(self) -> None:
        assert self.ended is None, f"{self} ended twice"
        self.ended = "closed"

    def abort(self) -> None:
        assert self.ended is None, f"{self} ended twice"
        self.ended = "aborted"

    def __repr__(self) -> str:
        return f"conn{self.number}"


class Entry:
    def __init__(self, address: str, since: int) -> None:
        self.address = address
        self.key = client_key(address)
        self.state = State.IDLE
        self.since = since  # when it last became idle or stalled
        self.body: str | None = None  # whose body it receives


class Accounting(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.limits = ConnectionLimits(2, 6, [TRUSTED], stalled_per_client=2, body_per_client=2,
                                       vouch=lambda headers: VOUCHER in headers)
        self.model: dict[Fake, Entry] = {}
        self.tick = 0
        self.made = 0

    def _in(self, state: State, key: str | None = None) -> list[Fake]:
        """The model's connections in `state` (of client `key`), longest in it first."""
        found = [c for c, e in self.model.items()
                 if e.state is state and (key is None or e.key == key)]
        return sorted(found, key=lambda c: self.model[c].since)

    def _ended(self, before: set[Fake]) -> list[Fake]:
        return [c for c in before if c.ended is not None]

    @rule(address=st.sampled_from(ADDRESSES))
    def admit(self, address: str) -> None:
        self.tick += 1
        conn = Fake(self.made)
        self.made += 1
        before = set(self.model)
        idle, stalled = self._in(State.IDLE), self._in(State.STALLED)
        room: set[Fake] = set()  # what may make room at the total
        if len(self.model) >= 6:
            if idle:
                counts = {e.key: len(self._in(State.IDLE, e.key)) for e in self.model.values()}
                most = max(counts.values())
                room = {self._in(State.IDLE, k)[0] for k, n in counts.items() if n == most}
            elif stalled:
                room = {stalled[0]}
            else:
                assert self.limits.admit(conn, address) is not None
                assert not self._ended(before)
                return
        refused = self.limits.admit(conn, address)
        assert refused is None
        ended = set(self._ended(before))
        key = client_key(address)

        def bounded(gone: set[Fake]) -> set[Fake]:  # what the client's idle bound closes
            own = [c for c in self._in(State.IDLE, key) if c not in gone]
            return {own[0]} if address != TRUSTED and len(own) >= 2 else set()

        # the one that made room at the total (if any), then the client's own bound
        options = [{c} for c in room] if room else [set()]
        assert any(ended == took | bounded(took) for took in options), (ended, room)
        for gone in ended:
            assert gone.ended == ("closed" if self.model[gone].state is State.IDLE
                                  else "aborted")
            del self.model[gone]
        self.model[conn] = Entry(address, self.tick)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), state=st.sampled_from(State))
    def move(self, data: st.DataObject, state: State) -> None:
        self.tick += 1
        conn = data.draw(st.sampled_from(sorted(self.model, key=lambda c: c.number)))
        entry = self.model[conn]
        before = set(self.model)
        self.limits.set_state(conn, state)
        ended = self._ended(before)
        if entry.state is not state:
            entry.state = state
            entry.since = self.tick
        if state is State.STALLED and entry.address != TRUSTED:
            own = self._in(State.STALLED, entry.key)
            if len(own) > 2:
                assert ended == [own[0]] and own[0].ended == "aborted"
                del self.model[own[0]]
                return
        assert ended == []

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self.tick += 1
        conn = data.draw(st.sampled_from(sorted(self.model, key=lambda c: c.number)))
        del self.model[conn]
        self.limits.release(conn)
        self.limits.release(conn)  # idempotent

    @precondition(lambda self: self.model)
    @rule(data=st.data(), forwarded=st.sampled_from(FORWARDED), vouched=st.booleans())
    def begin_body(self, data: st.DataObject, forwarded: str | None, vouched: bool) -> None:
        conn = data.draw(st.sampled_from(sorted(self.model, key=lambda c: c.number)))
        entry = self.model[conn]
        headers = [(b"x-forwarded-for", b"203.0.113.1, " + forwarded.encode())] \
            if forwarded else []
        if vouched:
            headers.append(VOUCHER)
        refused = self.limits.begin_body(conn, headers)
        if entry.body is not None:  # already receiving: nothing changes
            assert refused is None
            return
        if forwarded and (vouched or entry.address == TRUSTED):
            key, bounded = client_key(forwarded), True
        else:
            key, bounded = entry.key, entry.address != TRUSTED
        arriving = sum(1 for e in self.model.values() if e.body == key)
        assert (refused is not None) == (bounded and arriving >= 2), (key, arriving)
        if refused is None:
            entry.body = key

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def end_body(self, data: st.DataObject) -> None:
        conn = data.draw(st.sampled_from(sorted(self.model, key=lambda c: c.number)))
        self.limits.end_body(conn)
        self.limits.end_body(conn)  # idempotent
        self.model[conn].body = None

    @invariant()
    def counts_agree(self) -> None:
        assert len(self.limits) == len(self.model)
        assert self.limits.stalled == len(self._in(State.STALLED))
        assert self.limits.idle == len(self._in(State.IDLE))
        assert self.limits.receiving == sum(1 for e in self.model.values() if e.body)
        for conn, entry in self.model.items():
            assert self.limits.state(conn) is entry.state
            assert conn.ended is None


Accounting.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
test_the_accounting_follows_the_rules = Accounting.TestCase
