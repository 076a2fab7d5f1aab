"""A real Slurm on localhost for the tests in this directory (tools/slurm/localhost.sh).

The session fixture ``slurm_cluster`` reuses a localhost Slurm that is already running (found
through $HEXI_SLURM_ROOT or the script's state file) and leaves it running; otherwise it starts
one under a pytest temp dir (installing the Debian packages if missing) and stops it at the end.
Needs Linux and root; elsewhere the tests are skipped. Deselect with ``-m "not slurm"``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "slurm" / "localhost.sh"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slurm: needs a real Slurm on localhost (tools/slurm/localhost.sh; root)"
    )


@dataclass
class SlurmCluster:
    root: Path
    info: dict  # ROOT/cluster.json: partitions, nodes, GPU types
    env: dict = field(repr=False)  # os.environ plus SLURM_CONF / HEXI_SLURM_ROOT

    def run(self, *args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        return subprocess.run(
            list(args), env=self.env, capture_output=True, text=True, timeout=timeout, **kw
        )


def _script(*args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def _unavailable(reason):
    """Outside CI a machine without what the localhost Slurm needs skips these tests; in CI
    (CI=true) that is a failure, so a broken setup can never pass as skipped."""
    if os.environ.get("CI"):
        pytest.fail(f"Slurm tests cannot run in CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> SlurmCluster:
    if not sys.platform.startswith("linux"):
        _unavailable("localhost Slurm needs Linux")
    if os.geteuid() != 0:
        _unavailable(
            "localhost Slurm needs root (daemons run as root, slurmd in a mount namespace)"
        )
    if shutil.which("sbatch") is None and shutil.which("apt-get") is None:
        _unavailable("Slurm is not installed and there is no apt-get to install it")

    env = dict(os.environ)
    # already running (HEXI_SLURM_ROOT or the state file)? then use it and leave it running
    started = _script("status", env=env, timeout=60).returncode != 0
    if started:
        root = tmp_path_factory.mktemp("slurm")
        env["HEXI_SLURM_ROOT"] = str(root)
        env["HEXI_SLURM_STATE_FILE"] = str(root.parent / "hexi-slurm.state")
        r = _script("start", str(root), env=env, timeout=600)  # includes apt-get if needed
        if r.returncode != 0:
            pytest.fail(f"tools/slurm/localhost.sh start failed:\n{r.stdout}\n{r.stderr}")
    r = _script("env", env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    for line in r.stdout.splitlines():  # export NAME=VALUE, shell-quoted
        name, _, value = shlex.split(line)[1].partition("=")
        env[name] = value
    root = Path(env["HEXI_SLURM_ROOT"])
    info = json.loads((root / "cluster.json").read_text())
    try:
        yield SlurmCluster(root=root, info=info, env=env)
    finally:
        if started:
            r = _script("stop", str(root), env=env, timeout=120)
            assert r.returncode == 0, f"localhost.sh stop failed:\n{r.stdout}\n{r.stderr}"
