"""`--cpu-top N`: the N tests that used the most CPU, their own and their processes'.

On a 2-core machine the suite is bound by CPU, and wall-clock durations under two xdist workers
mislead: a test that waits looks as slow as one that computes, and either doubles while the other
worker is busy. This counts, per test (set-up, call and tear-down), the CPU seconds of the
process that runs it and of every process it started: those reaped (`RUSAGE_CHILDREN`, which
holds their own reaped children too) and those still alive at either end (read from /proc, the
test forkserver's jobs among them through its own reaped-children counters). Processes that
leave their parent (daemons, a Slurm job's steps) are not counted.

    python -m pytest tests -n 2 --dist loadfile --cpu-top 25

Linux only (elsewhere the live processes count as 0). Off by default: it reads /proc twice per
test.
"""

from __future__ import annotations

import os
import resource

import pytest

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_KEY = "cpu_s"  # the user property a teardown report carries
_START = pytest.StashKey[float]()  # a test's CPU seconds when it started


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-top",
        type=int,
        default=0,
        metavar="N",
        help="print the N tests that used the most CPU seconds (their processes' included)",
    )


def _live_children_s(pid: int) -> float:
    """CPU seconds of pid's live children, with the children they reaped."""
    total = 0.0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children = f.read().split()
        except OSError:
            continue
        for child in children:
            try:
                with open(f"/proc/{child}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # utime, stime, cutime, cstime: fields 14-17 of proc(5), 12-15 after the name
            total += sum(int(x) for x in fields[11:15]) / _TICK
    return total


def _cpu_s() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (
        me.ru_utime
        + me.ru_stime
        + reaped.ru_utime
        + reaped.ru_stime
        + _live_children_s(os.getpid())
    )


def pytest_configure(config):
    if config.getoption("cpu_top"):
        config.pluginmanager.register(CpuTop(config.getoption("cpu_top")), "cpu-top")


class CpuTop:
    """Measures each test where it runs (an xdist worker, or this process) and, where the
    reports arrive (the controller, or this process), prints the top ones at the end."""

    def __init__(self, top: int):
        self.top = top
        self.rows: list[tuple[float, str]] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        item.stash[_START] = _cpu_s()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if call.when == "teardown" and _START in item.stash:
            # the teardown report carries it from an xdist worker to the controller
            outcome.get_result().user_properties.append((_KEY, _cpu_s() - item.stash[_START]))

    def pytest_runtest_logreport(self, report):
        if report.when == "teardown":
            self.rows += [(v, report.nodeid) for k, v in report.user_properties if k == _KEY]

    def pytest_terminal_summary(self, terminalreporter):
        if not self.rows:
            return
        total = sum(cpu for cpu, _ in self.rows)
        terminalreporter.write_sep(
            "=", f"most CPU: {self.top} of {len(self.rows)} tests, {total:.0f} CPU s in all"
        )
        for cpu, nodeid in sorted(self.rows, reverse=True)[: self.top]:
            terminalreporter.write_line(f"{cpu:8.1f}s {nodeid}")
