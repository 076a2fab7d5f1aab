"""The run configuration: what a run does beyond what its plan fixes, as typed, frozen values.

The plan (planner.plan.Plan) holds the model, the batch and the parallel layout; a `RunConfig`
holds the rest: optimizer and learning-rate schedule, precision, dropout, data, checkpoints,
logging, the process group and the fused kernels allowed. Code builds one directly (the
profiler, the benchmarks, tests):

    config = RunConfig(training=TrainingConfig(train_iters=10),
                       optimizer=OptimizerConfig(lr=1e-3), data=DataConfig(mock_data=True))
    trainer = Trainer(plan, config, device)

pretrain_gpt.py builds one from Megatron-LM's flags (megatron_hexi.arguments.run_config); field
names are the flags' names (`--lr-decay-style` is `lr_schedule.lr_decay_style`) and every default
is the flag's default. Values are not checked here: the flag parser checks ranges and flags that
contradict the plan, before a config exists.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TrainingConfig:
    """How long to train, from which seed, and when to stop early."""

    train_iters: int
    """Iterations of the run (a resumed run continues up to it); sizes the dataset and the
    default lr decay."""
    seed: int = 1234
    """Seeds the weights, dropout and the data order."""
    exit_interval: int | None = None
    """Stop (saving first, with a save directory) when the iteration is a multiple of it."""
    exit_duration_in_mins: float | None = None
    """Stop (saving first) after the iteration during which this many minutes since start-up
    have passed on any rank."""
    exit_signal_handler: bool = False
    """On SIGTERM, finish the current step, save (with a save directory) and exit 0."""
    check_for_nan_in_loss_and_grad: bool = True
    """Stop with an error on a NaN or infinite loss or gradient norm, as Megatron-LM does."""
    manual_gc: bool = False
    """Disable Python's automatic garbage collection; collect at agreed points instead."""
    manual_gc_interval: int = 0
    """With `manual_gc`: collect every this many iterations (0: not during training)."""
    recompute_method: str | None = None
    """megatron-core's recompute method under a plan that recomputes; None: uniform."""
    recompute_num_layers: int | None = None
    """Its layer count; None: 1."""


@dataclass(frozen=True)
class EvaluationConfig:
    """Validation loss (Megatron-LM's evaluation), on the validation split or its own data.

    Unlike Megatron-LM, which evaluates 100 iterations at the end of every run by default, a run
    evaluates only when asked (`eval_interval` or `eval_iters` given, or `skip_train`): tiny CPU
    runs would otherwise spend most of their time evaluating."""

    eval_interval: int | None = None
    """Evaluate every this many iterations (and at the end of training); None: at the end only,
    when evaluation is on."""
    eval_iters: int | None = None
    """Global batches per evaluation; None: 100 when evaluation is on; 0: no evaluation."""
    skip_train: bool = False
    """Evaluate the loaded (or initial) weights without training."""

    @property
    def batches(self) -> int:
        """Global batches each evaluation reads; 0 when evaluation is off."""
        if self.eval_iters is not None:
            return self.eval_iters
        return 100 if (self.eval_interval or self.skip_train) else 0


@dataclass(frozen=True)
class OptimizerConfig:
    """Adam with decoupled weight decay, or SGD with momentum, and gradient clipping
    (megatron-core's optimizers)."""

    lr: float
    """Peak learning rate (after warm-up)."""
    min_lr: float = 0.0
    """Floor of the decayed learning rate."""
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Clip to this global gradient norm; 0 turns clipping off."""
    optimizer: str = "adam"
    """"adam" (AdamW) or "sgd" (torch.optim.SGD: momentum, L2 weight decay)."""
    sgd_momentum: float = 0.9


@dataclass(frozen=True)
class LRScheduleConfig:
    """megatron-core's OptimizerParamScheduler: warm-up, then decay to `OptimizerConfig.min_lr`."""

    lr_decay_style: str = "linear"
    """constant, linear, cosine or inverse-square-root."""
    lr_decay_iters: int | None = None
    """Iterations of decay; None: `TrainingConfig.train_iters`."""
    lr_warmup_iters: int = 0
    lr_warmup_fraction: float | None = None
    """Warm-up as this fraction of the decay iterations (instead of `lr_warmup_iters`)."""
    lr_warmup_init: float = 0.0
    """Learning rate at the start of warm-up."""


@dataclass(frozen=True)
class PrecisionConfig:
    """Parameter precision; gradients and master weights stay fp32 either way. fp16 needs loss
    scaling (megatron-core's grad scalers): the loss is multiplied by the scale before the
    backward pass, gradients are divided by it before clipping, and a step whose gradients hold
    an inf or NaN on any rank is skipped on every rank."""

    bf16: bool = False
    """bf16 parameters and activations, fp32 gradient accumulation and master weights."""
    fp16: bool = False
    """fp16 parameters and activations, fp32 gradient accumulation and master weights, and
    dynamic loss scaling unless `loss_scale` is set."""
    loss_scale: float | None = None
    """A constant loss scale (fp16 or bf16); None: dynamic under fp16, none under bf16; fp32
    runs take none."""
    initial_loss_scale: float = 2.0**32
    """Dynamic scaling: the first scale."""
    min_loss_scale: float = 1.0
    """Dynamic scaling: the scale is never halved below it."""
    loss_scale_window: float = 1000
    """Dynamic scaling: the scale doubles after this many steps in a row without inf/NaN."""
    hysteresis: int = 2
    """Dynamic scaling: the scale halves after this many steps with inf/NaN since it last grew."""

    @property
    def half(self) -> bool:
        """16-bit parameters (bf16 or fp16): fp32 `main_grad` and fp32 master weights."""
        return self.bf16 or self.fp16

    @property
    def scaled(self) -> bool:
        """The loss is scaled and steps with inf/NaN gradients are skipped (megatron-core's
        rule: fp16 always, bf16 with a constant `loss_scale`)."""
        return self.fp16 or (self.bf16 and self.loss_scale is not None)


@dataclass(frozen=True)
class DropoutConfig:
    """Dropout probabilities (the plan fixes the rest of the model)."""

    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1


@dataclass(frozen=True)
class DataConfig:
    """Where the training samples come from: megatron-core's mock corpus or indexed datasets."""

    mock_data: bool = False
    """megatron-core's mock dataset; needs no files."""
    data_path: tuple[str, ...] | None = None
    """Prefixes of .bin/.idx pairs, optionally weighted: ("W1", "PREFIX1", "W2", "PREFIX2")."""
    split: str = "969,30,1"
    """Train, validation and test weights; the test split is not read."""
    data_cache_path: str | None = None
    """Where megatron-core caches its sample indices."""
    mmap_bin_files: bool = True
    """Memory-map the .bin files (False: --no-mmap-bin-files, read them with file reads)."""
    tokenizer_type: str | None = None
    """Megatron-LM's tokenizer name (megatron_hexi.tokenizer.TOKENIZER_TYPES; with `data_path`)."""
    tokenizer_model: str | None = None
    """HuggingFaceTokenizer: tokenizer.json or a model directory; SentencePieceTokenizer and
    Llama2Tokenizer: tokenizer.model; TikTokenizer: its JSON vocabulary."""
    vocab_file: str | None = None
    """GPT2BPETokenizer: vocab.json."""
    merge_file: str | None = None
    """GPT2BPETokenizer: merges.txt."""
    vocab_size: int | None = None
    """NullTokenizer: ids below it, eod it; TikTokenizer: its vocabulary (--vocab-size)."""
    tiktoken_pattern: str | None = None
    tiktoken_num_special_tokens: int | None = None
    tokenizer_special_tokens: tuple[str, ...] | None = None
    """TikTokenizer's special tokens (--tokenizer-special-tokens or --tiktoken-special-tokens)."""
    legacy_tokenizer: bool = False
    """Megatron-LM's older Llama2Tokenizer and TikTokenizer classes (--legacy-tokenizer)."""
    valid_data_path: tuple[str, ...] | None = None
    """Validation prefixes, as `data_path`; None: the validation split of `split`."""
    make_vocab_size_divisible_by: int | None = None
    """Check that the tokenizer's vocabulary, padded as Megatron-LM pads it, is the plan's."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and resuming (megatron_hexi.checkpoint)."""

    save: str | None = None
    """Directory to save to: every `save_interval` iterations and at the end."""
    save_interval: int | None = None
    load: str | None = None
    """Directory to resume from."""
    exit_on_missing_checkpoint: bool = False
    """With `load`: a directory with no checkpoint at all is an error (else: a fresh start)."""
    ckpt_step: int | None = None
    """Load this iteration instead of the one the pointer file names."""
    finetune: bool = False
    """Load the weights only: iteration 0, fresh Adam state and RNGs."""
    no_load_optim: bool = False
    no_load_rng: bool = False
    override_opt_param_scheduler: bool = False
    """Use this run's lr schedule, not the checkpoint's."""
    use_checkpoint_opt_param_scheduler: bool = False
    """Use the checkpoint's lr schedule."""


@dataclass(frozen=True)
class LoggingConfig:
    """What a run reports: log lines, JSONL metrics (rank 0), TensorBoard scalars (rank 0) and
    wandb (the last rank, as in Megatron-LM)."""

    log_interval: int = 1
    """Print one line every this many iterations, averaged over them."""
    log_throughput: bool = False
    """Add the model TFLOP/s per GPU to the iteration line."""
    metrics_path: str | None = None
    """JSONL file, one line of metrics per iteration."""
    tensorboard_dir: str | None = None
    tensorboard_log_interval: int = 1
    log_params_norm: bool = False
    """Add the parameters' L2 norm to the iteration line and the scalars (params-norm)."""
    log_world_size_to_tensorboard: bool = False
    """Write the world size with each iteration's scalars."""
    wandb_project: str | None = None
    """Log the TensorBoard scalars to this wandb project too."""
    wandb_exp_name: str | None = None
    """The wandb run's name."""
    wandb_save_dir: str | None = None
    """Where wandb writes its files; None: `<save>/wandb` or ./wandb."""


@dataclass(frozen=True)
class RuntimeConfig:
    """Device and process group."""

    device: str | None = None
    """cpu or cuda; None: cuda when torch sees one, else cpu (GPUs emulated by processes)."""
    distributed_backend: str | None = None
    """gloo or nccl; None: nccl on cuda, gloo on cpu."""
    distributed_timeout_minutes: float = 10.0
    """Collective timeout: a dead or hung peer fails every rank within it."""
    ddp_bucket_size: int | None = None
    """Most gradient elements per bucket; None: 40,000,000 with overlapped gradient sync (the
    plan's `training.overlap_grad_reduce`), else one bucket per rank set."""


@dataclass(frozen=True)
class FusionConfig:
    """megatron-core's fused kernels; Megatron-LM's `--no-*-fusion` flags switch each off.

    They run on CUDA only, each where its requirements are met; on CPU every one is off, so the
    CPU path keeps the reference layers and the equivalence tests stay exact."""

    bias_activation_fusion: bool = True
    bias_dropout_fusion: bool = True
    apply_rope_fusion: bool = True
    masked_softmax_fusion: bool = True
    gradient_accumulation_fusion: bool = True
    cross_entropy_loss_fusion: bool = False


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs besides its plan, one frozen value per concern."""

    training: TrainingConfig
    optimizer: OptimizerConfig
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    dropout: DropoutConfig = field(default_factory=DropoutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    fusions: FusionConfig = field(default_factory=FusionConfig)
