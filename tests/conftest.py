"""Fixtures shared by every test directory: repository paths and an in-process `hexi-plan`.

The tests import their helpers as modules of this folder (`harness`, `runtime.plans`,
`launch.hexi_launch_helpers`): pyproject.toml puts it on the import path (pytest's `pythonpath`).

The tests are CPU tests: CUDA is hidden here, before any test imports torch, so this process and
every process a test starts (they inherit the environment) take the CPU path on a GPU host too.
"""

import os
from pathlib import Path

import pytest

# `--cpu-top N` (tests/cpu_time.py): hooks a conftest at the tests' root may define
from cpu_time import pytest_addoption, pytest_configure  # noqa: F401

os.environ["CUDA_VISIBLE_DEVICES"] = ""

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


@pytest.fixture(scope="session")
def repo_root():
    return REPO


@pytest.fixture(scope="session")
def examples_dir():
    return REPO / "examples"


@pytest.fixture
def hexi_plan(capsys):
    """Run `hexi-plan ARGS...` in this process: returns (exit code, stdout, stderr)."""
    from planner.cli import main

    def run(*argv):
        capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def hexi_manual(hexi_plan, examples_dir):
    """`hexi-plan manual` of the tiny model on mini-hetero, global batch 8, writing `out`:
    run(out, *extra flags, pipelines=a pipelines file, default the bundled 4-rank one) returns
    (exit code, stdout, stderr)."""

    def run(out, *extra, pipelines=None):
        return hexi_plan(
            "manual",
            "--cluster",
            examples_dir / "clusters" / "mini-hetero.yaml",
            "--model",
            "tiny",
            "--global-batch-size",
            8,
            "--pipelines",
            pipelines or examples_dir / "pipelines" / "hetero-4rank.json",
            "-o",
            out,
            *extra,
        )

    return run


@pytest.fixture
def hexi_search(hexi_plan, examples_dir):
    """`hexi-plan plan` of the tiny model, global batch 8, writing `out`: run(out, *extra flags,
    cluster=a bundled cluster file name, default mini-hetero.yaml) returns (exit code, stdout,
    stderr)."""

    def run(out, *extra, cluster="mini-hetero.yaml"):
        return hexi_plan(
            "plan",
            "--cluster",
            examples_dir / "clusters" / cluster,
            "--model",
            "tiny",
            "--global-batch-size",
            8,
            "-o",
            out,
            *extra,
        )

    return run


# ---- parallel runs (pytest-xdist; tools/test.sh passes `-n 2 --dist loadfile`) ----

# Folders whose test files share session fixtures: all their tests run on one worker, so that
# what the fixture makes is made once (tests/slurm: the one localhost Slurm, whose fixed ports
# two workers could not both bind; tests/data: the preprocessed corpora).
SHARED_SESSION = ("tests/slurm/", "tests/data/")
# The longest units, longest first (a unit's tests together took 30 to 190 s on a 2-core machine),
# handed out before the others so that the workers finish together instead of one waiting on the
# other's last long unit. Only an order: a unit missing here runs after these, as xdist orders it.
LONGEST_FIRST = (
    "tests/planner/test_neighbour_consistency.py",
    "tests/data/",
    "tests/planner/test_search.py",
    "tests/slurm/",
    "tests/runtime/test_elastic.py",
    "tests/runtime/test_islands.py",
    "tests/foundation/test_broken_inputs.py",
    "tests/profiling/test_profile.py",
    "tests/test_gpu_check.py",
    "tests/foundation/test_readme_commands.py",
    "tests/runtime/test_p2p_order.py",
    "tests/launch/test_elastic_launch.py",
    "tests/launch/test_launch.py",
    "tests/test_harness.py",
    "tests/runtime/test_fp16.py",
)


def _unit(nodeid):
    """The unit of work a worker takes whole: a test file, or a SHARED_SESSION folder."""
    path = nodeid.split("::", 1)[0]
    return next((folder for folder in SHARED_SESSION if path.startswith(folder)), path)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With `--dist loadfile`: xdist's file-by-file scheduling, with the units of `_unit` (a
    file's module fixtures are made once, a SHARED_SESSION folder's session fixtures too) and the
    LONGEST_FIRST units first."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return _unit(nodeid)

        def _assign_work_unit(self, node):
            for unit in LONGEST_FIRST:
                if unit in self.workqueue:
                    self.workqueue.move_to_end(unit, last=False)
                    break
            super()._assign_work_unit(node)

    return Scheduling(config, log)
