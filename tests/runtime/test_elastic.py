"""Elastic runs on torch elastic (c10d rendezvous) on localhost: three agents of one process each
stand for the three nodes of a cluster file (HEXI_PLAN_NODE per agent). The run plans at every
start (--hetero-cluster) and survives the loss of a node and its return, with the losses of a
straight one-rank run.

One job covers both: three nodes train; one agent and its worker are SIGKILLed after a
checkpoint; the other two restart, re-plan for two nodes and resume from the checkpoint; then the
third agent starts again, the two running workers get SIGTERM from their agents, save at the end
of the step (--exit-signal-handler) and the three re-plan and resume from that checkpoint, with no
step lost.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from harness import (
    CPU_ONLY_ENV,
    THREADS_ENV,
    _descendants,
    _kill_tree,
    check_no_abort,
    free_port,
    run_script,
    start_script,
)
from runtime.plans import EXACT_FLAGS

NODES = ("n-0", "n-1", "n-2")
TRAIN_ITERS = 30
SAVE_INTERVAL = 10
CLUSTER = """\
name: three-cpu-nodes
nodes:
  - {name: n, count: 3, gpu: CPU, gpus_per_node: 1, intra_node: host, nic: "10 Gbit/s"}
"""
TRAINING = [
    "--hetero-model",
    "tiny",
    "--global-batch-size",
    "8",
    "--seq-length",
    "128",
    *EXACT_FLAGS,
    "--train-iters",
    str(TRAIN_ITERS),
    "--seed",
    "1234",
]
# Seconds: a dead agent is dropped after keep_alive_interval x keep_alive_max_attempt without a
# heartbeat; a round closes last_call_timeout after its minimum of nodes have joined.
RDZV_CONF = "join_timeout=120,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
JOB_TIMEOUT = 240


def metrics(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


class ElasticJob:
    """Agents of one rendezvous, each in its own session (killed with its worker as a group)."""

    def __init__(self, repo, tmp):
        self.repo, self.tmp = repo, tmp
        self.port = free_port()
        self.cluster = tmp / "cluster.yaml"
        self.cluster.write_text(CLUSTER)
        self.save = tmp / "ckpt"
        self.metrics = tmp / "metrics.jsonl"
        self.agents = {}
        self.logs = []
        self._commands = self.commands()

    def commands(self):
        """{node: command} as `hexi-launch torchrun --elastic` writes them."""
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "megatron_hexi.launch.cli",
                "torchrun",
                "--elastic",
                str(self.cluster),
                "--model",
                "tiny",
                "--min-nodes",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(self.port),
                "--rdzv-id",
                "elastic-test",
                "--rdzv-conf",
                RDZV_CONF,
                "--entry",
                str(self.repo / "pretrain_gpt.py"),
                "--",
                *[a for a in TRAINING if a not in ("--hetero-model", "tiny")],
                "--save",
                str(self.save),
                "--load",
                str(self.save),
                "--hetero-load-if-exists",
                "--save-interval",
                str(SAVE_INTERVAL),
                "--hetero-metrics-path",
                str(self.metrics),
                "--log-interval",
                "10",
            ],
            cwd=self.repo,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        lines = [line for line in out.stdout.splitlines() if not line.startswith("#")]
        assert len(lines) == len(NODES), out.stdout
        return {node: line for node, line in zip(NODES, lines)}

    def start(self, node, host):
        """Run the node's generated command. All agents here share the endpoint's host, so
        the test says which one hosts the rendezvous store (is_host), and never kills it."""
        log = open(self.tmp / f"agent-{node}-{len(self.logs)}.log", "w")
        self.logs.append(log.name)
        command = self._commands[node].replace(
            f"--rdzv-conf {RDZV_CONF}", f"--rdzv-conf {RDZV_CONF},is_host={int(host)}"
        )
        assert f"HEXI_PLAN_NODE={node} " in command and "is_host" in command
        self.agents[node] = subprocess.Popen(
            ["bash", "-c", f"exec env {command}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **CPU_ONLY_ENV, **THREADS_ENV},
            start_new_session=True,
        )

    def kill(self, node):
        """SIGKILL the node's agent and its worker (a machine lost)."""
        _kill_tree(self.agents[node].pid, group=True)
        self.agents[node].wait()

    def signal_workers(self, nodes, signum):
        """Send `signum` to the workers (not the agents) of `nodes`: SIGSTOP holds a worker
        where it is, so the test decides at which step a node is lost or joins."""
        for node in nodes:
            for pid in _descendants(self.agents[node].pid):
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass

    def log_count(self, node, text):
        """How often the node's current agent log says `text`."""
        name = [n for n in self.logs if f"agent-{node}-" in n][-1]
        return open(name).read().count(text)

    def wait_for(self, what, condition, deadline):
        while not condition():
            time.sleep(0.05)
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.output()}")
            dead = [n for n, p in self.agents.items() if p.poll() not in (None, 0, -9)]
            if dead:
                raise AssertionError(f"agent(s) {dead} failed waiting for {what}\n{self.output()}")

    def output(self):
        return "\n".join(f"==== {name}\n{open(name).read()[-4000:]}" for name in self.logs)

    def close(self):
        for p in self.agents.values():
            if p.poll() is None:
                _kill_tree(p.pid, group=True)


def saved_iteration(save):
    try:
        return int((save / "latest_checkpointed_iteration.txt").read_text())
    except (OSError, ValueError):
        return 0


@pytest.fixture(scope="module")
def one_rank_losses(repo_root, tmp_path_factory):
    """The straight run: one rank, the same model, data, seed and iterations."""
    tmp = tmp_path_factory.mktemp("one-rank")
    (tmp / "cluster.yaml").write_text(
        "name: one\nnodes:\n  - {name: n-0, gpu: CPU, gpus_per_node: 1, intra_node: host, "
        'nic: "10 Gbit/s"}\n'
    )
    code, _, err = run_script(
        [
            repo_root / "pretrain_gpt.py",
            "--hetero-cluster",
            tmp / "cluster.yaml",
            *TRAINING,
            "--hetero-metrics-path",
            tmp / "m.jsonl",
        ],
        env={"HEXI_PLAN_NODE": "n-0"},
        cwd=repo_root,
        timeout=180,
    )
    assert code == 0, err[-3000:]
    rows = metrics(tmp / "m.jsonl")
    assert [r["world_size"] for r in rows] == [1] * TRAIN_ITERS
    return {r["iteration"]: r["lm_loss"] for r in rows}


def test_node_lost_and_back(repo_root, tmp_path, one_rank_losses):
    job = ElasticJob(repo_root, tmp_path)
    deadline = time.monotonic() + JOB_TIMEOUT
    try:
        for i, node in enumerate(NODES):
            job.start(node, host=i == 0)
        job.wait_for(
            "two steps past a checkpoint on three nodes",
            lambda: (
                max((r["iteration"] for r in metrics(job.metrics)), default=0) >= SAVE_INTERVAL + 2
            ),
            deadline,
        )
        # a node is lost after a checkpoint, mid-run
        job.signal_workers(NODES, signal.SIGSTOP)
        lost_after = max(r["iteration"] for r in metrics(job.metrics))
        job.kill("n-2")
        job.signal_workers(NODES[:2], signal.SIGCONT)
        job.wait_for(
            "training on two nodes",
            lambda: any(r["world_size"] == 2 for r in metrics(job.metrics)),
            deadline,
        )
        # a node joins mid-run: the two agents stop their workers with SIGTERM
        job.signal_workers(NODES[:2], signal.SIGSTOP)
        asked = {n: job.log_count(n, "closing signal SIGTERM") for n in NODES[:2]}
        job.start("n-2", host=False)
        job.wait_for(
            "the two agents to send SIGTERM",
            lambda: all(job.log_count(n, "closing signal SIGTERM") > asked[n] for n in asked),
            deadline,
        )
        job.signal_workers(NODES[:2], signal.SIGCONT)
        job.wait_for(
            "the job to finish",
            lambda: all(p.poll() is not None for p in job.agents.values()),
            deadline,
        )
        codes = {n: p.returncode for n, p in job.agents.items()}
        assert codes == {n: 0 for n in NODES}, job.output()
    finally:
        job.close()

    rows = metrics(job.metrics)
    # world sizes in the order the lines were written: 3, then 2, then 3 again
    runs = [rows[0]["world_size"]]
    for r in rows[1:]:
        if r["world_size"] != runs[-1]:
            runs.append(r["world_size"])
    assert runs == [3, 2, 3], (runs, job.output())

    # node loss: the two survivors resumed from the last checkpoint before the loss
    first_two = next(i for i, r in enumerate(rows) if r["world_size"] == 2)
    resumed_at = rows[first_two]["iteration"] - 1
    assert resumed_at % SAVE_INTERVAL == 0 and resumed_at < lost_after  # steps recomputed
    assert rows[first_two]["restored"] == {"optimizer_restored": True, "rng_restored": False}

    # scale-up: SIGTERM made the two save the step they were on; three resumed right after it
    last_two = max(i for i, r in enumerate(rows) if r["world_size"] == 2)
    assert rows[last_two + 1]["iteration"] == rows[last_two]["iteration"] + 1, "a step was lost"
    assert rows[-1]["iteration"] == TRAIN_ITERS

    # each start's plan is kept, named by the iteration it resumed from
    plans = sorted(os.listdir(job.save / "plans"))
    expected = {
        "plan_0.json",
        f"plan_{resumed_at}.json",
        f"plan_{rows[last_two]['iteration']}.json",
    }
    assert set(plans) == expected, plans
    assert [r["plan"] for r in (rows[0], rows[first_two], rows[-1])] == [
        "plan_0.json",
        f"plan_{resumed_at}.json",
        f"plan_{rows[last_two]['iteration']}.json",
    ]
    for name, world in zip(sorted(expected, key=lambda n: int(n[5:-5])), (3, 2, 3)):
        plan = json.loads((job.save / "plans" / name).read_text())
        nodes = [g["name"] for g in plan["cluster"]["nodes"]]
        assert len(plan["ranks"]) == world and len(nodes) == world, (name, nodes)

    # the losses of every iteration (a recomputed one with its last value) are the straight run's
    last = {r["iteration"]: r["lm_loss"] for r in rows}
    assert sorted(last) == list(range(1, TRAIN_ITERS + 1))
    worst = max(abs(last[i] - one_rank_losses[i]) / abs(one_rank_losses[i]) for i in last)
    assert worst < 1e-5, worst


class _Pretrain:
    """pretrain_gpt.py as one process, no launcher (WORLD_SIZE defaults to 1), on node `node`
    (None: unset), forked from the harness's forkserver (it starts in milliseconds); read like
    a Popen."""

    count = 0

    def __init__(self, repo_root, args, node, folder):
        environ = {
            **{k: v for k, v in os.environ.items() if k != "HEXI_PLAN_NODE"},
            **CPU_ONLY_ENV,
            **THREADS_ENV,
            **({"HEXI_PLAN_NODE": node} if node else {}),
        }
        _Pretrain.count += 1
        self.out, self.err = (folder / f"pretrain-{_Pretrain.count}.{s}" for s in ("out", "err"))
        self.proc = start_script(
            [repo_root / "pretrain_gpt.py", *args], environ, repo_root, self.out, self.err
        )

    @property
    def returncode(self):
        return self.proc.poll()

    def poll(self):
        return self.proc.poll()

    def send_signal(self, signum):
        os.kill(self.proc.pid, signum)

    def communicate(self, timeout):
        """(stdout, stderr) once it has ended; past `timeout` s it is killed and fails the test."""
        if self.proc.wait(timeout) is None:
            self.proc.kill()
            self.proc.wait()
            raise subprocess.TimeoutExpired("pretrain_gpt.py", timeout)
        check_no_abort([self.proc.poll()], "pretrain_gpt.py")
        return self.out.read_text(), self.err.read_text()


def _pretrain(repo_root, args, node, folder):
    return _Pretrain(repo_root, [str(a) for a in args], node, folder)


def test_sigterm_saves_the_step_and_resumes_exactly(repo_root, tmp_path, one_rank_losses):
    """--exit-signal-handler: SIGTERM mid-run finishes that step, saves it and exits 0; the same
    command resumes from it (same plan: RNG states restored) with the straight run's losses."""
    (tmp_path / "cluster.yaml").write_text(
        "name: one\nnodes:\n  - {name: n-0, gpu: CPU, gpus_per_node: 1, intra_node: host, "
        'nic: "10 Gbit/s"}\n'
    )
    save, path = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = [
        "--hetero-cluster",
        tmp_path / "cluster.yaml",
        *TRAINING,
        "--save",
        save,
        "--load",
        save,
        "--hetero-load-if-exists",
        "--exit-signal-handler",
        "--hetero-metrics-path",
        path,
    ]
    proc = _pretrain(repo_root, args, "n-0", tmp_path)
    deadline = time.monotonic() + 120
    while len(metrics(path)) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(60)
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    stopped = metrics(path)[-1]["iteration"]
    assert 3 <= stopped < TRAIN_ITERS
    assert f"received signal SIGTERM at iteration {stopped}: saving and exiting" in out
    assert saved_iteration(save) == stopped

    proc = _pretrain(repo_root, args, "n-0", tmp_path)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    rows = metrics(path)
    assert [r["iteration"] for r in rows] == list(range(1, TRAIN_ITERS + 1))
    assert rows[stopped]["restored"] == {"optimizer_restored": True, "rng_restored": True}
    assert sorted(os.listdir(save / "plans")) == sorted({"plan_0.json", f"plan_{stopped}.json"})
    assert {r["iteration"]: r["lm_loss"] for r in rows} == one_rank_losses


def test_start_up_planning_errors(repo_root, tmp_path):
    """Each is one clear error, exit 2: a node the cluster file does not know (named, or a host
    it does not list), and nodes that cannot hold the model. One process each: every rank
    raises what launch rank 0 broadcasts, the path test_node_lost_and_back's ranks take."""
    (tmp_path / "cluster.yaml").write_text(
        "name: pair\nnodes:\n  - {name: n-0, gpu: CPU, gpus_per_node: 2, intra_node: host, "
        'nic: "10 Gbit/s"}\n'
    )
    base = ["--hetero-cluster", tmp_path / "cluster.yaml", "--mock-data", "--train-iters", "2"]
    base += ["--lr", "1e-3", "--global-batch-size", "8"]
    # the three start at once (each is mostly imports)
    unknown, unlisted, too_small = [
        _pretrain(repo_root, [*base, "--hetero-model", model], node, tmp_path)
        for model, node in (("tiny", "elsewhere"), ("tiny", None), ("llama2-7b", "n-0"))
    ]
    _, err = unknown.communicate(timeout=120)
    assert unknown.returncode == 2, err[-3000:]
    assert (
        "pretrain_gpt.py: error: planning at start-up for 1 process(es) on nodes elsewhere (1): "
        "node 'elsewhere' runs processes but is not a node of cluster 'pair' (its nodes: n-0)"
    ) in err
    # without HEXI_PLAN_NODE, the host name must be one of the file's hostnames
    _, err = unlisted.communicate(timeout=120)
    assert unlisted.returncode == 2, err[-3000:]
    assert "could not be placed on a node of cluster 'pair': set HEXI_PLAN_NODE" in err
    # two CPU "GPUs" of 4 GB cannot hold llama2-7b: the planner's own message, naming the gap
    _, err = too_small.communicate(timeout=120)
    assert too_small.returncode == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(
        "pretrain_gpt.py: error: planning at start-up for 1 process(es) on nodes n-0 (1): "
        "no plan fits: llama2-7b"
    ), lines[0]
    assert "missing" in lines[0]


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--hetero-plan-path", "p.json", "--hetero-cluster", "c.yaml"],
            "give exactly one of --hetero-plan-path PLAN.json",
        ),
        ([], "give exactly one of --hetero-plan-path PLAN.json"),
        (["--hetero-cluster", "c.yaml"], "--hetero-cluster needs --hetero-model"),
        (["--hetero-plan-path", "p.json", "--hetero-model", "tiny"], "--hetero-model goes with"),
        (
            ["--hetero-cluster", "c.yaml", "--hetero-model", "tiny"],
            "--hetero-cluster needs --global-batch-size",
        ),
        (
            [
                "--hetero-cluster",
                "c.yaml",
                "--hetero-model",
                "tiny",
                "--global-batch-size",
                "8",
                "--overlap-param-gather",
            ],
            "--overlap-param-gather: needs --use-distributed-optimizer",
        ),
    ],
)
def test_plan_source_flags(flags, message, capsys):
    from megatron_hexi.training import main

    assert main([*flags, "--mock-data", "--train-iters", "1", "--lr", "1e-3"]) == 2
    assert message in capsys.readouterr().err
