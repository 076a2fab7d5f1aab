"""Fixtures shared by every test directory: repository paths and an in-process `hexi-plan`.

The tests import their helpers as modules of this folder (`harness`, `runtime.plans`,
`launch.hexi_launch_helpers`): pyproject.toml puts it on the import path (pytest's `pythonpath`).

The tests are CPU tests: CUDA is hidden here, before any test imports torch, so this process and
every process a test starts (they inherit the environment) take the CPU path on a GPU host too.
"""

import os
from pathlib import Path

import pytest

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
