"""The planner is pure Python: every planner module imports, and `hexi-plan validate` runs, with
torch and megatron made unimportable."""

import json
import subprocess
import sys
import textwrap

BLOCKED = ("torch", "megatron", "transformer_engine", "apex")

_SCRIPT = textwrap.dedent("""
    import importlib, importlib.abc, json, pkgutil, sys
    BLOCKED = {blocked!r}
    assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED], "imported at start-up"

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is blocked: the planner must not need it")
            return None

    sys.meta_path.insert(0, Block())
    import planner, planner.cli
    names, failed = [], []
    for mod in pkgutil.walk_packages(planner.__path__, "planner."):
        if mod.name == "planner.__main__":          # runs the CLI on import
            continue
        try:
            importlib.import_module(mod.name)
            names.append(mod.name)
        except Exception as e:
            failed.append(f"{{mod.name}}: {{type(e).__name__}}: {{e}}")
    code = planner.cli.main(["validate", {plan!r}])
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    print("RESULT", json.dumps({{"modules": names, "failed": failed, "code": code,
                                 "leaked": leaked}}))
""")


def test_planner_imports_without_torch(examples_dir, repo_root):
    script = _SCRIPT.format(blocked=BLOCKED, plan=str(examples_dir / "plans" / "hetero-4rank.json"))
    r = subprocess.run(
        [sys.executable, "-c", script], cwd=repo_root, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, r.stdout + r.stderr
    result = json.loads(line[0][len("RESULT ") :])
    assert result["failed"] == [], "\n".join(result["failed"])
    assert result["code"] == 0 and "valid plan, 4 ranks" in r.stdout
    assert result["leaked"] == []
    assert {
        "planner.plan",
        "planner.cli",
        "planner.cluster",
        "planner.units",
        "planner.models",
        "planner.catalog",
        "planner.errors",
    } <= set(result["modules"])


_ENTRY = textwrap.dedent("""
    import importlib.abc, json, runpy, sys
    BLOCKED = {blocked!r}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is blocked: a command line is checked without it")
            return None

    sys.meta_path.insert(0, Block())
    from megatron_hexi.arguments import check_command_line
    from planner.errors import SpecError

    try:
        check_command_line({argv!r})
    except SpecError as e:
        print("PROBLEMS", json.dumps([str(p) for p in e.problems]), flush=True)
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    print("LEAKED", json.dumps(leaked), flush=True)
    sys.argv = ["pretrain_gpt.py", *{argv!r}]
    runpy.run_path("pretrain_gpt.py", run_name="__main__")  # the script itself: exits
""")


def _entry(repo_root, argv):
    script = _ENTRY.format(blocked=BLOCKED, argv=[str(a) for a in argv])
    return subprocess.run(
        [sys.executable, "-c", script], cwd=repo_root, capture_output=True, text=True, timeout=120
    )


def test_pretrain_gpt_refuses_a_command_line_without_torch(examples_dir, repo_root):
    """A refused command line (a bad choice, a refused flag, a plan contradiction) is checked
    and reported, in one message, with torch and megatron unimportable: the script exits 2
    with one error line per problem and no traceback."""
    plan = examples_dir / "plans" / "hetero-4rank.json"
    argv = ["--hetero-plan-path", plan, "--mock-data", "--train-iters", "2", "--lr", "1e-3"]
    argv += ["--lr-decay-style", "wavy", "--ckpt-format", "torch_dist", "--hidden-size", "99"]
    r = _entry(repo_root, argv)
    assert r.returncode == 2, r.stderr
    lines = dict(ln.split(" ", 1) for ln in r.stdout.splitlines() if ln[:1].isupper())
    problems = json.loads(lines["PROBLEMS"])
    assert json.loads(lines["LEAKED"]) == []
    assert len(problems) == 3, problems
    assert r.stderr.splitlines() == [f"pretrain_gpt.py: error: {p}" for p in problems]
    assert "invalid choice: 'wavy'" in problems[0] and "--ckpt-format is refused" in problems[1]
    assert "--hidden-size 99 contradicts the plan's model hidden_size 64" in problems[2]


def test_pretrain_gpt_help_without_torch(repo_root):
    """--help needs neither torch nor megatron (it prints in a fraction of a second)."""
    r = _entry(repo_root, ["--help"])
    assert r.returncode == 0, r.stderr
    assert "--hetero-plan-path" in r.stdout and "--exit-duration-in-mins" in r.stdout
    assert "Traceback" not in r.stderr
