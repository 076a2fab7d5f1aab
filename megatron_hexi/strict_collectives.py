"""A check that every tensor entering a collective lives on the run's device (NCCL's rule).

NCCL takes only CUDA tensors, even with one rank; gloo takes CPU tensors and, for many calls, CUDA
ones too. So a CPU tensor handed to a collective passes every CPU test and crashes at the first
step on GPUs. With `HEXI_STRICT_COLLECTIVES=1` in the environment, `init_distributed` wraps the
public tensor collectives of `torch.distributed` (what this runtime and megatron-core call) so that
each call checks its tensors' device against the run's device and counts the call. The GPU check
runs with it; the tests use it to see that the check sees every kind of collective a step makes.
Object collectives (`all_gather_object`, ...) place their own tensors and are not wrapped.
"""

import collections
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

WRAPPED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "isend",
    "irecv",
    "send",
    "recv",
)


class CollectiveDeviceError(RuntimeError):
    """A collective was handed a tensor that is not on the run's device."""


calls: collections.Counter[str] = collections.Counter()  # collective name -> calls checked
_installed: dict[str, Callable[..., Any]] = {}  # name -> the original function


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _checked(name: str, fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for t in _tensors([*args, *kwargs.values()]):
            if t.device != device:
                raise CollectiveDeviceError(
                    f"torch.distributed.{name}: a {tuple(t.shape)} {t.dtype} tensor on "
                    f"{t.device}, but this run's device is {device} (NCCL takes only tensors "
                    f"on the run's device)"
                )
        calls[name] += 1
        return fn(*args, **kwargs)

    return wrapper


def install(device: str | torch.device) -> None:
    """Wrap the collectives for `device` (a torch.device). Idempotent; `uninstall` undoes it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for name in WRAPPED:
        original = _installed.get(name, getattr(dist, name))
        _installed[name] = original
        setattr(dist, name, _checked(name, original, device))


def uninstall() -> None:
    for name, original in _installed.items():
        setattr(dist, name, original)
    _installed.clear()
