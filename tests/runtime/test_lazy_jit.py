"""megatron-core's fused functions compile at their first call (megatron_hexi.lazy_jit): the
runtime's import leaves torch's compiler out, and a lazily compiled function is the function
torch.compile would have compiled."""

import subprocess
import sys

from conftest import REPO


def test_runtime_imports_without_the_compiler():
    code = (
        "import sys, megatron_hexi.training, megatron.core.jit as jit\n"
        "print(jit.jit_fuser.__module__, 'torch._dynamo' in sys.modules)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["megatron_hexi.lazy_jit", "False"]


def test_lazy_compile_calls_torch_compile_once_at_the_first_call(monkeypatch):
    import torch

    from megatron_hexi.lazy_jit import lazy_compile

    calls = []

    def fake_compile(fn, **kwargs):
        calls.append(kwargs)
        return lambda *a: ("compiled", fn(*a))

    monkeypatch.setattr(torch, "compile", fake_compile)
    double = lazy_compile(lambda x: 2 * x)
    assert calls == []
    assert double(3) == ("compiled", 6) and double(4) == ("compiled", 8)
    assert calls == [{}]
    plus = lazy_compile(mode="max-autotune")(lambda x: x + 1)
    assert plus(1) == ("compiled", 2) and calls[-1] == {"mode": "max-autotune"}
