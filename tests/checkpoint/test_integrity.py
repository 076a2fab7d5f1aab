"""Checkpoints prove their integrity: checksums per block of each tensor, the iteration and a save
id in every rank file, checked on --load (under another plan: resharding), on export and on every
read, block by block for what is read.

Copies of the `straight` checkpoint (plan A, 4 ranks; iter_0000002 and iter_0000004), rewritten
with 1 KiB checksum blocks so that the tiny model's tensors span many, are damaged one way each:
a flipped byte in a weight, a flipped byte in an Adam moment, a NaN written into a weight (each
past the first block of a tensor that a loading rank reads), a rank file copied from the other
save, an edited iteration, checkpoint.json without "files". One 2-rank job (another plan) loads
each and must get the same one-line error naming the file (and the tensor) on every rank; the same
job fails a save with a full disk and checks that it left nothing behind. One pretrain_gpt.py
launch shows the error as it reaches users: a `pretrain_gpt.py: error:` line and exit code 2 on
every rank, also on the rank that read nothing damaged. The rest runs in this process.
"""

import json
import math
import os
import re
import shutil
import struct
import time
import zlib

import pytest
import torch
from safetensors import safe_open

from checkpoint.hf_models import converter, tiny_llama
from checkpoint.launching import TWO_STAGES, launch, wait_all
from checkpoint.workers import BASE_FLAGS, load_each
from harness import run_distributed
from megatron_hexi import checkpoint as ck
from megatron_hexi.checkpoint import METADATA, TRACKER, Checkpoint, CheckpointError
from planner.layout import canonical_shards
from planner.models import load_model
from runtime.plans import write_plan

ITER = "iter_0000004"
SMALL_BLOCK = 1024


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
        data[pos : pos + len(new_bytes)] = new_bytes
    path.write_bytes(bytes(data))


def reblock(root, block_bytes):
    """Rewrite every checkpoint under `root` with checksum blocks of `block_bytes`: the same
    tensors, iteration and save id, checkpoint.json updated and its checksum recomputed."""
    for meta_path in sorted(root.glob(f"*/{METADATA}")):
        d = meta_path.parent
        meta = json.loads(meta_path.read_text())
        for fname, rows in meta["files"].items():
            with safe_open(str(d / fname), framework="pt") as f:
                header = f.metadata()
                entries = [
                    (
                        r["kind"],
                        r["name"],
                        r["dim"],
                        r["start"],
                        r["shape"],
                        f.get_tensor(r["key"]).clone(),
                    )
                    for r in rows
                ]
            os.unlink(d / fname)
            meta["files"][fname] = ck.write_rank_file(
                d / fname, entries, int(header["iteration"]), header["save_id"], block_bytes
            )
        meta["block_bytes"] = block_bytes
        meta["checksum"] = ck.meta_checksum(meta)
        meta_path.write_text(json.dumps(meta))


def block_of(element, block_bytes=SMALL_BLOCK):
    """Regex of the mismatch naming the block that holds fp32 element `element`."""
    i = 4 * element // block_bytes
    return rf"\(block {i}, bytes \[{i * block_bytes}, \d+\): stored crc32:"


def numel(row):
    return ck.tensor_bytes(row) // ck.ITEMSIZE[row["dtype"]]


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
    src = root / "src"
    shutil.copytree(straight[0] / "ckpt", src)
    reblock(src, SMALL_BLOCK)
    cases = {}

    def copy(label):
        d = root / label
        shutil.copytree(src, d)
        return d

    d = copy("intact")
    cases["intact"] = (d, None, "^ok$")

    # The job's 2-stage plan holds whole layers (no TP): a rank reads every byte of the tensors
    # of its stage. Layer 3 is read only by launch rank 1, layer 0 and the embedding by rank 0.
    # The damage sits past the first block of a multi-block tensor.
    d = copy("weight")
    fname, row = find_row(d / ITER, "param", "decoder.layers.3.mlp.linear_fc2")
    at = numel(row) // 2 + 5
    patch(d / ITER / fname, row["key"], at)
    cases["weight"] = (
        d,
        None,
        rf"{ITER}/{fname}: param of {re.escape(row['name'])} \(tensor "
        rf"{re.escape(row['key'])}\) does not match its checksum " + block_of(at),
    )
    d = copy("moment")
    fname, row = find_row(d / ITER, "exp_avg_sq", "embedding.")
    at = numel(row) // 2 + 7
    patch(d / ITER / fname, row["key"], at)
    cases["moment"] = (
        d,
        None,
        rf"{ITER}/{fname}: exp_avg_sq of {re.escape(row['name'])} "
        rf"\(tensor {re.escape(row['key'])}\) does not match its checksum " + block_of(at),
    )
    d = copy("nan")
    fname, row = find_row(d / ITER, "param", "decoder.layers.0.mlp")
    at = numel(row) - 3
    patch(d / ITER / fname, row["key"], at, struct.pack("<f", math.nan))
    cases["nan"] = (
        d,
        None,
        rf"{ITER}/{fname}: param of {re.escape(row['name'])} \(tensor "
        rf"{re.escape(row['key'])}\) does not match its checksum " + block_of(at),
    )
    d = copy("other_save")
    shutil.copy(d / "iter_0000002" / "rank_00001.safetensors", d / ITER)
    cases["other_save"] = (
        d,
        None,
        rf"{ITER}/rank_00001.safetensors: from another save "
        rf"\(iteration 2, save id \w+; checkpoint.json has iteration "
        rf"4, save id \w+\)",
    )
    d = copy("iteration")
    edit_meta(d / ITER, lambda m: m.update(iteration=6))
    cases["iteration"] = (
        d,
        None,
        rf"{ITER}/checkpoint.json: iteration 6, but its directory is "
        rf"the checkpoint of iteration 4",
    )
    d = copy("no_files")
    edit_meta(d / ITER, lambda m: m.pop("files"))
    cases["no_files"] = (d, None, rf"{ITER}/checkpoint.json: key 'files' missing")
    return cases


def test_damaged_checkpoints_are_refused_on_every_rank(damaged, tmp_path):
    """Each damage is one error naming the file and the tensor, the same on both ranks (each reads
    other parts: the plan differs from the saving one); a save failing on a full disk, and one
    refused on both ranks for an inf that one rank holds, leave no `.iter_*.tmp` and the previous
    checkpoint loads."""
    plan = write_plan(tmp_path, "two_stages", "tiny", 2, TWO_STAGES)
    save_dir = tmp_path / "save"
    shutil.copytree(damaged["intact"][0], save_dir)
    cases = [(label, d, step) for label, (d, step, _) in damaged.items()]
    results = run_distributed(load_each, 2, plan, cases, save_dir, timeout=300)
    assert results[0] == results[1], results
    got = results[0]
    for label, (_, _, pattern) in damaged.items():
        print(f"{label}: {got[label]}")
        assert len(got[label].splitlines()) == 1, got[label]
        assert re.search(pattern, got[label]), (label, got[label])
    assert "checkpoint save of iteration 6" in got["disk full"], got["disk full"]
    assert "No space left on device" in got["disk full"], got["disk full"]
    assert re.fullmatch(
        r"checkpoint save of iteration 8: exp_avg_sq of \S+ \(tensor "
        r"exp_avg_sq/\S+\) is not finite: not saved; the last complete "
        r"checkpoint is iteration 4 \(launch rank 1\)",
        got["non-finite"],
    ), got["non-finite"]
    assert got["left over"] == [], got["left over"]
    assert got["after failed saves"] == 4
    assert (save_dir / TRACKER).read_text() == "4"
    assert not (save_dir / "iter_0000006").exists() and not (save_dir / "iter_0000008").exists()


def error_line_of_each_rank(tmp_path, tag, argv):
    """pretrain_gpt.py on 2 ranks (plain processes): each must exit 2 with exactly one error line
    and no traceback. Returns each rank's error line."""
    procs = launch(tmp_path, tag, argv, 2)
    codes = wait_all(procs, time.monotonic() + 180)
    for p in procs:
        if p.poll() is None:
            p.kill()
    found = []
    for rank in range(2):
        err = (tmp_path / f"{tag}.{rank}.err").read_text()
        assert codes[rank] == 2, (rank, codes, err[-3000:])
        assert "Traceback" not in err, err[-3000:]
        lines = [x for x in err.splitlines() if x.startswith("pretrain_gpt.py: error:")]
        assert len(lines) == 1, err[-3000:]
        found.append(lines[0])
    return found


def test_pretrain_gpt_reports_a_damaged_checkpoint_on_every_rank(damaged, tmp_path):
    """Only launch rank 1 reads the damaged layer; both ranks print the error and exit 2."""
    d, _, pattern = damaged["weight"]
    plan = write_plan(tmp_path, "two_stages", "tiny", 2, TWO_STAGES)
    argv = [
        "--hetero-plan-path",
        str(plan),
        *BASE_FLAGS,
        "--train-iters",
        "4",
        "--load",
        str(d),
        "--distributed-timeout-minutes",
        "1",
    ]
    for line in error_line_of_each_rank(tmp_path, "load", argv):
        assert re.search(pattern, line), line
        assert line.endswith("(launch rank 1)"), line


def _read_everything(path, step=None):
    with Checkpoint(str(path), step) as ckpt:
        for s in canonical_shards(load_model("tiny")):
            for kind in ck.KINDS:
                ckpt.read_full(s.name, s.shape, s.dim, kind)


def test_checkpoint_records_checksums_iteration_and_save_id(straight):
    saves = {}
    for it in (2, 4):
        d = straight[0] / "ckpt" / f"iter_{it:07d}"
        meta = json.loads((d / METADATA).read_text())
        assert meta["iteration"] == it and meta["checksum"] == ck.meta_checksum(meta)
        assert meta["block_bytes"] == ck.BLOCK_BYTES
        for fname, rows in meta["files"].items():
            with safe_open(str(d / fname), framework="pt") as f:
                header = f.metadata()
                assert header["iteration"] == str(it) and header["save_id"] == meta["save_id"]
                assert header["block_bytes"] == str(ck.BLOCK_BYTES)
                assert json.loads(header["index"]) == rows
                for row in rows:
                    t = f.get_tensor(row["key"])
                    assert row["checksums"] == ck.block_checksums(t, ck.BLOCK_BYTES)
                    # The tiny model's tensors fit in one block: its CRC-32 is the tensor's.
                    data = t.reshape(-1).view(torch.uint8).numpy()
                    assert row["checksums"] == [f"{zlib.crc32(data):08x}"]
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
    entries = []
    with Checkpoint(str(d)) as ckpt:
        for r in meta["files"][fname]:
            t = ckpt._open(fname).get_tensor(r["key"]).clone()
            if r["key"] == row["key"]:
                t.view(-1)[1] = math.inf
            entries.append((r["kind"], r["name"], r["dim"], r["start"], r["shape"], t))
    os.unlink(path)
    rows = ck.write_rank_file(path, entries, 4, meta["save_id"])
    edit_meta(d / ITER, lambda m: m["files"].update({fname: rows}), fix_checksum=True)
    with pytest.raises(
        CheckpointError,
        match=rf"{ITER}/{fname}: exp_avg of "
        rf"{re.escape(row['name'])} \(tensor "
        rf"{re.escape(row['key'])}\) holds NaN or inf",
    ):
        _read_everything(d)


def test_edited_checkpoint_json_is_refused(straight, tmp_path):
    """An iteration edited together with the directory name and the pointer fails the content
    checksum; with the checksum recomputed too, the rank files' iteration and save id."""
    d = _copy(straight, tmp_path)
    os.rename(d / ITER, d / "iter_0000006")
    (d / TRACKER).write_text("6")
    edit_meta(d / "iter_0000006", lambda m: m.update(iteration=6))
    with pytest.raises(
        CheckpointError,
        match=r"iter_0000006/checkpoint.json: its content does "
        r"not match its checksum",
    ):
        Checkpoint(str(d))
    edit_meta(d / "iter_0000006", lambda m: None, fix_checksum=True)
    with pytest.raises(
        CheckpointError,
        match=r"iter_0000006/rank_\d+.safetensors: from another "
        r"save \(iteration 4, save id \w+; checkpoint.json "
        r"has iteration 6",
    ):
        _read_everything(d)
    # A rank file whose tensor list differs from checkpoint.json's, with the right save id.
    d = tmp_path / "swapped"
    shutil.copytree(straight[0] / "ckpt", d)
    edit_meta(
        d / ITER,
        lambda m: m["files"]["rank_00000.safetensors"][0].update(checksums=["00000000"]),
        fix_checksum=True,
    )
    with pytest.raises(
        CheckpointError,
        match=rf"{ITER}/rank_00000.safetensors: its tensor list "
        rf"and checksums differ from checkpoint.json's",
    ):
        _read_everything(d)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: m.pop("save_id"), r"key 'save_id' missing"),
        (lambda m: m.pop("rng"), r"key 'rng' missing"),
        (lambda m: m.update(iteration="4"), r"iteration must be an integer >= 0, got \"4\""),
        (lambda m: m.update(adam_step=-1), r"adam_step must be null or an integer >= 0, got -1"),
        (
            lambda m: m.update(files=[]),
            r"files must be an object of file name -> list of index rows",
        ),
        (
            lambda m: m["files"].update({"../x.safetensors": []}),
            r"files: '../x.safetensors' is not a rank file name",
        ),
        (
            lambda m: m["files"]["rank_00000.safetensors"][0].pop("checksums"),
            r"key files.rank_00000.safetensors\[0\].'checksums' missing",
        ),
        (
            lambda m: m["files"]["rank_00000.safetensors"][0].update(checksums=["crc32:0"]),
            r"files.rank_00000.safetensors\[0\].checksums must be a list of crc32s",
        ),
        (
            lambda m: m["files"]["rank_00000.safetensors"][0]["checksums"].append("00000000"),
            r"files.rank_00000.safetensors\[0\].checksums has 2 entries, "
            r"its \d+ bytes make 1 blocks",
        ),
        (lambda m: m.update(block_bytes=0), r"block_bytes must be an integer >= 1, got 0"),
        (lambda m: m.pop("block_bytes"), r"key 'block_bytes' missing"),
        (
            lambda m: m["files"]["rank_00000.safetensors"][1].update(dtype="int8"),
            r"files.rank_00000.safetensors\[1\].dtype must be one of float32",
        ),
        (
            lambda m: m["files"]["rank_00000.safetensors"][0].update(start=10**6),
            r"files.rank_00000.safetensors\[0\] \(\S+\) is inconsistent",
        ),
    ],
)
def test_malformed_checkpoint_json_names_the_key(straight, tmp_path, change, message):
    d = _copy(straight, tmp_path)
    edit_meta(d / ITER, change)
    with pytest.raises(CheckpointError, match=rf"{ITER}/checkpoint.json: {message}"):
        Checkpoint(str(d))


def test_export_refuses_a_damaged_checkpoint(tmp_path, capsys):
    conv = converter()
    tiny_llama(tmp_path / "hf", layers=2)
    conv.import_hf(tmp_path / "hf", tmp_path / "ckpt", seq_length=32)
    assert (
        conv.main(["export", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "ok")])
        == 0
    )
    name = "decoder.layers.1.mlp.linear_fc2.weight"
    path = tmp_path / "ckpt" / "release" / "rank_00000.safetensors"
    patch(path, f"param/{name}/0", 11)
    capsys.readouterr()
    assert (
        conv.main(["export", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "bad")])
        == 2
    )
    err = capsys.readouterr().err
    assert re.fullmatch(
        rf"convert_hf_llama.py: error: {re.escape(str(path))}: param of "
        rf"{re.escape(name)} \(tensor param/{re.escape(name)}/0\) does not "
        rf"match its checksum \(block 0, bytes \[0, \d+\): stored "
        rf"crc32:[0-9a-f]{{8}}, read crc32:[0-9a-f]{{8}}\): changed "
        rf"or damaged after the save\n",
        err,
    ), err
    assert not (tmp_path / "bad" / "model.safetensors").exists()


def test_previous_format_is_refused(straight, tmp_path):
    """A checkpoint of format 2 (one checksum per tensor) is refused with the version named."""
    d = _copy(straight, tmp_path)
    edit_meta(d / ITER, lambda m: m.update(format_version=2), fix_checksum=True)
    with pytest.raises(
        CheckpointError,
        match=rf"{ITER}/checkpoint.json: format_version 2, this "
        rf"runtime reads {ck.FORMAT_VERSION}$",
    ):
        Checkpoint(str(d))


@pytest.mark.parametrize("seed", range(3))
def test_overlapping_blocks_match_the_bytes_of_the_slice(seed):
    """The blocks marked are exactly those holding a byte of the slice (brute force over bytes)."""
    rng = torch.Generator().manual_seed(seed)
    for _ in range(200):
        ndim = int(torch.randint(1, 4, (1,), generator=rng))
        shape = [int(x) for x in torch.randint(1, 7, (ndim,), generator=rng)]
        itemsize = [2, 4, 8][int(torch.randint(0, 3, (1,), generator=rng))]
        block = int(torch.randint(1, 40, (1,), generator=rng))
        dim = int(torch.randint(0, ndim, (1,), generator=rng))
        a = int(torch.randint(0, shape[dim] + 1, (1,), generator=rng))
        b = int(torch.randint(a, shape[dim] + 1, (1,), generator=rng))
        offsets = torch.arange(math.prod(shape) * itemsize).reshape(*shape, itemsize)
        inside = offsets.narrow(dim, a, b - a).reshape(-1)
        want = sorted(set((inside // block).tolist()))
        got = ck.overlapping_blocks(shape, itemsize, dim, a, b, block).nonzero()[0].tolist()
        assert got == want, (shape, itemsize, dim, a, b, block)
        nbytes = offsets.numel()
        in_blocks = sum(1 for x in range(nbytes) if x // block in set(got))
        assert ck.blocks_bytes(got, block, nbytes) == in_blocks, (got, block, nbytes)


def _blocked_copy(straight, tmp_path):
    d = _copy(straight, tmp_path)
    reblock(d, SMALL_BLOCK)
    return d


def _read(d, row, lo, hi):
    """Read [lo, hi) of `row`'s stored range with a fresh Checkpoint; returns the Checkpoint."""
    want = list(row["shape"])
    want[row["dim"]] = hi - lo
    out = torch.empty(want)
    with Checkpoint(str(d)) as ckpt:
        ckpt.read_range(
            row["kind"], row["name"], row["dim"], row["start"] + lo, hi - lo, row["shape"], out
        )
    return ckpt


def test_a_slice_along_the_first_dimension_checks_only_its_blocks(straight, tmp_path):
    """Reading the first half of a tensor stored along dim 0 checks about half of its blocks; a
    flipped byte in the other half is not read (and not reported), one in the half read is, and
    reading the whole tensor finds either."""
    d = _blocked_copy(straight, tmp_path)
    fname, row = find_row(d / ITER, "exp_avg", "decoder.layers.0.mlp.linear_fc1")
    assert row["dim"] == 0 and len(row["checksums"]) >= 8
    half = row["length"] // 2
    nbytes = ck.tensor_bytes(row)
    ckpt = _read(d, row, 0, half)
    assert ckpt.read_bytes == nbytes * half // row["length"]
    assert ckpt.read_bytes <= ckpt.checked_bytes < ckpt.read_bytes + SMALL_BLOCK
    path = d / ITER / fname
    late = numel(row) - 2  # in the half not read
    patch(path, row["key"], late)
    _read(d, row, 0, half)
    pattern = rf"{fname}: exp_avg of {re.escape(row['name'])} .* does not match its checksum "
    with pytest.raises(CheckpointError, match=pattern + block_of(late)):
        _read(d, row, half, row["length"])
    with pytest.raises(CheckpointError, match=pattern + block_of(late)):
        _read_everything(d)
    patch(path, row["key"], late)  # flipped back: intact again
    _read_everything(d)
    patch(path, row["key"], 3)  # in the half read
    with pytest.raises(CheckpointError, match=pattern + block_of(3)):
        _read(d, row, 0, half)


def test_slices_along_an_inner_dimension_check_each_block_once(straight, tmp_path):
    """Two halves of a tensor split along dim 1 each touch every row, so every block; reading
    both (as a rank holding two pieces does) checks each block once, not once per slice, and
    either half finds a flipped byte anywhere."""
    d = _blocked_copy(straight, tmp_path)
    fname, row = find_row(d / ITER, "param", "decoder.layers.1.mlp.linear_fc2")
    assert row["dim"] == 1 and len(row["checksums"]) >= 8
    nbytes, half = ck.tensor_bytes(row), row["length"] // 2
    with Checkpoint(str(d)) as ckpt:
        for lo, hi in ((0, half), (half, row["length"])):
            out = torch.empty(row["shape"][0], hi - lo)
            ckpt.read_range("param", row["name"], 1, row["start"] + lo, hi - lo, row["shape"], out)
    assert ckpt.read_bytes == nbytes and ckpt.checked_bytes == nbytes
    one = _read(d, row, half, row["length"])
    assert one.checked_bytes == nbytes and one.read_bytes == nbytes - nbytes * half // row["length"]
    patch(d / ITER / fname, row["key"], 0)  # element 0 lies in the first half's columns
    with pytest.raises(
        CheckpointError,
        match=rf"{re.escape(row['key'])}\) does not match its "
        rf"checksum {block_of(0)}",
    ):
        _read(d, row, half, row["length"])


def test_a_full_read_finds_a_flipped_byte_anywhere(straight, tmp_path):
    """Every block boundary, the first and last byte and a sample in between, each flipped alone,
    is found by reading the whole checkpoint, naming its block."""
    d = _blocked_copy(straight, tmp_path)
    fname, row = find_row(d / ITER, "exp_avg_sq", "decoder.layers.2.self_attention.linear_qkv")
    path = d / ITER / fname
    offset, size = data_range(path, row["key"])
    assert size == ck.tensor_bytes(row) and size > 4 * SMALL_BLOCK
    spots = {0, size - 1, size // 3}
    spots |= {b + e for b in range(SMALL_BLOCK, size, SMALL_BLOCK) for e in (-1, 0)}
    for pos in sorted(spots):
        data = bytearray(path.read_bytes())
        data[offset + pos] ^= 0x80
        path.write_bytes(bytes(data))
        i = pos // SMALL_BLOCK
        with pytest.raises(
            CheckpointError,
            match=rf"{re.escape(row['key'])}\) does not match "
            rf"its checksum \(block {i}, bytes "
            rf"\[{i * SMALL_BLOCK}, ",
        ):
            _read_everything(d)
        data[offset + pos] ^= 0x80
        path.write_bytes(bytes(data))
    _read_everything(d)


def test_non_finite_finds_nan_and_inf_in_every_dtype_and_layout():
    """The loader's NaN/inf test: any float dtype, strided slices, huge finite values pass."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        big = torch.finfo(dtype).max
        t = torch.full((6, 5), big, dtype=dtype)
        t[1, 1] = -big
        assert not ck.non_finite(t) and not ck.non_finite(t[:, 2:4])
        assert not ck.non_finite(torch.empty(0, 3, dtype=dtype))
        for bad in (math.nan, math.inf, -math.inf):
            u = t.clone()
            u[4, 3] = bad
            assert ck.non_finite(u) and ck.non_finite(u[:, 3:]), (dtype, bad)
            assert not ck.non_finite(u[:, :3]), (dtype, bad)  # the slice read is clean
            assert ck.non_finite(u[4, 3]), (dtype, bad)  # zero dimensions


def test_a_failed_read_releases_the_pool_and_files(damaged):
    """A checksum failure leaves the `with` with the CheckpointError, the verification threads
    stopped and the mappings released; the pool is bounded (VERIFY_THREADS, the cores)."""
    d, step, pattern = damaged["weight"]
    sizes = []
    with pytest.raises(CheckpointError, match=pattern):
        with Checkpoint(str(d), step) as ckpt:
            for s in canonical_shards(load_model("tiny")):
                ckpt.read_full(s.name, s.shape, s.dim)
                sizes.append(ckpt._pool._max_workers)
    assert set(sizes) == {min(ck.VERIFY_THREADS, len(os.sched_getaffinity(0)))}, sizes
    assert ckpt._pool is None and not ckpt._files and not ckpt._tensors
    # An error of the reader's own (not of the checks) is the one raised; release never raises.
    with pytest.raises(KeyError, match="mine"):
        with Checkpoint(str(d), step) as ckpt:
            for s in canonical_shards(load_model("tiny")):
                out = torch.empty(s.shape)
                ckpt.read_range("param", s.name, s.dim, 0, s.shape[s.dim], s.shape, out)
            raise KeyError("mine")
    assert ckpt._pool is None and not ckpt._files


def test_params_only_save_refuses_non_finite(tmp_path):
    model = load_model("tiny")
    tensors = {s.name: torch.zeros(s.shape) for s in canonical_shards(model)}
    name = canonical_shards(model)[1].name
    tensors[name][0] = math.nan
    with pytest.raises(
        CheckpointError,
        match=rf"param of {re.escape(name)} \(tensor "
        rf"param/{re.escape(name)}/0\) is not finite: not "
        rf"saved",
    ):
        ck.save_params_only(str(tmp_path / "out"), model, tensors)
    assert not (tmp_path / "out").exists()


def test_pretrain_gpt_refuses_to_save_non_finite_weights(tmp_path):
    """lr 1e30 without clipping, told to keep going: iteration 1 saves, iteration 2's weights are
    NaN. The save of iteration 2 fails on both ranks with one line naming a tensor and the last
    complete checkpoint (exit 2), which stays in place and loads."""
    plan = write_plan(tmp_path, "two_stages", "tiny", 2, TWO_STAGES)
    save = tmp_path / "ckpt"
    argv = [
        "--hetero-plan-path",
        str(plan),
        *BASE_FLAGS,
        "--train-iters",
        "3",
        "--lr",
        "1e30",
        "--clip-grad",
        "0",
        "--no-check-for-nan-in-loss-and-grad",
        "--save",
        str(save),
        "--save-interval",
        "1",
        "--distributed-timeout-minutes",
        "1",
    ]
    for line in error_line_of_each_rank(tmp_path, "nan", argv):
        assert re.fullmatch(
            r"pretrain_gpt.py: error: checkpoint save of iteration 2: (param|exp_avg|exp_avg_sq) "
            r"of \S+ \(tensor \S+\) is not finite(, as are \d+ more tensors)?: not saved; the "
            r"last complete checkpoint is iteration 1 \(launch ranks? [01](, 1)?\)",
            line,
        ), line
    assert (save / TRACKER).read_text() == "1"
    assert sorted(os.listdir(save)) == ["iter_0000001", TRACKER]
    with Checkpoint(str(save)) as ckpt:
        for s in canonical_shards(load_model("tiny")):
            ckpt.read_full(s.name, s.shape, s.dim)
