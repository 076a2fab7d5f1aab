"""The conversion and data corpora's runner can fail: a traceback, a memory blow-up, a busy loop,
an exit 0 where a refusal belongs and a changed file each land in their own category."""

import itertools
import sys

from foundation import entry_corpus_runner as runner
from foundation.entry_corpus import CONVERT, Case, category


def _crash(argv):
    return 1 // 0


def _blowup(argv):
    return len(bytearray(2 * runner.EXTRA_ADDRESS_SPACE))


def _busy(argv):
    for _ in itertools.count():
        pass


def _accept(argv):
    return 0


def _refuse(argv):
    print("convert_hf_llama.py: error: --output x: folder is not empty", file=sys.stderr)
    return 2


def test_each_failure_has_its_category(tmp_path, monkeypatch):
    limit = runner.Limits(
        runner.mapped_bytes() + runner.EXTRA_ADDRESS_SPACE, 1, 6, runner.WALL_SECONDS
    )
    kept = tmp_path / "kept"
    kept.write_text("x")
    case = Case("c", CONVERT, [], "--output")
    got = {}
    for function in (_crash, _blowup, _busy, _accept, _refuse):
        result = runner.run_case(function, [], limit)
        result["changed"] = []
        got[function.__name__] = category(case, result)
    assert got == {
        "_crash": "traceback",
        "_blowup": "out of memory",
        "_busy": "hang",
        "_accept": "silently wrong",
        "_refuse": "one line",
    }
    result = runner.run_case(_refuse, [], limit)
    assert category(Case("c", CONVERT, [], "--model-yaml"), {**result, "changed": []}) == "other"
    assert category(case, {**result, "changed": [str(kept)]}) == "data lost"
