"""Which of megatron-core's fused kernels run on this rank, and why the others do not.

A fusion runs when the run allows it (megatron_hexi.config.FusionConfig, Megatron-LM's
`--no-*-fusion` flags), the device is CUDA, and megatron-core 0.16.1's own requirements for it are
met on this stage:

- bias-activation (`bias_swiglu_impl` / `bias_gelu_impl`, megatron-core's `jit_fuser`): SwiGLU,
  or GELU with linear biases (TransformerConfig refuses GELU fusion without a bias);
- bias-dropout-add (`jit_fuser`): nothing more;
- RoPE: Transformer Engine's fused kernel (`rope_utils.fused_apply_rotary_pos_emb`, TE >= 1.4);
- masked softmax (`FusedScaleMaskSoftmax`, megatron-core's unfused attention): the compiled
  `scaled_upper_triang_masked_softmax_cuda` and `scaled_masked_softmax_cuda` kernels;
  megatron-core itself falls back to torch's softmax for shapes they do not support;
- gradient accumulation into `main_grad` inside the weight-gradient GEMM: a `main_grad` (bf16
  parameters: grad_sync.FP32MainGrads), and apex's `fused_weight_gradient_mlp_cuda` for
  megatron-core's own linear layers (every layer of the local spec, the output layer of the TE
  spec); TE's layers fuse it themselves;
- cross-entropy (megatron-core's `fused_cross_entropy` arithmetic, at this stage's uneven
  vocabulary offset: megatron_hexi.loss): bf16 runs, since its gradient is returned in bf16
  (under fp16 that would round the scaled logits' gradient to bf16's 8-bit mantissa).

On CPU every fusion is off: the CPU path runs the reference layers, and the equivalence tests
compare them exactly. The rule is a pure function of `FusionEnvironment`, so it is tested on CPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.transformer_impl import te_installed

if TYPE_CHECKING:
    from megatron_hexi.config import FusionConfig
    from planner.models import ModelSpec

FUSIONS = (
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "masked_softmax_fusion",
    "gradient_accumulation_fusion",
    "cross_entropy_loss_fusion",
)


@dataclass(frozen=True)
class FusionEnvironment:
    """What the fusions' requirements ask of this process and this stage."""

    cuda: bool
    te: bool  # Transformer Engine importable (fused RoPE, the TE spec's own wgrad fusion)
    apex_wgrad: bool  # apex's fused_weight_gradient_mlp_cuda
    softmax_kernels: bool  # the masked-softmax kernels megatron-core imports
    swiglu: bool
    add_bias_linear: bool
    main_grad: bool  # parameters accumulate their gradients in an fp32 `main_grad` (bf16)
    transformer_impl: str  # local or transformer_engine
    holds_output: bool  # the stage has megatron-core's own output layer
    fp16: bool = False  # fp16 parameters (a `main_grad` too, but not the bf16 fused loss)

    @classmethod
    def probe(
        cls,
        *,
        cuda: bool,
        swiglu: bool,
        add_bias_linear: bool,
        main_grad: bool,
        transformer_impl: str,
        holds_output: bool,
        fp16: bool = False,
    ) -> FusionEnvironment:
        """This process's kernels (found on the path, not imported) and the given stage."""

        def found(name: str) -> bool:
            return importlib.util.find_spec(name) is not None

        return cls(
            cuda=cuda,
            te=te_installed(),
            apex_wgrad=found("fused_weight_gradient_mlp_cuda"),
            softmax_kernels=found("scaled_upper_triang_masked_softmax_cuda")
            and found("scaled_masked_softmax_cuda"),
            swiglu=swiglu,
            add_bias_linear=add_bias_linear,
            main_grad=main_grad,
            transformer_impl=transformer_impl,
            holds_output=holds_output,
            fp16=fp16,
        )


@dataclass(frozen=True)
class Fusions:
    """The fusions that run (each a TransformerConfig field of the same name) and, for every
    one that does not, why not."""

    bias_activation_fusion: bool = False
    bias_dropout_fusion: bool = False
    apply_rope_fusion: bool = False
    masked_softmax_fusion: bool = False
    gradient_accumulation_fusion: bool = False
    cross_entropy_loss_fusion: bool = False
    why_not: tuple[tuple[str, str], ...] = ()

    def config_fields(self) -> dict[str, bool]:
        """The TransformerConfig fields (megatron-core's names)."""
        return {name: getattr(self, name) for name in FUSIONS}

    def line(self) -> str:
        """One start-up line: which run, and why the others do not."""
        on = [name for name in FUSIONS if getattr(self, name)]
        text = "fusions on: " + (", ".join(on) if on else "none")
        if self.why_not and all(why == "CPU" for _, why in self.why_not):
            text += " (CPU runs the reference layers)"
        elif self.why_not:
            text += "; off: " + ", ".join(f"{n} ({why})" for n, why in self.why_not)
        return text


def choose_fusions(allowed: FusionConfig, env: FusionEnvironment) -> Fusions:
    """The fusions that run under `allowed` in `env` (the module docstring has the rule)."""
    te_spec = env.transformer_impl == "transformer_engine"
    needs: dict[str, str | None] = {
        "bias_activation_fusion": None
        if env.swiglu or env.add_bias_linear
        else "GELU without linear biases",
        "bias_dropout_fusion": None,
        "apply_rope_fusion": None if env.te else "needs Transformer Engine",
        "masked_softmax_fusion": None
        if env.softmax_kernels
        else "needs the scaled_masked_softmax_cuda kernels",
        "gradient_accumulation_fusion": (
            "fp32 parameters have no main_grad"
            if not env.main_grad
            else None
            if env.apex_wgrad or (te_spec and env.te and not env.holds_output)
            else "needs apex's fused_weight_gradient_mlp_cuda"
        ),
        "cross_entropy_loss_fusion": None if env.main_grad and not env.fp16 else "bf16 runs only",
    }
    on: dict[str, Any] = {}  # Fusions fields by name (all bool)
    why_not: list[tuple[str, str]] = []
    for name in FUSIONS:
        reason = (
            "switched off" if not getattr(allowed, name) else "CPU" if not env.cuda else needs[name]
        )
        on[name] = reason is None
        if reason is not None:
            why_not.append((name, reason))
    return dataclasses.replace(Fusions(**on), why_not=tuple(why_not))


def stage_fusions(
    allowed: FusionConfig,
    cuda: bool,
    model: ModelSpec,
    *,
    bf16: bool,
    transformer_impl: str,
    holds_output: bool,
    fp16: bool = False,
) -> Fusions:
    """The fusions of one stage of `model` in this process: what training and the profiler
    build alike (bf16 and fp16 parameters have an fp32 `main_grad`, grad_sync.FP32MainGrads)."""
    return choose_fusions(
        allowed,
        FusionEnvironment.probe(
            cuda=cuda,
            swiglu=model.swiglu,
            add_bias_linear=model.add_bias_linear,
            main_grad=bf16 or fp16,
            transformer_impl=transformer_impl,
            holds_output=holds_output,
            fp16=fp16,
        ),
    )
