"""The fused AdamW the optimizers run on CUDA (megatron_hexi.adam) against torch's default AdamW,
on CPU (torch has a fused CPU kernel too): the same parameters after steps with weight decay on
one group and none on the other, to 1e-6."""

import torch

from megatron_hexi.adam import adamw, step_state


def _train(fused: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((7, 5), (5,))]
    groups = [
        {"params": [params[0]], "weight_decay": 0.1},
        {"params": [params[1]], "weight_decay": 0.0},
    ]
    opt = adamw(
        groups,
        lr=1e-2,
        weight_decay=0.1,
        betas=(0.9, 0.95),
        eps=1e-8,
        device=torch.device("cpu"),
        fused=fused,
    )
    assert bool(opt.defaults["fused"]) is fused
    for _ in range(5):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params]


def test_fused_adamw_matches_the_default_one():
    fused, default = _train(True), _train(False)
    for a, b in zip(fused, default):
        assert not torch.equal(a, torch.zeros_like(a))
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_default_choice_and_restored_step():
    p = torch.nn.Parameter(torch.ones(3))
    cpu = adamw(
        [{"params": [p]}],
        lr=1e-3,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        eps=1e-8,
        device=torch.device("cpu"),
    )
    assert not cpu.defaults["fused"]  # CPU: torch's default AdamW, as the equivalence tests ran
    step = step_state(7, p, cpu)
    assert step.device.type == "cpu" and step.dtype == torch.float32 and float(step) == 7.0
