"""The fused AdamW the optimizers run (megatron_hexi.adam) against torch's default AdamW, on CPU
(torch's fused CPU kernel; CUDA's is checked by the GPU check): the same parameters after steps
with weight decay on one group and none on the other, to 1e-6."""

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


def test_restored_step_lives_where_the_kernel_keeps_it():
    p = torch.nn.Parameter(torch.ones(3))
    opt = adamw([{"params": [p]}], lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    assert opt.defaults["fused"]
    p.grad = torch.ones(3)
    opt.step()
    fresh = opt.state[p]["step"]
    step = step_state(7, p, opt)
    assert (step.device, step.dtype, step.shape) == (fresh.device, fresh.dtype, fresh.shape)
    assert float(step) == 7.0
