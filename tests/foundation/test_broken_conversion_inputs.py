"""Every broken input of tools/convert_hf_llama.py gives one clear line (exit 2, the file or flag
named), never a traceback, and never overwrites, deletes or reads what it should not: a folder it
did not write, a file outside the folder it was given.

The corpus runs through the converter's real `main` in ONE subprocess, each case in a forked
child with its address space and CPU time limited (entry_corpus_runner.py); the inputs are
copies of a tiny random Llama saved by transformers, each broken in one way."""

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from foundation.entry_corpus import CONVERT, Case, check, counts, run_corpus
from foundation.entry_corpus_runner import load_entry

HEADS, GROUPS, HIDDEN = 4, 2, 32
Q_ROWS, KV_ROWS = HIDDEN, HIDDEN // HEADS * GROUPS


def tiny_llama(directory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=GROUPS,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().save_pretrained(directory)


def world_readable(path):
    """Let the unprivileged cases read (not write) a tree."""
    for root, _dirs, files in os.walk(path):
        os.chmod(root, 0o755)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)


class Inputs:
    """Broken copies of the tiny model, one folder per case."""

    def __init__(self, base, root):
        self.base, self.root = base, root

    def copy(self, name):
        d = self.root / name
        shutil.copytree(self.base, d)
        return d

    def config(self, name, **changes):
        d = self.copy(name)
        cfg = json.loads((d / "config.json").read_text())
        for k, v in changes.items():
            if v is KeyError:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    def tensors(self, name, edit):
        d = self.copy(name)
        t = load_file(d / "model.safetensors")
        edit(t)
        save_file(t, d / "model.safetensors", metadata={"format": "pt"})
        return d

    def sharded(self, name, index=None, extra_in_second=()):
        """The model in two shards with an index (`index`: a replacement for its text)."""
        d = self.copy(name)
        t = load_file(d / "model.safetensors")
        (d / "model.safetensors").unlink()
        names = sorted(t)
        first, second = names[: len(names) // 2], names[len(names) // 2 :]
        # a tensor of `extra_in_second` also goes, changed, into the shard the index does not name
        extra_first = [n for n in extra_in_second if n in second]
        extra_second = [n for n in extra_in_second if n in first]
        save_file(
            {n: t[n] for n in first} | {n: t[n] + 1 for n in extra_first},
            d / "model-00001-of-00002.safetensors",
        )
        save_file(
            {n: t[n] for n in second} | {n: t[n] + 1 for n in extra_second},
            d / "model-00002-of-00002.safetensors",
        )
        weight_map = {n: "model-00001-of-00002.safetensors" for n in first} | {
            n: "model-00002-of-00002.safetensors" for n in second
        }
        text = json.dumps({"metadata": {}, "weight_map": weight_map})
        if index is not None:
            text = index(weight_map) if callable(index) else index
        (d / "model.safetensors.index.json").write_text(text)
        return d


def _index_naming(path):
    def index(weight_map):
        moved = next(iter(sorted(weight_map)))
        return json.dumps({"weight_map": {**weight_map, moved: str(path)}})

    return index


def _trained_checkpoint(d):
    d.mkdir()
    (d / "latest_checkpointed_iteration.txt").write_text("7")
    (d / "model.yaml").write_text("num_layers: 1  # the trained run's\n")
    (d / "iter_0000007").mkdir()
    (d / "iter_0000007" / "checkpoint.json").write_text("{}")
    return [d / "latest_checkpointed_iteration.txt", d / "model.yaml"]


def _old_hf_export(d):
    d.mkdir()
    (d / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (d / "model-00001-of-00002.safetensors").write_bytes(b"old shard")
    return [d / "model.safetensors.index.json", d / "model-00001-of-00002.safetensors"]


def build_cases(tmp):
    """(cases, the imported checkpoint the export cases read)."""
    base = tmp / "hf"
    tiny_llama(base)
    inputs = Inputs(base, tmp / "in")
    inputs.root.mkdir()
    out = tmp / "out"
    out.mkdir()
    good = load_entry(CONVERT.replace(":main", ":import_hf"))(base, tmp / "ckpt", 16)[1]
    ckpt = Path(good).parent
    # what an unprivileged child may read, in a folder it cannot write to
    shared = Path(tempfile.mkdtemp(prefix="convert-corpus-"))
    shutil.copytree(base, shared / "hf")
    shutil.copytree(ckpt, shared / "ckpt")
    (shared / "ro").mkdir()
    world_readable(shared)
    os.chmod(shared / "ro", 0o555)
    outside = tmp / "outside.safetensors"
    shutil.copy(base / "model.safetensors", outside)
    (tmp / "outside.json").write_text((base / "config.json").read_text())

    def imp(name, hf, field, output=None, extra=(), **kw):
        return Case(
            f"import {name}",
            CONVERT,
            ["import", "--hf-dir", hf, "--output", output or out / name, *extra],
            field,
            **kw,
        )

    def exp(name, field, output, extra=(), load=ckpt, **kw):
        return Case(
            f"export {name}",
            CONVERT,
            ["export", "--load", load, "--output", output, *extra],
            field,
            **kw,
        )

    cases = []
    # the output folder: what it did not write is never overwritten
    keep = _trained_checkpoint(out / "trained")
    cases.append(imp("into a trained checkpoint", base, "--output", out / "trained", keep=keep))
    (out / "notes.yaml").write_text("user: notes\n")
    cases.append(
        imp(
            "over an existing --model-yaml",
            base,
            "--model-yaml",
            extra=["--model-yaml", out / "notes.yaml"],
            keep=[out / "notes.yaml"],
        )
    )
    (out / "a-file").write_text("x")
    cases.append(imp("output is a file", base, "--output", out / "a-file", keep=[out / "a-file"]))
    cases.append(imp("output under a file", base, "--output", out / "a-file" / "ckpt"))
    cases.append(
        imp(
            "output read-only", shared / "hf", "--output", shared / "ro" / "ckpt", unprivileged=True
        )
    )
    hf_self = inputs.copy("output-is-input")
    cases.append(
        imp(
            "output is the input --overwrite",
            hf_self,
            "--hf-dir",
            hf_self,
            ["--overwrite"],
            keep=[hf_self / "model.safetensors"],
            on_success="data lost",
        )
    )
    # stay inside the folder
    cases.append(
        imp(
            "index names ../x",
            inputs.sharded("dotdot", _index_naming("../../outside.safetensors")),
            "model.safetensors.index.json",
            on_success="read outside",
        )
    )
    cases.append(
        imp(
            "index names an absolute path",
            inputs.sharded("absolute", _index_naming(outside)),
            "model.safetensors.index.json",
            on_success="read outside",
        )
    )
    linked = inputs.copy("symlinked-weights")
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(outside)
    cases.append(imp("symlinked weights", linked, "model.safetensors", on_success="read outside"))
    linked_shard = inputs.sharded("symlinked-shard")
    shard = linked_shard / "model-00001-of-00002.safetensors"
    shutil.move(shard, tmp / "outside-shard.safetensors")
    shard.symlink_to(tmp / "outside-shard.safetensors")
    cases.append(
        imp("symlinked shard", linked_shard, "model-00001-of-00002", on_success="read outside")
    )
    linked_cfg = inputs.copy("symlinked-config")
    (linked_cfg / "config.json").unlink()
    (linked_cfg / "config.json").symlink_to(tmp / "outside.json")
    cases.append(imp("symlinked config", linked_cfg, "config.json", on_success="read outside"))
    # exact or refused: tensors
    norm = "model.norm.weight"
    for dtype in ("int32", "int8", "bool", "float8_e4m3fn"):

        def cast(t, dtype=dtype):
            t[norm] = t[norm].to(getattr(torch, dtype))

        cases.append(imp(f"{dtype} tensor", inputs.tensors(f"dtype-{dtype}", cast), norm))
    cases.append(
        imp(
            "tensor in two shards",
            inputs.sharded("two-shards", extra_in_second=[norm]),
            norm,
        )
    )
    for proj, rows, cols in (
        ("q_proj", Q_ROWS // 2, HIDDEN),
        ("k_proj", KV_ROWS * 2, HIDDEN),
        ("v_proj", KV_ROWS, HIDDEN - 1),
    ):
        name = f"model.layers.0.self_attn.{proj}.weight"

        def reshape(t, name=name, rows=rows, cols=cols):
            t[name] = torch.zeros(rows, cols)

        cases.append(imp(f"wrong {proj} shape", inputs.tensors(f"shape-{proj}", reshape), name))
    # exact or refused: config.json
    for name, changes, field in (
        ("heads missing", {"num_attention_heads": KeyError}, "num_attention_heads"),
        ("heads 0", {"num_attention_heads": 0}, "num_attention_heads"),
        ("heads -4", {"num_attention_heads": -4}, "num_attention_heads"),
        ("heads 4.5", {"num_attention_heads": 4.5}, "num_attention_heads"),
        ("key/value heads 0", {"num_key_value_heads": 0}, "num_key_value_heads"),
        ("hidden_size string", {"hidden_size": "32"}, "hidden_size"),
        ("rope_theta NaN", {"rope_theta": float("nan")}, "rope_theta"),
        ("rope_theta inf", {"rope_theta": float("inf")}, "rope_theta"),
        ("rope_theta string", {"rope_theta": "10000"}, "rope_theta"),
        ("rms_norm_eps NaN", {"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ("rms_norm_eps inf", {"rms_norm_eps": float("inf")}, "rms_norm_eps"),
        ("rms_norm_eps string", {"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
        ("rms_norm_eps 0", {"rms_norm_eps": 0}, "rms_norm_eps"),
    ):
        slug = name.replace(" ", "-").replace("/", "-")
        cases.append(imp(name, inputs.config(slug, **changes), field))
    deep = inputs.copy("deep-config")
    (deep / "config.json").write_text("[" * 100000 + "]" * 100000)
    cases.append(imp("deeply nested config", deep, "config.json"))
    listed = inputs.copy("config-list")
    (listed / "config.json").write_text("[1, 2]")
    cases.append(imp("config is a list", listed, "config.json"))
    # malformed index files
    for name, text in (
        ("index not JSON", "{"),
        ("index a list", "[]"),
        ("index without weight_map", '{"metadata": {}}'),
        ("index weight_map a list", '{"weight_map": []}'),
        ("index file name a number", lambda m: json.dumps({"weight_map": {**m, "x": 1}})),
        ("index names a missing file", _index_naming("model-00009-of-00009.safetensors")),
        ("index deeply nested", '{"weight_map": ' + "[" * 100000 + "]" * 100000 + "}"),
        (
            "index names the wrong shard",
            lambda m: json.dumps({"weight_map": {k: sorted(set(m.values()))[0] for k in m}}),
        ),
    ):
        slug = name.replace(" ", "-")
        cases.append(imp(name, inputs.sharded(slug, text), "model.safetensors.index.json"))
    corrupt = inputs.copy("corrupt-header")
    (corrupt / "model.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"{}")
    cases.append(imp("safetensors header too long", corrupt, "model.safetensors"))
    # export: the output folder
    keep = _old_hf_export(out / "old-hf")
    cases.append(
        exp(
            "into an old sharded export",
            "--output",
            out / "old-hf",
            keep=keep,
            on_success="data lost",
        )
    )
    cases.append(exp("output is a file", "--output", out / "a-file", keep=[out / "a-file"]))
    cases.append(
        exp(
            "output read-only",
            "--output",
            shared / "ro" / "hf",
            load=shared / "ckpt",
            unprivileged=True,
        )
    )
    cases.append(
        exp(
            "output is the checkpoint --overwrite",
            "--output",
            ckpt,
            ["--overwrite"],
            keep=[Path(good) / "checkpoint.json"],
            on_success="data lost",
        )
    )
    cases.append(
        exp(
            "output holds the checkpoint --overwrite",
            "--output",
            tmp,
            ["--overwrite"],
            keep=[Path(good) / "checkpoint.json"],
            on_success="data lost",
        )
    )
    return cases, shared


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("convert")
    cases, shared = build_cases(tmp)
    try:
        results = run_corpus(
            cases,
            tmp,
            preload=[
                "megatron_hexi.checkpoint",
                "safetensors.torch",
                "encodings.utf_8_sig",  # an unprivileged child cannot import from here
            ],
        )
    finally:
        os.chmod(shared / "ro", stat.S_IRWXU)
        shutil.rmtree(shared, ignore_errors=True)
    for c in cases:  # shown with pytest -s
        print(f"{results[c.id]['category']:>14}: {c.id}")
    print("conversion corpus:", counts(results, cases))
    return {c.id: c for c in cases}, results


# the case ids, known without building the inputs (for parametrize)
IDS = [
    "import into a trained checkpoint",
    "import over an existing --model-yaml",
    "import output is a file",
    "import output under a file",
    "import output read-only",
    "import output is the input --overwrite",
    "import index names ../x",
    "import index names an absolute path",
    "import symlinked weights",
    "import symlinked shard",
    "import symlinked config",
    "import int32 tensor",
    "import int8 tensor",
    "import bool tensor",
    "import float8_e4m3fn tensor",
    "import tensor in two shards",
    "import wrong q_proj shape",
    "import wrong k_proj shape",
    "import wrong v_proj shape",
    "import heads missing",
    "import heads 0",
    "import heads -4",
    "import heads 4.5",
    "import key/value heads 0",
    "import hidden_size string",
    "import rope_theta NaN",
    "import rope_theta inf",
    "import rope_theta string",
    "import rms_norm_eps NaN",
    "import rms_norm_eps inf",
    "import rms_norm_eps string",
    "import rms_norm_eps 0",
    "import deeply nested config",
    "import config is a list",
    "import index not JSON",
    "import index a list",
    "import index without weight_map",
    "import index weight_map a list",
    "import index file name a number",
    "import index names a missing file",
    "import index deeply nested",
    "import index names the wrong shard",
    "import safetensors header too long",
    "export into an old sharded export",
    "export output is a file",
    "export output read-only",
    "export output is the checkpoint --overwrite",
    "export output holds the checkpoint --overwrite",
]


def test_corpus_is_complete(corpus):
    cases, _ = corpus
    assert sorted(cases) == sorted(IDS)


@pytest.mark.parametrize("case_id", IDS)
def test_broken_conversion_input(case_id, corpus):
    cases, results = corpus
    check(cases[case_id], results[case_id])


def test_overwrite_replaces_the_output_whole(tmp_path):
    """--overwrite: an import over a trained checkpoint leaves only the import (pointer
    "release", its model.yaml, no old iteration); an export over an old sharded export leaves
    only config.json and model.safetensors; a failed --overwrite run leaves the old output."""
    main = load_entry(CONVERT)
    tiny_llama(tmp_path / "hf")
    _trained_checkpoint(tmp_path / "ckpt")
    argv = ["import", "--hf-dir", tmp_path / "hf", "--output", tmp_path / "ckpt", "--overwrite"]
    assert main([str(a) for a in argv]) == 0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "hf_files",  # the HF folder's generation_config.json, kept for the export
        "latest_checkpointed_iteration.txt",
        "model.yaml",
        "release",
    ]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert "hidden_size: 32" in (tmp_path / "ckpt" / "model.yaml").read_text()
    _old_hf_export(tmp_path / "hf-out")
    argv = ["export", "--load", tmp_path / "ckpt", "--output", tmp_path / "hf-out", "--overwrite"]
    assert main([str(a) for a in argv]) == 0
    assert sorted(p.name for p in (tmp_path / "hf-out").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    before = load_file(tmp_path / "hf" / "model.safetensors")
    after = load_file(tmp_path / "hf-out" / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # a failing run with --overwrite: the previous output stays, no temporary folder is left
    broken = Inputs(tmp_path / "hf", tmp_path / "in")
    bad = broken.config("heads-0", num_attention_heads=0)
    argv = ["import", "--hf-dir", bad, "--output", tmp_path / "ckpt", "--overwrite"]
    assert main([str(a) for a in argv]) == 2
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_sharded_and_linked_inside_folders_are_read(tmp_path):
    """A sharded model (an index and two shards) and a weight file that is a symbolic link to a
    file inside the folder import to the same checkpoint as the single file."""
    from safetensors.torch import load_file as read

    import_hf = load_entry(CONVERT.replace(":main", ":import_hf"))
    tiny_llama(tmp_path / "hf")
    inputs = Inputs(tmp_path / "hf", tmp_path / "in")
    sharded = inputs.sharded("sharded")
    linked = inputs.copy("linked")
    (linked / "model.safetensors").rename(linked / "weights.bin")
    (linked / "model.safetensors").symlink_to("weights.bin")
    outputs = []
    for name, hf in (("single", tmp_path / "hf"), ("sharded", sharded), ("linked", linked)):
        _, final, _ = import_hf(hf, tmp_path / f"ckpt-{name}", 16)
        outputs.append(read(Path(final) / "rank_00000.safetensors"))
    for other in outputs[1:]:
        assert outputs[0].keys() == other.keys()
        assert all(torch.equal(outputs[0][k], other[k]) for k in other)
