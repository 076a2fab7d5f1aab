"""Checkpoints prove their integrity: checksums per tensor, the iteration and a save id in every
rank file, checked on --load (under another plan: resharding), on export and on every read.

Copies of the `straight` checkpoint (plan A, 4 ranks; iter_0000002 and iter_0000004) are damaged
one way each: a flipped byte in a weight, a flipped byte in an Adam moment, a NaN written into a
weight, a rank file copied from the other save, an edited iteration, checkpoint.json without
"files". One 2-rank job (another plan) loads each and must get the same one-line error naming the
file (and the tensor) on every rank; the same job fails a save with a full disk and checks that it
left nothing behind. One pretrain_gpt.py launch shows the error as it reaches users: a
`pretrain_gpt.py: error:` line and exit code 2 on every rank, also on the rank that read nothing
damaged. The rest runs in this process.
"""
import json
import math
import os
import re
import shutil
import struct
import time

import pytest
import torch

from conftest import REPO
from harness import run_distributed
from checkpoint.test_failures import TWO_STAGES, launch, wait_all
from checkpoint.test_hf_llama import converter, tiny_llama
from checkpoint.workers import BASE_FLAGS, load_each
from megatron_hexi import checkpoint as ck
from megatron_hexi.checkpoint import METADATA, TRACKER, Checkpoint, CheckpointError
from planner.layout import canonical_shards
from planner.models import load_model
from runtime.plans import write_plan

ITER = "iter_0000004"


def data_range(path, key):
    """(offset, bytes) of tensor `key`'s data in a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    begin, end = header[key]["data_offsets"]
    return 8 + n + begin, end - begin


def patch(path, key, element, new_bytes=None):
    """Flip the lowest byte of fp32 element `element` of `key` (a tiny change of one value, as a
    bad disk or network makes), or write `new_bytes` there."""
    offset, size = data_range(path, key)
    assert 4 * element + 4 <= size
    data = bytearray(path.read_bytes())
    pos = offset + 4 * element
    if new_bytes is None:
        data[pos] ^= 0x01
    else:
        data[pos:pos + len(new_bytes)] = new_bytes
    path.write_bytes(bytes(data))


def find_row(ckpt_dir, kind, prefix):
    """(file name, index row) of the first `kind` tensor whose name starts with `prefix`."""
    meta = json.loads((ckpt_dir / METADATA).read_text())
    for fname, rows in sorted(meta["files"].items()):
        for row in rows:
            if row["kind"] == kind and row["name"].startswith(prefix) and row["length"] > 1:
                return fname, row
    raise AssertionError(f"no {kind} of {prefix}*")


def edit_meta(ckpt_dir, change, fix_checksum=False):
    path = ckpt_dir / METADATA
    meta = json.loads(path.read_text())
    change(meta)
    if fix_checksum:
        meta["checksum"] = ck.meta_checksum(meta)
    path.write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def damaged(straight, tmp_path_factory):
    """{label: (directory, step, regex the error must match)}: damaged copies of `straight`."""
    root = tmp_path_factory.mktemp("damaged")
    src = straight[0] / "ckpt"
    cases = {}

    def copy(label):
        d = root / label
        shutil.copytree(src, d)
        return d

    d = copy("intact")
    cases["intact"] = (d, None, "^ok$")

    # Layer 3 is read only by launch rank 1 under the 2-stage plan the job loads with.
    d = copy("weight")
    fname, row = find_row(d / ITER, "param", "decoder.layers.3.")
    patch(d / ITER / fname, row["key"], 5)
    cases["weight"] = (d, None, rf"{ITER}/{fname}: param of {re.escape(row['name'])} \(tensor "
                                rf"{re.escape(row['key'])}\) does not match its checksum")
    d = copy("moment")
    fname, row = find_row(d / ITER, "exp_avg_sq", "embedding.")
    patch(d / ITER / fname, row["key"], 7)
    cases["moment"] = (d, None, rf"{ITER}/{fname}: exp_avg_sq of {re.escape(row['name'])} "
                                rf"\(tensor {re.escape(row['key'])}\) does not match its checksum")
    d = copy("nan")
    fname, row = find_row(d / ITER, "param", "decoder.layers.0.mlp")
    patch(d / ITER / fname, row["key"], 3, struct.pack("<f", math.nan))
    cases["nan"] = (d, None, rf"{ITER}/{fname}: param of {re.escape(row['name'])} \(tensor "
                             rf"{re.escape(row['key'])}\) does not match its checksum")
    d = copy("other_save")
    shutil.copy(d / "iter_0000002" / "rank_00001.safetensors", d / ITER)
    cases["other_save"] = (d, None, rf"{ITER}/rank_00001.safetensors: from another save "
                                    rf"\(iteration 2, save id \w+; checkpoint.json has iteration "
                                    rf"4, save id \w+\)")
    d = copy("iteration")
    edit_meta(d / ITER, lambda m: m.update(iteration=6))
    cases["iteration"] = (d, None, rf"{ITER}/checkpoint.json: iteration 6, but its directory is "
                                   rf"the checkpoint of iteration 4")
    d = copy("no_files")
    edit_meta(d / ITER, lambda m: m.pop("files"))
    cases["no_files"] = (d, None, rf"{ITER}/checkpoint.json: key 'files' missing")
    return cases


def test_damaged_checkpoints_are_refused_on_every_rank(damaged, tmp_path):
    """Each damage is one error naming the file and the tensor, the same on both ranks (each reads
    other parts: the plan differs from the saving one); a save failing on a full disk leaves no
    `.iter_*.tmp` and the previous checkpoint loads."""
    plan = write_plan(tmp_path, "two_stages", "tiny", 2, TWO_STAGES)
    save_dir = tmp_path / "save"
    shutil.copytree(damaged["intact"][0], save_dir)
    cases = [(label, d, step) for label, (d, step, _) in damaged.items()]
    results = run_distributed(load_each, 2, plan, cases, save_dir, timeout=300)
    assert results[0] == results[1], results
    got = results[0]
    for label, (d, _, pattern) in damaged.items():
        print(f"{label}: {got[label]}")
        assert len(got[label].splitlines()) == 1, got[label]
        assert re.search(pattern, got[label]), (label, got[label])
    assert "checkpoint save of iteration 6" in got["disk full"], got["disk full"]
    assert "No space left on device" in got["disk full"], got["disk full"]
    assert got["left over"] == [], got["left over"]
    assert got["after disk full"] == 4
    assert (save_dir / TRACKER).read_text() == "4"


def test_pretrain_gpt_reports_a_damaged_checkpoint_on_every_rank(damaged, tmp_path):
    """Only launch rank 1 reads the damaged layer; both ranks print the error and exit 2."""
    d, _, pattern = damaged["weight"]
    plan = write_plan(tmp_path, "two_stages", "tiny", 2, TWO_STAGES)
    argv = ["--hetero-plan-path", str(plan), *BASE_FLAGS, "--train-iters", "4", "--load", str(d),
            "--distributed-timeout-minutes", "1"]
    procs = launch(tmp_path, "load", argv, 2)
    codes = wait_all(procs, time.monotonic() + 180)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for rank in range(2):
        err = (tmp_path / f"load.{rank}.err").read_text()
        assert codes[rank] == 2, (rank, codes, err[-3000:])
        assert "Traceback" not in err, err[-3000:]
        lines = [x for x in err.splitlines() if x.startswith("pretrain_gpt.py: error:")]
        assert len(lines) == 1 and re.search(pattern, lines[0]), err[-3000:]
        assert lines[0].endswith("(launch rank 1)"), lines[0]


def _read_everything(path, step=None):
    ckpt = Checkpoint(str(path), step)
    for s in canonical_shards(load_model("tiny")):
        for kind in ck.KINDS:
            ckpt.read_full(s.name, s.shape, s.dim, kind)


def test_checkpoint_records_checksums_iteration_and_save_id(straight):
    from safetensors import safe_open
    saves = {}
    for it in (2, 4):
        d = straight[0] / "ckpt" / f"iter_{it:07d}"
        meta = json.loads((d / METADATA).read_text())
        assert meta["iteration"] == it and meta["checksum"] == ck.meta_checksum(meta)
        for fname, rows in meta["files"].items():
            with safe_open(str(d / fname), framework="pt") as f:
                header = f.metadata()
                assert header["iteration"] == str(it) and header["save_id"] == meta["save_id"]
                assert json.loads(header["index"]) == rows
                for row in rows:
                    assert row["checksum"] == ck.tensor_checksum(f.get_tensor(row["key"]))
        saves[it] = meta["save_id"]
    assert saves[2] != saves[4] and all(re.fullmatch(r"[0-9a-f]{16}", s) for s in saves.values())


def test_damage_found_by_every_reader(damaged):
    """Checkpoint.read_full (export, tests) refuses what --load refuses."""
    for label, (d, step, pattern) in damaged.items():
        if label == "intact":
            _read_everything(d, step)
            continue
        with pytest.raises(CheckpointError, match=pattern):
            _read_everything(d, step)


def _copy(straight, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(straight[0] / "ckpt", dst)
    return dst


def test_non_finite_values_are_refused(straight, tmp_path):
    """A NaN or inf that was saved (its checksum is right) is refused too, naming the tensor."""
    d = _copy(straight, tmp_path)
    fname, row = find_row(d / ITER, "exp_avg", "decoder.final_layernorm")
    path = d / ITER / fname
    meta = json.loads((d / ITER / METADATA).read_text())
    ckpt = Checkpoint(str(d))
    entries = []
    for r in meta["files"][fname]:
        t = ckpt._open(fname).get_tensor(r["key"]).clone()
        if r["key"] == row["key"]:
            t.view(-1)[1] = math.inf
        entries.append((r["kind"], r["name"], r["dim"], r["start"], r["shape"], t))
    ckpt.close()
    os.unlink(path)
    rows = ck.write_rank_file(path, entries, 4, meta["save_id"])
    edit_meta(d / ITER, lambda m: m["files"].update({fname: rows}), fix_checksum=True)
    with pytest.raises(CheckpointError, match=rf"{ITER}/{fname}: exp_avg of "
                                              rf"{re.escape(row['name'])} \(tensor "
                                              rf"{re.escape(row['key'])}\) holds NaN or inf"):
        _read_everything(d)


def test_edited_checkpoint_json_is_refused(straight, tmp_path):
    """An iteration edited together with the directory name and the pointer fails the content
    checksum; with the checksum recomputed too, the rank files' iteration and save id."""
    d = _copy(straight, tmp_path)
    os.rename(d / ITER, d / "iter_0000006")
    (d / TRACKER).write_text("6")
    edit_meta(d / "iter_0000006", lambda m: m.update(iteration=6))
    with pytest.raises(CheckpointError, match=r"iter_0000006/checkpoint.json: its content does "
                                              r"not match its checksum"):
        Checkpoint(str(d))
    edit_meta(d / "iter_0000006", lambda m: None, fix_checksum=True)
    with pytest.raises(CheckpointError, match=r"iter_0000006/rank_\d+.safetensors: from another "
                                              r"save \(iteration 4, save id \w+; checkpoint.json "
                                              r"has iteration 6"):
        _read_everything(d)
    # A rank file whose tensor list differs from checkpoint.json's, with the right save id.
    d = tmp_path / "swapped"
    shutil.copytree(straight[0] / "ckpt", d)
    edit_meta(d / ITER, lambda m: m["files"]["rank_00000.safetensors"][0].update(
        checksum=ck.CHECKSUM + ":00000000"), fix_checksum=True)
    with pytest.raises(CheckpointError, match=rf"{ITER}/rank_00000.safetensors: its tensor list "
                                              rf"and checksums differ from checkpoint.json's"):
        _read_everything(d)


@pytest.mark.parametrize("change, message", [
    (lambda m: m.pop("save_id"), r"key 'save_id' missing"),
    (lambda m: m.pop("rng"), r"key 'rng' missing"),
    (lambda m: m.update(iteration="4"), r"iteration must be an integer >= 0, got \"4\""),
    (lambda m: m.update(adam_step=-1), r"adam_step must be null or an integer >= 0, got -1"),
    (lambda m: m.update(files=[]), r"files must be an object of file name -> list of index rows"),
    (lambda m: m["files"].update({"../x.safetensors": []}),
     r"files: '../x.safetensors' is not a rank file name"),
    (lambda m: m["files"]["rank_00000.safetensors"][0].pop("checksum"),
     r"key files.rank_00000.safetensors\[0\].'checksum' missing"),
    (lambda m: m["files"]["rank_00000.safetensors"][1].update(dtype="int8"),
     r"files.rank_00000.safetensors\[1\].dtype must be one of float32"),
    (lambda m: m["files"]["rank_00000.safetensors"][0].update(start=10 ** 6),
     r"files.rank_00000.safetensors\[0\] \(\S+\) is inconsistent"),
])
def test_malformed_checkpoint_json_names_the_key(straight, tmp_path, change, message):
    d = _copy(straight, tmp_path)
    edit_meta(d / ITER, change)
    with pytest.raises(CheckpointError, match=rf"{ITER}/checkpoint.json: {message}"):
        Checkpoint(str(d))


def test_export_refuses_a_damaged_checkpoint(tmp_path, capsys):
    conv = converter()
    tiny_llama(tmp_path / "hf", layers=2)
    conv.import_hf(tmp_path / "hf", tmp_path / "ckpt", seq_length=32)
    assert conv.main(["export", "--load", str(tmp_path / "ckpt"), "--output",
                      str(tmp_path / "ok")]) == 0
    name = "decoder.layers.1.mlp.linear_fc2.weight"
    path = tmp_path / "ckpt" / "release" / "rank_00000.safetensors"
    patch(path, f"param/{name}/0", 11)
    capsys.readouterr()
    assert conv.main(["export", "--load", str(tmp_path / "ckpt"), "--output",
                      str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"convert_hf_llama.py: error: {re.escape(str(path))}: param of "
                        rf"{re.escape(name)} \(tensor param/{re.escape(name)}/0\) does not "
                        rf"match its checksum \(stored crc32:[0-9a-f]{{8}}, read "
                        rf"crc32:[0-9a-f]{{8}}\): changed "
                        rf"or damaged after the save\n", err), err
    assert not (tmp_path / "bad" / "model.safetensors").exists()
