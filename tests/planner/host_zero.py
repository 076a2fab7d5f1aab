"""For the planner tests whose figures are the device model's alone (written before the cost
model charged host time, planner.host): host time of every layer implementation set to zero."""

import pytest

from planner import host


def zero_host_time(monkeypatch: pytest.MonkeyPatch) -> None:
    zero = host.HostCosts(0.0, 0.0, 0.0, "zero (test)")
    monkeypatch.setattr(host, "_BY_IMPL", {k: zero for k in host._BY_IMPL})
