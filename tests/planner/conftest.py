"""Fixtures of the planner tests."""

import pytest

from planner import host


@pytest.fixture
def device_only(monkeypatch):
    """Host time of every layer implementation set to zero: for the tests whose figures are the
    device model's alone (written before the cost model charged host time, planner.host)."""
    zero = host.HostCosts(0.0, 0.0, 0.0, "zero (test)")
    monkeypatch.setattr(host, "_BY_IMPL", {k: zero for k in host._BY_IMPL})
