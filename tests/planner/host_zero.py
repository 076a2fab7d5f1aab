"""For the planner tests whose figures were pinned before two later changes to the cost model:
host time of every layer implementation set to zero (written before the model charged host
time, planner.host), and the fused backends' scores charged as the unfused products, as the
kernel model did before it timed a fused attention kernel (planner.kernels)."""

import pytest

from planner import costmodel, host, kernels


def zero_host_time(monkeypatch: pytest.MonkeyPatch) -> None:
    zero = host.HostCosts(0.0, 0.0, 0.0, "zero (test)")
    monkeypatch.setattr(host, "_BY_IMPL", {k: zero for k in host._BY_IMPL})


def unfused_score_products(monkeypatch: pytest.MonkeyPatch) -> None:
    def products(dev, m, mbs, query_groups, fused=False):
        return kernels.attention_times(dev, m, mbs, query_groups, False)

    monkeypatch.setattr(costmodel, "kernel_attention_times", products)


def pinned_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device model the pinned figures were written against: both of the above."""
    zero_host_time(monkeypatch)
    unfused_score_products(monkeypatch)
