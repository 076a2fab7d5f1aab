"""Every command's `--help` ends with runnable examples, and the planner prints MFU in percent.

The examples are checked, not only present: each example line of a command is parsed by that
command's own argument parser (a renamed or removed flag fails here), and every file of the
checkout an example names exists. The commands run as installed console scripts (setup.py's
entry points), so the test also covers the scripts themselves.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from harness import run_script

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _parse_plan(argv):
    from planner.cli import build_parser

    build_parser().parse_args(argv)


def _parse_launch(argv):
    from megatron_hexi.launch.cli import _parser

    _parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)


def _parse_cluster(argv):
    from megatron_hexi.cluster_tools.bench import parse_args
    from megatron_hexi.cluster_tools.cli import detect_parser

    assert argv[0] in ("detect", "bench"), argv
    if argv[0] == "detect":
        detect_parser().parse_args(argv[1:])
    else:
        parse_args(argv[1:])


def _parse_profile(argv):
    from megatron_hexi.profile.cli import build_parser

    build_parser().parse_args(argv)


# (command words, what parses an example's words after the program name)
COMMANDS = [
    (["hexi-plan"], _parse_plan),
    (["hexi-plan", "plan"], _parse_plan),
    (["hexi-plan", "manual"], _parse_plan),
    (["hexi-plan", "show"], _parse_plan),
    (["hexi-plan", "validate"], _parse_plan),
    (["hexi-plan", "simulate"], _parse_plan),
    (["hexi-launch"], _parse_launch),
    (["hexi-launch", "slurm"], _parse_launch),
    (["hexi-launch", "torchrun"], _parse_launch),
    (["hexi-cluster"], _parse_cluster),
    (["hexi-cluster", "detect"], _parse_cluster),
    (["hexi-cluster", "bench"], _parse_cluster),
    (["hexi-profile"], _parse_profile),
]


def examples(help_text):
    """The commands under the last `example:` / `examples:` heading, continuation lines joined."""
    lines = help_text.splitlines()
    heads = [i for i, ln in enumerate(lines) if ln.strip() in ("example:", "examples:")]
    assert heads, f"no example section:\n{help_text}"
    out, cur = [], ""
    for line in lines[heads[-1] + 1 :]:
        if not line.strip():
            break
        cur += " " + line.strip()
        if cur.endswith("\\"):
            cur = cur[:-1]
        else:
            out.append(cur.strip())
            cur = ""
    return out


@pytest.mark.parametrize("command,parse", COMMANDS, ids=[" ".join(c[0]) for c in COMMANDS])
def test_help_shows_a_runnable_example(command, parse):
    """`COMMAND --help` exits 0 and ends with at least one example of that very command (the
    subcommand included); each example parses with the command's own parser, and the files of
    the checkout it names exist."""
    r = subprocess.run(
        [str(BIN / command[0]), *command[1:], "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    mine = []
    for example in examples(r.stdout):
        words = shlex.split(example)
        for w in words:
            if w.startswith("examples/"):
                assert (REPO / w).is_file(), f"{example}: no {w} in the checkout"
        at = [i for i in range(len(words)) if words[i : i + len(command)] == command]
        if at:
            mine.append(words[at[0] + 1 :])  # the words after the program name
    assert mine, f"no example of `{' '.join(command)}` in:\n{r.stdout}"
    for argv in mine:
        parse(argv)


def test_plan_cli_prints_mfu_in_percent(hexi_plan, tmp_path, examples_dir):
    """plan, simulate and show print MFU as a percent (Megatron's unit); the plan's JSON keeps
    the fraction under `estimate.mfu`, and the two agree."""
    out = tmp_path / "plan.json"
    code, stdout, err = hexi_plan(
        "plan",
        "--cluster",
        examples_dir / "clusters" / "paper-hetero-a.yaml",
        "--model",
        "llama2-7b",
        "--global-batch-size",
        "64",
        "-o",
        out,
    )
    assert code == 0, err
    mfu = json.loads(out.read_text())["estimate"]["mfu"]
    assert 0 < mfu < 1
    shown = f"{100 * mfu:.3g}%"
    assert re.search(rf"MFU {re.escape(shown)}; ", stdout), stdout
    code, stdout, err = hexi_plan("simulate", out)
    assert code == 0, err
    assert re.search(rf"^MFU +{re.escape(shown)} ", stdout, re.M), stdout
    code, stdout, err = hexi_plan("simulate", out, "--json")
    assert json.loads(stdout)["mfu"] == pytest.approx(mfu)
    code, stdout, err = hexi_plan("show", out)
    assert code == 0, err
    assert f", MFU {shown}, " in stdout, stdout
    assert not re.search(r"MFU 0\.\d{3}\b", stdout)


@pytest.mark.parametrize("command", ["plan", "manual"])
def test_plan_and_manual_take_the_overlap_flags(command):
    """Both flags and their --no- forms parse; plan leaves them to its default (None), manual
    defaults them off."""
    from planner.cli import build_parser

    base = ["--cluster", "c.yaml", "--model", "tiny", "--global-batch-size", "8", "-o", "p.json"]
    if command == "manual":
        base += ["--pipelines", "p.json"]
    parse = build_parser().parse_args
    args = parse([command, *base])
    default = None if command == "plan" else False
    assert (args.overlap_grad_reduce, args.overlap_param_gather) == (default, default)
    args = parse([command, *base, "--overlap-grad-reduce", "--overlap-param-gather"])
    assert (args.overlap_grad_reduce, args.overlap_param_gather) == (True, True)
    args = parse([command, *base, "--no-overlap-grad-reduce", "--no-overlap-param-gather"])
    assert (args.overlap_grad_reduce, args.overlap_param_gather) == (False, False)


@pytest.mark.parametrize("program", ["hexi-train", "pretrain_gpt.py"])
def test_training_help_shows_a_runnable_example(program):
    """hexi-train and pretrain_gpt.py (the same parser): the example plans a cluster of the
    checkout and trains under the plan; both commands parse with their own parsers."""
    from megatron_hexi.arguments import parse_args

    if program == "hexi-train":  # the installed command, as a user starts it
        r = subprocess.run([BIN / program, "--help"], capture_output=True, text=True, timeout=120)
        code, stdout, stderr = r.returncode, r.stdout, r.stderr
    else:  # the script, forked from the test harness's forkserver
        code, stdout, stderr = run_script([REPO / program, "--help"], timeout=120, cwd=REPO)
    assert code == 0, stderr
    trained = planned = 0
    for example in examples(stdout):
        words = shlex.split(example)
        for w in words:
            if w.startswith("examples/"):
                assert (REPO / w).is_file(), f"{example}: no {w} in the checkout"
        if "pretrain_gpt.py" in words:
            parse_args(words[words.index("pretrain_gpt.py") + 1 :])
            trained += 1
        if words[:2] == ["hexi-plan", "plan"]:
            _parse_plan(words[1:])
            planned += 1
    assert trained and planned, stdout


def test_pretrain_gpt_help_lists_every_flag_with_its_default():
    """pretrain_gpt.py --help names every flag the parser has, each with its help text and its
    default (the parser's HelpFormatter adds `(default: ...)` where the help does not say it)."""
    from megatron_hexi.flags import build_parser

    code, stdout, stderr = run_script([REPO / "pretrain_gpt.py", "--help"], timeout=120, cwd=REPO)
    assert code == 0, stderr
    text = " ".join(stdout.split())
    flags = [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]
    for action in flags:
        assert f" {action.option_strings[0]} " in text, f"{action.option_strings[0]} not shown"
    shown = [a for a in flags if not a.help.startswith("refused:")]  # refused: no default
    assert text.count("default") >= len(shown), text.count("default")
