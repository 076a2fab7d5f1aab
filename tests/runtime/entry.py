"""pretrain_gpt.py as one process, for the errors found before any collective."""

import harness

REPO_FLAGS = ["--mock-data", "--train-iters", "1", "--lr", "1e-3"]


def run_entry(repo_root, *args):
    """pretrain_gpt.py as one plain process (errors that come before any collective)."""
    code, _, err = harness.run_script(
        [repo_root / "pretrain_gpt.py", *args], timeout=180, cwd=repo_root
    )
    return code, err
