"""The contained-failure log: the first of a kind with its traceback, then a count."""

from __future__ import annotations

import logging

import pytest

from controller.containment import Failures


def boom(message: str) -> ValueError:
    try:
        raise ValueError(message)
    except ValueError as exc:
        return exc


def test_first_failure_has_its_traceback_then_a_count_every_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failures = Failures(interval=30.0)
    with caplog.at_level(logging.ERROR, logger="controller"):
        failures.failed("a datagram", boom("first"), 100.0)
        assert caplog.records[-1].exc_info is not None
        assert "first" in caplog.text
        failures.failed("a datagram", boom("second"), 101.0)  # the first summary: at once
        assert "1 more inputs failed" in caplog.records[-1].getMessage()
        lines = len(caplog.records)
        for second in range(102, 131):
            failures.failed("a datagram", boom("again"), float(second))
        assert len(caplog.records) == lines  # within 30 s of the last summary: counted only
        failures.failed("a datagram", boom("later"), 131.0)
        assert "30 more inputs failed" in caplog.records[-1].getMessage()
        failures.failed("a request", boom("other kind"), 131.5)  # a new kind: its traceback
        assert caplog.records[-1].exc_info is not None
    assert failures.total == 33


def test_failures_of_one_kind_from_many_peers_log_one_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failures = Failures(interval=30.0)
    with caplog.at_level(logging.ERROR, logger="controller"):
        for port in range(1000, 1100):
            failures.failed("a datagram", boom("x"), 5.0, f"from 127.0.0.1:{port}")
    assert sum(1 for record in caplog.records if record.exc_info) == 1
    assert "from 127.0.0.1:1000" in caplog.text
