"""agentenv.logs.PerKeyLimit: per key, the first lines of each window whole, the rest counted
by kind and summarized once the window is over (a clock of the test's, not time)."""

from __future__ import annotations

import logging

import pytest

from agentenv.logs import PerKeyLimit


def test_lines_past_the_burst_are_counted_and_summarized(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limit = PerKeyLimit(logging.getLogger("test.limit"), burst=2, window=60.0,
                        clock=lambda: now[0])
    caplog.set_level(logging.INFO, "test.limit")
    for _ in range(5):
        limit.log("10.0.0.3", "denied", logging.INFO, "denied", {"event": "denied"})
    limit.log("10.0.0.3", "dns_refused", logging.INFO, "refused", {"event": "dns_refused"})
    limit.log("10.0.0.5", "denied", logging.INFO, "denied", {"event": "denied"})  # its own
    limit.flush()  # the window is not over: nothing yet
    assert [r.__dict__["event"] for r in caplog.records] == ["denied", "denied", "denied"]
    now[0] = 61.0
    limit.log("10.0.0.3", "denied", logging.INFO, "denied", {"event": "denied"})  # a new window
    summary = caplog.records[3].__dict__
    assert summary["event"] == "log_suppressed" and summary["key"] == "10.0.0.3"
    assert summary["suppressed"] == {"denied": 3, "dns_refused": 1}
    assert caplog.records[4].__dict__["event"] == "denied"
    limit.flush()  # 10.0.0.5's window is over, with nothing suppressed: no summary
    assert len(caplog.records) == 5


def test_keys_past_the_bound_share_one_window(caplog: pytest.LogCaptureFixture) -> None:
    limit = PerKeyLimit(logging.getLogger("test.limit"), burst=1, max_keys=2,
                        clock=lambda: 0.0)
    caplog.set_level(logging.INFO, "test.limit")
    for n in range(10):
        limit.log(f"10.0.0.{n}", "denied", logging.INFO, "denied", {"event": "denied"})
    limit.flush(everything=True)
    assert [r.__dict__["event"] for r in caplog.records] == ["denied"] * 3 + ["log_suppressed"]
    assert caplog.records[3].__dict__["key"] == "*"
    assert caplog.records[3].__dict__["suppressed"] == {"denied": 7}
