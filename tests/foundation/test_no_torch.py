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
