"""The training entry: the Trainer (what one rank builds from the plan, and one step) and the
loop that runs it, resumes, evaluates and saves. Start-up and failure lines are
megatron_hexi.distributed's, the log lines and the summary megatron_hexi.metrics'.

Only `main` sees the command line: it turns the checked flags into a RunConfig
(megatron_hexi.config), and everything below it (`Trainer`, `run`, checkpoints) reads that, so
code can train from a Plan and a RunConfig without flags.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_hexi import interrupt, tensorboard_log, wandb_log
from megatron_hexi.arguments import (
    CommandLine,
    check_against_plan,
    check_command_line,
    planning_inputs,
)
from megatron_hexi.communicator import Boundary, StageCommunicator
from megatron_hexi.cuda_graphs import check_cuda_graphs
from megatron_hexi.distributed import (
    device_name,
    fail,
    init_distributed,
    startup_line,
    wants_cuda,
)
from megatron_hexi.exit_signal import ExitSignal
from megatron_hexi.fusions import stage_fusions
from megatron_hexi.grad_sync import FP32MainGrads, GradientSync, global_norm
from megatron_hexi.layer_specs import check_transformer_impl
from megatron_hexi.loop_checkpoints import load_at_start, save_at
from megatron_hexi.loss import sharded_cross_entropy
from megatron_hexi.memory_fit import check_memory_fit
from megatron_hexi.metrics import (
    Evaluation,
    IntervalLog,
    check_finite,
    open_outputs,
    peak_memory_gb,
    summary,
    validation_lines,
)
from megatron_hexi.model import (
    build_stage_model,
    initialise_weights,
    local_parameters,
    seed_rng,
    stage_config,
)
from megatron_hexi.optimizer import build_optimizer, params_dtype
from megatron_hexi.outer_step import OuterStep
from megatron_hexi.process_groups import SingleRank, StagePosition, build_groups
from megatron_hexi.rank_mapping import map_processes
from megatron_hexi.report import error_lines, prints
from megatron_hexi.run_datasets import eval_window, run_datasets
from megatron_hexi.run_limits import ExitDuration, ManualGC, stop_line
from megatron_hexi.run_paths import check_run_paths
from megatron_hexi.startup_plan import plan_at_start, resume_iteration
from megatron_hexi.step_accounting import StepClock, batches_to_device, loss_mask_tokens
from megatron_hexi.tensorboard_log import iteration_scalars, validation_scalars
from planner.catalog import get_gpu
from planner.errors import SpecError
from planner.flops import model_flops_per_sample
from planner.layout import island_segments, rank_params, reduced_together, total_params

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_hexi.config import RunConfig
    from planner.plan import Plan

    # What the loss function of a micro-batch returns to megatron-core's schedule: the loss sum,
    # the number of tokens it covers, and the values to report ({"lm loss": [sum, tokens]}).
    LossOutput = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


class Trainer:
    """Everything one rank builds from the plan and a RunConfig, and one training step.

    `config` is the RunConfig; `transformer_config` megatron-core's TransformerConfig of this
    rank's stage."""

    def __init__(self, plan: Plan, config: RunConfig, device: torch.device) -> None:
        self.plan, self.config, self.device = plan, config, device
        timeout = datetime.timedelta(minutes=config.runtime.distributed_timeout_minutes)
        mapping = map_processes(plan, device_name(device), check_devices=device.type == "cuda")
        segments = island_segments(plan)  # one island: gradient_segments(plan)
        shard = plan.training.use_distributed_optimizer
        rank_sets = list(dict.fromkeys(s.ranks for s in segments if reduced_together(s, shard)))
        self.groups = build_groups(plan, mapping, rank_sets, timeout)
        self.rank = self.groups.plan_rank
        startup_line(f"process groups built ({len(rank_sets)} gradient rank set(s))")
        self.view = view = plan.rank_view(self.rank)
        seed_rng(config.training.seed, view.tp_rank, plan.training.cuda_graph_impl)
        precision = config.precision
        dtype = params_dtype(precision)
        backend, impl = plan.training.attention_backend, plan.training.transformer_impl
        self.fusions = stage_fusions(
            config.fusions,
            device.type == "cuda",
            plan.model,
            bf16=precision.bf16,
            fp16=precision.fp16,
            transformer_impl=impl,
            holds_output=view.holds_output,
        )
        startup_line(self.fusions.line())
        tc = self.transformer_config = stage_config(
            plan,
            view,
            params_dtype=dtype,
            hidden_dropout=config.dropout.hidden_dropout,
            attention_dropout=config.dropout.attention_dropout,
            recompute=plan.training.recompute,
            recompute_method=config.training.recompute_method or "uniform",
            recompute_num_layers=config.training.recompute_num_layers or 1,
            transformer_impl=impl,
            attention_backend=backend,
            fusions=self.fusions,
        )
        self.model = build_stage_model(
            plan, view, self.groups.tp, tc, device, attention_backend=backend, transformer_impl=impl
        )
        self.params = local_parameters(plan, self.rank, self.model)
        initialise_weights(plan, self.params, config.training.seed)
        per_rank = [rank_params(plan, r) for r in range(plan.world_size)]
        startup_line(
            f"model built: parameters per rank {per_rank}, {total_params(plan.model):,} in the "
            f"model"
        )
        # bf16/fp16: gradients accumulate, sync and reach the fp32 masters in fp32 `main_grad`
        self.main_grads = FP32MainGrads(self.model.parameters()) if precision.half else None
        self.grad_sync = GradientSync(
            self.rank,
            self.params,
            segments,
            self.groups,
            shard_optimizer_state=shard,
            overlap=plan.training.overlap_grad_reduce,
            bucket_size=config.runtime.ddp_bucket_size,
        )
        self.optimizer, self.scheduler = build_optimizer(self.model, self.grad_sync, config, plan)
        self.outer = OuterStep(plan, self.groups, self.params, self.optimizer, timeout)
        tc.finalize_model_grads_func = self._finalize_grads
        if plan.training.overlap_grad_reduce:
            tc.no_sync_func = self.grad_sync.no_sync
        # loss scaling (fp16): the schedule multiplies each micro-batch's loss by the scale
        # before its backward; the optimizer divides the gradients by it before clipping
        tc.grad_scale_func = self.optimizer.scale_loss if precision.scaled else None
        pipe = plan.pipelines[view.pipeline]
        numel = plan.model.seq_length * view.micro_batch_size * plan.model.hidden_size
        launch_of = self.groups.launch_of
        prev_b = (
            Boundary(view.prev_stage_ranks, view.stage_ranks, numel, launch_of, self.rank)
            if view.prev_stage_ranks
            else None
        )
        next_b = (
            Boundary(view.stage_ranks, view.next_stage_ranks, numel, launch_of, self.rank)
            if view.next_stage_ranks
            else None
        )
        self.position = StagePosition(view.stage, len(pipe.stages))
        self.communicator = StageCommunicator(
            tc,
            self.position,
            self.groups.tp,
            view.tp_size,
            prev_b,
            next_b,
            dtype,
            device,
            sequence_parallel=view.sequence_parallel,
        )
        self.dataset, self.valid_dataset = run_datasets(plan, config)
        self.global_tokens: float | None = None
        self.evaluations: list[dict[str, Any]] = []  # validation losses of this run (`run`)
        self.checkpoint_events: list[dict[str, Any]] = []  # loads and saves of this run (`run`)

    def zero_grad(self) -> None:
        """Drop last step's gradients: `.grad` (and the masters'), and the fp32 `main_grad`."""
        self.optimizer.zero_grad()
        if self.main_grads is not None:
            self.main_grads.zero()

    # -- pieces handed to megatron-core's schedule ------------------------------------------
    def _finalize_grads(
        self,
        model_chunks: list[torch.nn.Module],
        num_tokens: torch.Tensor,
        pg_collection: ProcessGroupCollection | None = None,
        force_all_reduce: bool | None = False,
    ) -> None:
        """The global token count (its all-reduce started with the step), then the weighted
        segment sync. The pipeline's own time ends here: what follows is the data-parallel part
        of the step. The count stays on the device (megatron_hexi.step_accounting)."""
        self._clock.mark("pipeline_end")
        self._token_count.wait()
        # the distributed optimizer is the sync's collective (reduce-scatter into its masters)
        self.grad_sync.sync(self._tokens)
        self.outer.land()  # an outer exchange started after the last step (fragments)
        self._clock.mark("sync_end")

    def _start_token_count(self, batches: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Start the all-reduce of the global batch's loss-masked tokens before the forward
        pass: the output stages know their loss masks when they read their micro-batches, so
        the count travels while the pipeline computes, and gradient finalize only waits for it
        (the sum is exact: the same integers in float64 on every rank)."""
        v, islands = self.view, len(self.plan.island_pipelines())
        mine = batches if v.holds_output and v.tp_rank == 0 else []
        self._counts = loss_mask_tokens(mine, self.device, v.island, islands)  # per island
        self._token_count = dist.all_reduce(self._counts, async_op=True)
        self._tokens = self._counts[v.island : v.island + 1]  # the island's: the sync divides

    def _loss(
        self, labels: torch.Tensor, loss_mask: torch.Tensor, logits: torch.Tensor
    ) -> LossOutput:
        v = self.view
        assert v.vocab is not None  # the loss is the output stage's, which holds vocabulary rows
        per_token = sharded_cross_entropy(
            logits.float(),
            labels,
            v.vocab[1],
            self.groups.tp,
            v.tp_size,
            fused=self.fusions.cross_entropy_loss_fusion,
        )
        mask = loss_mask.float()
        loss_sum = (per_token * mask).sum()
        num_tokens = mask.sum().to(torch.int)
        return (
            loss_sum,
            num_tokens,
            {"lm loss": torch.stack([loss_sum.detach().double(), mask.sum().double()])},
        )

    def _forward_step(
        self, data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], LossOutput] | None]:
        v = self.view  # training batches are on the device already (train_step)
        batch = next(data_iterator) if (v.holds_embedding or v.holds_output) else {}
        tokens = batch["tokens"].to(self.device) if v.holds_embedding else None
        positions = batch["position_ids"].to(self.device) if v.holds_embedding else None
        output = model(tokens, positions, None)
        if v.holds_output:
            return output, partial(
                self._loss, batch["labels"].to(self.device), batch["loss_mask"].to(self.device)
            )
        return output, None

    # -- one iteration ----------------------------------------------------------------------
    def params_norm(self) -> float:
        """--log-params-norm: the L2 norm of the model's parameters, each element counted once
        over all ranks (the slices whose gradients this rank counts in the gradient norm)."""
        owned = [s.param.detach().narrow(s.dim, s.start, s.length) for s in self.grad_sync.owned]
        return float(global_norm(owned, self.device, self.grad_sync.norm_group).item())

    def train_step(self, iteration: int) -> dict[str, Any]:
        """Forward/backward of this pipeline's micro-batches, gradient sync, optimizer step."""

        from megatron_hexi.data import pipeline_microbatches

        v = self.view
        self.model.train()
        self.zero_grad()
        batches = (
            list(pipeline_microbatches(self.dataset, self.plan, v, iteration))
            if (v.holds_embedding or v.holds_output)
            else []
        )
        # Nothing inside the step reads a value back from the device
        # (megatron_hexi.step_accounting): its one wait and its one read come at its end.
        batches = batches_to_device(batches, self.device)
        self._clock = clock = StepClock(self.device)
        clock.mark("start")
        self._start_token_count(batches)
        store = self._schedule(iter(batches), forward_only=False)
        # under loss scaling a step with inf/NaN gradients on any rank is skipped on every rank
        # (success False, no norm); as in Megatron-LM, the iteration counts but the learning-
        # rate schedule does not move
        success, grad_norm, _ = self.optimizer.step()
        if success and not self.optimizer.config.clip_grad > 0.0:
            # megatron-core computes the norm only to clip (its bf16 optimizer returns 0.0)
            grad_norm = self.optimizer.get_grad_norm()
        if success:
            self.scheduler.step(increment=1)
        self.outer.after_update(iteration + 1)  # every H steps (planner.islands)
        clock.mark("end")
        clock.wait("end")  # queued optimizer work belongs to this step
        # One small all-reduce: loss sum (last stages, TP rank 0), each rank's times and memory;
        # the token count and the grad norm are all-reduced already (the same on every rank).
        world = self.plan.world_size
        stats = torch.zeros(1 + 4 * world, dtype=torch.float64, device=self.device)
        if v.holds_output and v.tp_rank == 0 and store:
            stats[0] = torch.stack([s["lm loss"][0] for s in store]).sum()
        per_rank = stats[1:].view(4, world)
        per_rank[0, self.rank] = clock.seconds("start", "pipeline_end")
        per_rank[1, self.rank] = clock.seconds("start", "end")
        per_rank[2, self.rank] = peak_memory_gb(self.device)
        # end of this rank's last backward to the end of its gradient sync
        per_rank[3, self.rank] = clock.seconds("pipeline_end", "sync_end")
        dist.all_reduce(stats)
        norm = torch.as_tensor(
            grad_norm if success else math.nan, dtype=torch.float64, device=self.device
        ).reshape(1)
        scale = self.optimizer.get_loss_scale().to(self.device, torch.float64).reshape(1)
        tokens = self._counts.sum().reshape(1)  # the global batch's
        read = torch.cat([stats, tokens, norm, scale]).tolist()  # the step's one read
        loss_sum, per_rank_values = read[0], read[1 : 1 + 4 * world]
        self.global_tokens, norm_value, loss_scale = read[-3], read[-2], read[-1]
        if self.global_tokens <= 0:
            raise RuntimeError("the global batch has no tokens with a loss mask")
        times = [per_rank_values[k * world : (k + 1) * world] for k in range(4)]
        pipelines = [max(times[0][r] for r in p.ranks) for p in self.plan.pipelines]
        return {
            "lm_loss": loss_sum / self.global_tokens,
            "grad_norm": norm_value if success else None,  # None: a skipped step
            "success": bool(success),
            "loss_scale": loss_scale,  # after this step's update (1.0 unscaled)
            "step_time_s": max(times[1]),
            "grad_sync_exposed_s": max(times[3]),
            "peak_memory_gb": times[2],
            "pipelines": pipelines,
            "tokens": self.global_tokens,
            "lr": self.optimizer.param_groups[0]["lr"],
            **self.outer.metrics(self.device),
        }

    def evaluate(self, window: int) -> Evaluation:
        """The validation loss over global batches [window x B, (window + 1) x B) of the
        validation samples (B = eval_iters): forward only, dropout off, no gradient. It is the
        token-weighted mean over every pipeline, as the training loss, so it is the one-rank
        plan's value under any plan. Draws no random numbers: training continues as without it."""

        from megatron_hexi.data import pipeline_microbatches

        assert self.valid_dataset is not None, "evaluation is off in this RunConfig"
        v, batches = self.view, self.config.evaluation.batches
        reads = v.holds_embedding or v.holds_output
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, tokens
        self.model.eval()
        try:
            with torch.no_grad():
                for k in range(window * batches, (window + 1) * batches):
                    data = (
                        pipeline_microbatches(self.valid_dataset, self.plan, v, k)
                        if reads
                        else iter(())
                    )
                    store = self._schedule(data, forward_only=True)
                    if v.holds_output and v.tp_rank == 0:
                        for s in store:
                            totals += s["lm loss"].to(totals)
        finally:
            self.model.train()
        dist.all_reduce(totals)
        loss_sum, tokens = totals.tolist()
        if tokens <= 0:
            raise RuntimeError("the validation batches have no tokens with a loss mask")
        return Evaluation(lm_loss=loss_sum / tokens, tokens=int(tokens), batches=batches)

    def _schedule(
        self, data: Iterator[dict[str, torch.Tensor]], *, forward_only: bool
    ) -> list[dict[str, torch.Tensor]]:
        """megatron-core's 1F1B schedule over this pipeline's micro-batches, with this stage's
        TP group, position and boundary communicator; returns the loss function's reports."""
        from megatron.core.pipeline_parallel.schedules import (
            forward_backward_pipelining_without_interleaving,
        )

        v = self.view
        return forward_backward_pipelining_without_interleaving(
            forward_step_func=self._forward_step,
            data_iterator=data,
            model=[self.model],
            num_microbatches=v.num_microbatches,
            seq_length=self.plan.model.seq_length,
            micro_batch_size=v.micro_batch_size,
            p2p_communicator=self.communicator,
            pg_collection=self.pg_collection(),
            forward_only=forward_only,
        )

    def pg_collection(self) -> ProcessGroupCollection:
        """The groups megatron-core's schedule needs: this stage's TP group and its position in
        the pipeline (no context or data parallelism inside a pipeline)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        return ProcessGroupCollection(
            tp=self.groups.tp,
            cp=SingleRank(),
            pp=self.position,
            embd=None,
            pos_embd=None,
            dp_cp=SingleRank(),
        )

    def settle_parameters(self) -> None:
        """Finish the parameter all-gathers still in flight (the plan's overlap_param_gather
        leaves them to the next forward): before anything reads the parameters otherwise."""
        if self.plan.training.overlap_param_gather:
            self.optimizer.finish_param_gather()
        self.outer.finish_exchanges()  # waited; their parameters land before the next update

    def full_parameters(self) -> dict[str, torch.Tensor] | None:
        """Gather every parameter to its full canonical tensor (for tests and export)."""
        from megatron_hexi.gather import gather_full_parameters

        self.settle_parameters()
        return gather_full_parameters(self.plan, self.rank, self.params, self.groups)


def run(
    plan: Plan, config: RunConfig, device: torch.device, plan_file: str | None = None
) -> tuple[Trainer, list[dict[str, Any]]]:
    """Train up to --train-iters iterations (resuming from --load), evaluating as the
    EvaluationConfig says; returns the trainer and the per-iteration metrics of this run (every
    rank). The trainer's `evaluations` lists every validation loss of the run. `plan_file` names
    the plan in the metrics (a run's history shows the plan of each start)."""
    trainer = Trainer(plan, config, device)
    first = load_at_start(trainer)
    stop = ExitSignal(device) if config.training.exit_signal_handler else None
    try:
        return _train(trainer, first, plan_file, stop)
    finally:
        if stop is not None:
            stop.restore()


def _train(
    trainer: Trainer, first: int, plan_file: str | None, stop: ExitSignal | None
) -> tuple[Trainer, list[dict[str, Any]]]:
    plan, config, device = trainer.plan, trainer.config, trainer.device
    train, log, ckpt, ev = config.training, config.logging, config.checkpoint, config.evaluation
    peak = sum(
        (get_gpu("CPU") if device.type == "cpu" else get_gpu(r.gpu)).peak_flops for r in plan.ranks
    )
    flops = model_flops_per_sample(plan.model) * plan.global_batch_size
    tokens_per_iter = plan.global_batch_size * plan.model.seq_length
    history: list[dict[str, Any]] = []
    rank, world = dist.get_rank(), dist.get_world_size()
    with contextlib.ExitStack() as outputs:  # closed on every way out, errors included
        metrics_file, writers = open_outputs(outputs, plan, config, append=bool(first))
        collector = outputs.enter_context(ManualGC(train.manual_gc, train.manual_gc_interval))
        duration = (
            ExitDuration(train.exit_duration_in_mins, device)
            if train.exit_duration_in_mins
            else None
        )

        def evaluate(iteration: int, end: bool) -> Evaluation:
            collector.around_evaluation()
            result = trainer.evaluate(eval_window(iteration, train.train_iters, ev, end=end))
            collector.around_evaluation()
            trainer.evaluations.append({"iteration": iteration, "end": end, **result._asdict()})
            for w in writers:
                w.log(iteration, validation_scalars(result.lm_loss), always=True)
            if rank == 0:
                where = f"iteration {iteration}" + (" on validation set" if end else "")
                print(validation_lines(where, result), flush=True)
            return result

        saved = first if ckpt.load else None
        signalled = False
        loads = [e for e in trainer.checkpoint_events if "load_iteration" in e]
        interval = IntervalLog(plan, train.train_iters, flops, log.log_throughput)
        last_iters = first if ev.skip_train else train.train_iters
        startup_line(
            "skipping training (--skip-train): evaluating"
            if ev.skip_train
            else f"start-up done: training from iteration {first}"
        )
        for it in range(first, last_iters):
            m = trainer.train_step(it)
            if log.log_params_norm:
                m["params_norm"] = trainer.params_norm()
            collector.after_iteration(it + 1)
            m["iteration"] = it + 1
            m["tokens_per_s"] = tokens_per_iter / m["step_time_s"]
            m["mfu"] = flops / (m["step_time_s"] * peak)
            m["world_size"], m["plan"] = world, plan_file
            if loads and it == first:  # what this start restored, on its first line
                m["restored"] = {k: loads[0][k] for k in ("optimizer_restored", "rng_restored")}
            history.append(m)
            interval.add(m)
            if ev.batches and ev.eval_interval and (it + 1) % ev.eval_interval == 0:
                m["eval_lm_loss"] = evaluate(it + 1, end=False).lm_loss
            if rank == 0:
                if (it + 1) % log.log_interval == 0:
                    print(interval.line(), flush=True)
                if metrics_file:
                    metrics_file.write_line(json.dumps(m))
            scalars = iteration_scalars(m, plan.global_batch_size)
            if log.log_world_size_to_tensorboard:
                scalars["world-size"] = float(world)
            for w in writers:
                w.log(it + 1, scalars)
            if train.check_for_nan_in_loss_and_grad:
                check_finite(m)
            if ckpt.save and ckpt.save_interval and (it + 1) % ckpt.save_interval == 0:
                save_at(trainer, ckpt.save, it + 1)
                saved = it + 1
            ending = stop_line(it + 1, stop, duration, train.exit_interval)
            if ending is not None:
                line, signalled = ending
                if rank == 0:
                    print(line, flush=True)
                break
        last = first + len(history)
        trainer.settle_parameters()
        if ckpt.save and history and saved != last:
            save_at(trainer, ckpt.save, last)
        if ev.batches and not signalled:  # a signalled run has seconds left: save, then go
            result = evaluate(last, end=True)
            if metrics_file:  # a line of its own: the last iteration's may hold another one
                metrics_file.write_line(
                    json.dumps({"iteration": last, "eval_lm_loss": result.lm_loss, "end": True})
                )
        if rank in (0, world - 1):
            text = summary(
                history,
                first,
                tokens_per_iter,
                flops,
                peak,
                device,
                ev.skip_train,
                [e for e in trainer.checkpoint_events if "save_iteration" in e],
            )
            if rank == 0:
                print(text, flush=True)
            for w in writers:
                w.summary(text, last)
    return trainer, history


def main(argv: Sequence[str] | None = None, checked: CommandLine | None = None) -> int:
    """Run pretrain_gpt.py; returns the exit code (2: a clear error). A failure after the process
    group exists ends the process itself (exit 1). `checked`: the command line already checked
    (megatron_hexi.entry does it before importing torch; its `cli`, hexi-train, ends the
    process with the code)."""
    interrupt.install()
    save: str | None = None
    try:
        command_line = checked or check_command_line(argv)
        args, config = command_line.args, command_line.config
        save = config.checkpoint.save
        if config.logging.tensorboard_dir:
            tensorboard_log.check_available()
        if config.logging.wandb_project:
            wandb_log.check_available()
        cuda = wants_cuda(config.runtime)
        if config.runtime.distributed_backend == "nccl" and not cuda:
            raise SpecError(
                "--distributed-backend nccl needs CUDA, and this run is on the CPU (no CUDA "
                "device, or --hetero-device cpu); drop the flag (gloo on the CPU) or run on GPUs"
            )
        input_files = [args.hetero_plan_path, args.hetero_cluster, args.hetero_model]
        if command_line.plan is not None:
            plan = command_line.plan
            check_transformer_impl(plan.training.transformer_impl, cuda)
            check_cuda_graphs(plan.training.cuda_graph_impl, cuda)
            plan_file: str | None = os.path.basename(args.hetero_plan_path)
            where = f"plan loaded: {args.hetero_plan_path}"
            device = init_distributed(plan, config)
            check_run_paths(config, input_files, resume_iteration(config.checkpoint))
        else:
            # the files are read before any process group
            inputs = planning_inputs(args, cuda=cuda)
            check_transformer_impl(inputs.options.transformer_impl, cuda)
            check_cuda_graphs(inputs.options.cuda_graph_impl, cuda)
            device = init_distributed(None, config)
            check_run_paths(config, input_files, resume_iteration(config.checkpoint))
            started = plan_at_start(inputs, config.checkpoint, device_name(device))
            plan, plan_file = started.plan, started.file_name
            check_against_plan(args, plan)
            where = "planned at start-up" + (
                f": {config.checkpoint.save}/plans/{plan_file}" if plan_file else " (no --save)"
            )
        startup_line(
            f"{where}: {plan.world_size} rank(s) in {len(plan.pipelines)} pipeline(s), "
            f"global batch {plan.global_batch_size}"
        )
        check_memory_fit(plan, device, device_name(device))
        run(plan, config, device, plan_file)
    except KeyboardInterrupt:
        interrupt.leave(save)
    except SpecError as e:
        if interrupt.received():
            interrupt.leave(save)
        if prints(e):
            for line in error_lines(e.problems):
                print(line, file=sys.stderr, flush=True)
        return 2
    except Exception as e:  # noqa: BLE001 - after start-up: say which rank and why, never hang
        if interrupt.received():
            interrupt.leave(save)
        if not dist.is_initialized():
            raise
        fail(e, config)
    finally:
        interrupt.restore()
    return 0
