"""DistributedGPipe: one partition per process under ``torchrun``, on ``torch.distributed``.

Every rank of the pipeline group builds the same ``DistributedGPipe`` (the module may be on the
``meta`` device: a rank materializes only its own partition) and calls :meth:`step` with the
same arguments each step. Rank ``s`` of the pipeline group runs stage ``s``; it walks its row of
the schedule with the same runtime and stage code as :class:`~gpipe_core.GPipe`, exchanging
activations and gradients with its neighbours point to point::

    rank 0: [stage 0] --activations--> rank 1: [stage 1] --> ... --> rank K-1: [stage K-1] + loss
            [stage 0] <--gradients---- rank 1: [stage 1] <-- ... <-- rank K-1

With virtual stages (``len(balance)`` a multiple of the group's size and a schedule that places
several stages per rank: ``"interleaved_1f1b"``, ``"zb_v"``, ``"dualpipe_v"``) a rank runs all of its stages'
actions in its row of the schedule, in one process; state_dict keys, shards, meta-device
construction and tied weights work as with one stage per rank.

With a data-parallel group as well (pipeline x data parallel), gradients are averaged over the
replicas of each stage after the pipeline's backward. If any rank fails, the others stop within
``timeout_s`` seconds (the pipeline group's timeout unless given) plus the few seconds it takes
to name the rank and stage that failed first (``failure.NAMING_S``).

A pipeline's whole life: :meth:`DistributedGPipe.save_checkpoint` writes the shards and, in
``index.json``, the pipeline's layout (stage split, placement, schedule, chunks:
:class:`~gpipe_core.PipelineLayout`); :meth:`DistributedGPipe.from_checkpoint` builds the
pipeline back from it, on the same or another number of ranks, to train, evaluate or decode;
:meth:`DistributedGPipe.channel` gives work between steps (pipelined decoding) the pipeline's
point-to-point messages, timeout and failure naming (:class:`~gpipe_core.Channel`).
"""


from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .batchnorm import DeferredBatchNorm
from .channel import Channel
from .events import TimelineEvent
from .failure import PipelineFailure, collectives, peer_failure, report_failure
from .gradients import average_gradients, clip_grad_norm
from .groups import default_device, group_timeout_s
from .layout import PipelineLayout, read_layout, stage_split
from .materialization import InitFn, is_meta, materialize_layer
from .microbatch import batch_size, gather, map_tensors, scatter
from .partition import Balance, split_module, verify_module
from .precision import LossScaler, check_precision
from .profile import profile_timeline
from .remat import Checkpoint, check_pipeline_args, fork_rng
from .runtime import StageRuntime, StepCounter, StepState
from .schedule import Action, Schedule, check_in_order_matching, get_schedule
from .shards import load_shards, save_stage_checkpoint, shard_name
from .stage import LossFn, Stage
from .stage_profile import StageProfile
from .storage import read_index, torch_load, verify_checkpoint
from .tied import TiedWeight
from .transport import DistributedTransport, policy_for

__all__ = ["DistributedGPipe"]


class DistributedGPipe(StepCounter, nn.Module):
    """The local stage (or stages) of a pipeline that spans the ranks of ``group``.

    Args:
        module: the whole network as ``nn.Sequential`` (on ``meta`` to save memory).
        balance: layers per stage; ``len(balance)`` equals the pipeline group's size, or a
            multiple of it with a schedule of virtual stages (several stages per rank).
        chunks: micro-batches per step (M).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``; or per stage the layers
            whose activations are kept (a :class:`~gpipe_core.Remat`, or one set of layer
            indices within the stage per stage), the rest recomputed in backward.
        schedule: ``"gpipe"`` (fill-drain), ``"1f1b"``, ``"1f1b_slack1"`` (1F1B with one more
            forward ahead on every stage but the last: hides message latency for one more
            micro-batch's activations; see :func:`~gpipe_core.one_f_one_b`), ``"zb_h1"`` or
            ``"zb_h2"`` (zero-bubble: the backward split into I and W, W deferred into the
            bubbles; see :func:`~gpipe_core.zb_h1`); with several stages per rank
            ``"interleaved_1f1b"`` or ``"interleaved_zb"`` (stage s on rank s mod R), ``"zb_v"``
            or ``"dualpipe_v"``
            (two stages per rank in a V); or a factory
            ``(num_stages, num_microbatches) -> Schedule``.
        loss_fn: ``loss_fn(output_mb, target_mb) -> 0-dim tensor``, run on the last stage.
        loss_reduction: ``"mean"`` averages the micro-batch losses; ``"sum"`` adds them (then
            pass ``normalizer=`` to :meth:`step`, e.g. the number of target tokens).
        group: the pipeline process group (default: the whole world).
        data_parallel_group: ranks holding the same stage in other replicas; gradients are
            averaged over it after each step.
        device: where the local stage lives (default: ``cuda:LOCAL_RANK`` with NCCL, else CPU).
        seed: base of the per-layer random streams and of meta-device initialisation.
        tied: ``(first_stage_param_name, last_stage_param_name)``: one weight shared by the
            first and last stage (e.g. embedding and output projection); kept equal, with
            gradients summed across the tie.
        timeout_s: how long a rank waits for a neighbour before declaring it failed (default:
            the pipeline group's own timeout, :func:`~gpipe_core.groups.group_timeout_s`, so one
            number, ``init_process_groups(timeout_s=...)``, bounds messages and collectives).
        record: keep a per-action timeline for :meth:`trace`.
        quiet_io: with gloo, keep gloo's I/O thread from preempting this rank's sends and
            receive posts (:class:`~gpipe_core.cpu.QuietIOThreads`; measured in
            docs/RESULTS.md); False gives plain gloo behaviour.
        precision: ``"fp32"`` runs as called (a ``torch.autocast`` around :meth:`step` is
            honoured); ``"bf16"`` or ``"fp16"`` runs every stage under autocast to that dtype.
            Re-materialized forwards are recomputed in the autocast state they first ran in.
            ``"fp16"`` also scales the loss (``loss_scaler``, default
            :class:`~gpipe_core.precision.LossScaler()`): each step unscales the gradients
            and every rank of the pipeline skips it together when any gradient is inf or NaN
            (the step's gradients are dropped, so ``optimizer.step()`` does nothing; see
            :attr:`step_skipped`).
        loss_scaler: the fp16 loss scaler (only with ``precision="fp16"``); save its
            ``state_dict()`` with the optimizer's to resume exactly.
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int],
        *,
        chunks: int,
        checkpoint: Checkpoint | Sequence[Collection[int]] = "except_last",
        schedule: str | Callable[[int, int], Schedule] = "gpipe",
        loss_fn: LossFn,
        loss_reduction: str = "mean",
        group: Any = None,
        data_parallel_group: Any = None,
        device: torch.device | str | None = None,
        seed: int | None = None,
        deferred_batch_norm: bool = False,
        tied: tuple[str, str] | None = None,
        init_fn: InitFn | None = None,
        timeout_s: float | None = None,
        record: bool = False,
        quiet_io: bool = True,
        precision: str = "fp32",
        loss_scaler: LossScaler | None = None,
    ) -> None:
        super().__init__()
        _require_distributed()
        verify_module(module)
        checkpoint = check_pipeline_args(chunks=chunks, checkpoint=checkpoint, balance=balance)
        check_precision(precision)
        if loss_scaler is not None and precision != "fp16":
            raise ValueError(f"loss_scaler= is for precision='fp16' (got precision="
                             f"{precision!r}): bf16 and fp32 gradients need no scaling")
        self.precision = precision
        self.loss_scaler = (loss_scaler or LossScaler()) if precision == "fp16" else None
        self.step_skipped = False  # fp16: the last step's gradients were not finite
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction={loss_reduction!r} must be 'mean' or 'sum'")
        self.group = group
        self.data_parallel_group = data_parallel_group
        self.num_ranks = dist.get_world_size(group)
        self.pipeline_rank = dist.get_rank(group)
        self.num_stages = len(balance)
        if self.num_stages < self.num_ranks or self.num_stages % self.num_ranks:
            raise ValueError(
                f"len(balance)={len(balance)} does not match the pipeline group's size "
                f"{self.num_ranks}; launch one process per partition (torchrun "
                f"--nproc-per-node {len(balance)}) or change balance (a multiple of the group's "
                "size runs several stages per rank with schedule='interleaved_1f1b', "
                "'interleaved_zb', 'zb_v' or 'dualpipe_v')"
            )
        self.schedule_name = schedule
        self._schedules: dict[int, Schedule] = {}
        self._policy = policy_for(dist.get_backend(group), quiet_io=quiet_io)
        # The rank of every stage (the schedule's placement); also checks the schedule fits.
        self.placement = self.schedule(chunks).placement
        self.stage_indices = tuple(
            s for s, r in enumerate(self.placement) if r == self.pipeline_rank)
        self.stage_ranks = [self._global_rank(r) for r in self.placement]
        # A parameter tied across the first and last stage is allowed; any other sharing isn't.
        partitions = split_module(module, balance, tie_first_last=tied is not None)
        self.balance = list(balance)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.loss_reduction = loss_reduction
        self.deferred_batch_norm = deferred_batch_norm
        self.tied = tied
        # layer index -> its name, to tell which shards of a checkpoint hold this rank's layers
        self._layer_names = [name for part in partitions for name, _ in part]
        if timeout_s is None:
            timeout_s = group_timeout_s(group)
        if not timeout_s > 0 or timeout_s == float("inf"):
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        self.timeout_s = timeout_s
        self.seed = torch.initial_seed() if seed is None else int(seed)
        self.device = torch.device(device) if device is not None else default_device()
        mailbox: dict[tuple[int, int], list[tuple[Any, float]]] = {}  # this rank's own stages
        self.stages: list[Stage] = []
        self.transports: list[DistributedTransport] = []
        self.runtimes: list[StageRuntime] = []
        for index in self.stage_indices:
            first_layer_index = sum(self.balance[:index])
            local = partitions[index]
            meta = any(is_meta(layer) for _, layer in local)
            names = []
            for offset, (name, layer) in enumerate(local):
                if meta:
                    materialize_layer(
                        layer, first_layer_index + offset, seed=self.seed, device=self.device,
                        init_fn=init_fn,
                    )
                else:
                    layer.to(self.device)
                if deferred_batch_norm:
                    layer = DeferredBatchNorm.convert(layer)
                self.add_module(name, layer)
                names.append(name)
            stage = Stage(
                [(name, self._modules[name]) for name in names],  # type: ignore[misc]
                stage_index=index,
                num_stages=self.num_stages,
                first_layer_index=first_layer_index,
                device=self.device,
                checkpoint=checkpoint,
                seed=self.seed,
                loss_fn=loss_fn if index == self.num_stages - 1 else None,
                restore_rng=False,  # _run_step forks the random state once per step
                precision=precision,
            )
            transport = DistributedTransport(index, self.stage_ranks, self.device,
                                             policy=self._policy, timeout_s=timeout_s,
                                             local=mailbox)
            self.stages.append(stage)
            self.transports.append(transport)
            self.runtimes.append(StageRuntime(stage, transport, record=record))
        self._runtime_of = dict(zip(self.stage_indices, self.runtimes, strict=True))
        # The first of this rank's stages (the only one without virtual stages).
        self.stage, self.transport, self.runtime = self.stages[0], self.transports[0], self.runtimes[0]
        self._step = 0
        self._evaluations = 0
        self._tied = TiedWeight.resolve(dict(self.named_parameters(remove_duplicate=False)), tied,
                                        stages=self.stage_indices, stage_ranks=self.stage_ranks,
                                        policy=self._policy, timeout_s=timeout_s)
        if self._tied is not None:
            self._tied.sync()

    # -- structure -------------------------------------------------------------------------

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    @property
    def stage_index(self) -> int:
        """The stage this rank runs (with virtual stages: see ``stage_indices``)."""
        if len(self.stage_indices) != 1:
            raise RuntimeError(f"rank {self.pipeline_rank} of the pipeline runs stages "
                               f"{list(self.stage_indices)}; use stage_indices")
        return self.stage_indices[0]

    @property
    def is_first(self) -> bool:
        """This rank runs the first stage (it reads the inputs)."""
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        """This rank runs the last stage (it reads the targets and computes the loss)."""
        return self.num_stages - 1 in self.stage_indices

    def schedule(self, num_microbatches: int) -> Schedule:
        """The checked schedule for ``num_microbatches``, built once per micro-batch count
        (every step asks; greedy schedules such as ZB-V take milliseconds to build)."""
        cached = self._schedules.get(num_microbatches)
        if cached is not None:
            return cached
        name = self.schedule_name
        chosen = name(self.num_stages, num_microbatches) if callable(name) else name
        schedule = get_schedule(chosen, self.num_stages, num_microbatches,
                                num_ranks=self.num_ranks)
        if schedule.virtual and not self._policy.tags:
            check_in_order_matching(schedule)
        built = getattr(self, "placement", None)  # None while __init__ asks the first time
        if built is not None and schedule.placement != built:
            raise ValueError(f"schedule {schedule.name!r} places stages on ranks "
                             f"{list(schedule.placement)} for {num_microbatches} micro-batches, "
                             "unlike the pipeline was built with; a schedule factory must keep "
                             "the placement for every micro-batch count")
        self._schedules[num_microbatches] = schedule
        return schedule

    # -- one training step -----------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "DistributedGPipe runs a whole step at once: use pipe.step(inputs, targets) to "
            "train and pipe.evaluate(inputs, targets) for a forward-only pass"
        )

    def step(self, inputs: Any = None, targets: Any = None, *, normalizer: float | None = None) -> Tensor:
        """Forward and backward of one mini-batch; returns its loss on every rank.

        ``inputs`` are read on the first stage and ``targets`` on the last (other ranks may pass
        None). Gradients accumulate into the local parameters' ``.grad``; call the optimizer
        afterwards. ``normalizer``: divide every micro-batch loss by it (e.g. target tokens).
        """
        loss, _ = self._guarded(inputs, targets, normalizer, train=True, keep_outputs=False)
        return loss

    def evaluate(
        self,
        inputs: Any = None,
        targets: Any = None,
        *,
        normalizer: float | None = None,
        return_outputs: bool = False,
    ) -> tuple[Tensor, Any]:
        """Forward only, without autograd: ``(loss on every rank, outputs on the last stage)``.

        Runs the schedule's forward actions; outputs (gathered over micro-batches) are returned
        on the last stage when ``return_outputs``, else None. Does not advance ``steps_done``,
        so evaluating does not change the random streams of later training steps. It does not
        switch modes either: call ``pipe.eval()`` first (or BatchNorm layers in training mode
        fold the evaluation batches into their running statistics) and ``pipe.train()`` after.
        """
        with torch.no_grad():
            return self._guarded(inputs, targets, normalizer, train=False,
                                 keep_outputs=return_outputs)

    def _guarded(self, inputs: Any, targets: Any, normalizer: float | None, *, train: bool,
                 keep_outputs: bool) -> tuple[Tensor, Any]:
        try:
            return self._run_step(inputs, targets, normalizer, train, keep_outputs)
        except PipelineFailure:  # a peer failed: its message names this rank, the peer, the bound
            raise
        except BaseException as exc:
            report_failure(exc, where=self._where())
            raise


    def _where(self) -> str:
        stages = self.stage_indices
        what = f"stage {stages[0]}" if len(stages) == 1 else f"stages {list(stages)}"
        return f"rank {dist.get_rank()} ({what})"

    def _run_step(self, inputs: Any, targets: Any, normalizer: float | None, train: bool,
                  keep_outputs: bool) -> tuple[Tensor, Any]:
        # Training and evaluation count separately; the step number seeds the random streams.
        if train:
            step = self._step
            self._step += 1
        else:
            step = -1 - self._evaluations
            self._evaluations += 1
        state = StepState(step, 0, backward=train, keep_outputs=keep_outputs and self.is_last)
        if self.is_first:
            if inputs is None:
                raise ValueError("the first stage needs inputs: pipe.step(inputs, targets)")
            state.inputs = [_to_device(mb, self.device) for mb in scatter(inputs, self.chunks)]
            state.num_microbatches = len(state.inputs)
        for runtime in self.runtimes:  # a rank without the first stage learns the count here
            runtime.begin_step(state)
        num_microbatches = state.num_microbatches
        if self.is_last:
            if targets is None:
                raise ValueError("the last stage needs targets: pipe.step(inputs, targets)")
            state.targets = [_to_device(t, self.device) for t in scatter(targets, self.chunks)]
            if len(state.targets) != num_microbatches:
                raise ValueError(
                    f"targets split into {len(state.targets)} micro-batches but inputs into "
                    f"{num_microbatches}; targets must have the inputs' batch size "
                    f"(got {batch_size(targets)})"
                )
        if normalizer is not None:
            loss_scale: float | None = 1.0 / float(normalizer)
        elif self.loss_reduction == "mean":
            loss_scale = 1.0 / num_microbatches
        else:
            loss_scale = None
        scaler = self.loss_scaler if train else None
        accumulated = self._set_aside_gradients() if scaler is not None else None
        for stage in self.stages:
            stage.loss_scale = loss_scale
            stage.grad_scale = scaler.scale if scaler is not None else 1.0
        actions = self.schedule(num_microbatches).actions[self.pipeline_rank]
        if not train:
            actions = tuple(a for a in actions if a.kind == "F")
        with fork_rng([self.device]):  # layers draw from their own seeded streams
            for action in actions:
                self._runtime_of[action.stage].run_action(action, state)
        # Every stage but the last received the loss with its last gradient message.
        carried = [runtime.finish_step() for runtime in self.runtimes][0]
        outputs = None
        loss: Tensor
        if self.is_last:
            loss = self.stages[-1].step_loss(step)  # type: ignore[assignment]  # has a loss_fn
            if keep_outputs:
                outputs = gather([state.outputs[mb] for mb in range(num_microbatches)])
        elif train:  # the step's last gradient message brought the loss
            loss = torch.tensor(carried, dtype=torch.float64, device=self.device)
        else:
            loss = torch.zeros((), device=self.device, dtype=torch.float64)
        for stage in self.stages:
            stage.discard(step)
        try:
            if train and self._tied is not None:  # point to point, over the transport
                self._tied.reduce_gradient()
            # Collectives: every rank of the world enters this block (or none does), so a rank
            # that hangs or died before it is named by those waiting in it (failure.collectives)
            if not train or self.data_parallel_group is not None:
                what = (f"the loss broadcast of evaluation {-step}" if not train else
                        f"the data-parallel gradient average of step {step + 1}")
                with collectives(what):
                    if not train:
                        dist.broadcast(loss, src=self.stage_ranks[-1], group=self.group)
                    else:
                        average_gradients(list(self.parameters()), self.data_parallel_group)
            if scaler is not None:  # after the average: replicas of a stage agree already
                self._unscale(scaler, accumulated)
        except PipelineFailure:
            raise
        except RuntimeError as exc:  # a peer died between our last message and the collective
            raise peer_failure(f"{self._where()}, in a collective after the step,", exc,
                               self.timeout_s) from exc
        return loss, outputs

    def _set_aside_gradients(self) -> dict[Tensor, Tensor]:
        """Gradients accumulated before an fp16 step, taken out of ``.grad`` so that the step
        unscales (and, if not finite, drops) only its own; :meth:`_unscale` adds them back."""
        kept: dict[Tensor, Tensor] = {p: p.grad for p in self.parameters() if p.grad is not None}
        for p in kept:
            p.grad = None
        return kept

    def _unscale(self, scaler: LossScaler, accumulated: dict[Tensor, Tensor] | None) -> None:
        """Unscale this step's gradients; all ranks of the pipeline skip the step together if
        any is inf or NaN (every gradient dropped, including those accumulated before, as
        GradScaler skips the whole optimizer step; the scale backed off), else none does."""
        params = list(self.parameters())
        finite = scaler.unscale_(params, group=self.group, device=self.device)
        scaler.update(finite)
        self.step_skipped = not finite
        for p in params:
            earlier = (accumulated or {}).get(p)
            if not finite:
                p.grad = None
            elif earlier is not None:
                p.grad = earlier if p.grad is None else earlier.add_(p.grad)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip gradients by one norm over all stages' parameters; return that total norm."""
        tied = self._tied
        return clip_grad_norm(
            list(self.parameters()), max_norm, norm_type, group=self.group, device=self.device,
            counted_elsewhere=tied.second_copy if tied is not None else None,
        )

    # -- timeline --------------------------------------------------------------------------

    @property
    def timeline(self) -> list[TimelineEvent]:
        """This rank's actions as they ran (over all of its stages), in time order;
        ``pipe.timeline.clear()`` forgets them on every stage of this rank."""
        if len(self.runtimes) == 1:
            return self.runtime.timeline
        return _MergedTimeline([r.timeline for r in self.runtimes])

    def profile(self, *, transfer: float | Sequence[float] = 0.0) -> StageProfile:
        """The costs of every stage's actions as this pipeline ran them, from the steps in the
        timelines (:func:`~gpipe_core.profile.profile_timeline`): what
        :func:`~gpipe_core.simulator.simulate` takes to predict other schedules, micro-batch
        counts aside. Clear the timelines (``pipe.timeline.clear()`` on every rank) after
        warm-up steps. Collective: every rank of the pipeline group must call it; every rank
        gets the same profile.
        """
        from .trace import gather_timelines

        merged = gather_timelines(self.timeline, group=self.group)
        used = {Action.parse(e.action).mb for e in merged}
        m = max(used) + 1 if used else self.chunks
        return profile_timeline(merged, self.schedule(m), checkpoint=str(self.checkpoint),
                                transfer=transfer)

    def trace(self, json_path: str | Path, png_path: str | Path | None = None) -> None:
        """Gather every stage's timeline on the first rank; write Chrome-trace JSON and a PNG.

        Collective: every rank of the pipeline group must call it.
        """
        from .trace import gather_timelines, write_chrome_trace, write_timeline_png

        merged = gather_timelines(self.timeline, group=self.group)
        if self.pipeline_rank == 0:
            placement = self.placement if self.num_stages != self.num_ranks else None
            write_chrome_trace(merged, json_path, placement=placement)
            if png_path is not None:
                write_timeline_png(merged, png_path, num_stages=self.num_stages,
                                   placement=placement)

    # -- messages outside steps -------------------------------------------------------------

    def channel(self, what: str = "messages outside steps", *,
                timeout_s: float | None = None) -> Channel:
        """A point-to-point :class:`~gpipe_core.Channel` between this rank's stage and the
        others, with the pipeline's backend policy, timeout (unless ``timeout_s``) and failure
        naming (``what`` names the work in errors); for work between steps such as pipelined
        decoding. One stage per rank."""
        return Channel(self.stage_index, self.stage_ranks, policy=self._policy,
                       timeout_s=self.timeout_s if timeout_s is None else timeout_s, what=what)

    # -- checkpoints -----------------------------------------------------------------------

    @property
    def layout(self) -> PipelineLayout:
        """How this pipeline is built, as :meth:`save_checkpoint` records it in ``index.json``."""
        name = self.schedule_name
        return PipelineLayout(
            balance=tuple(self.balance), placement=tuple(self.placement),
            num_ranks=self.num_ranks,
            schedule=name if isinstance(name, str) else None, chunks=self.chunks,
            checkpoint=str(self.checkpoint), loss_reduction=self.loss_reduction,
            deferred_batch_norm=self.deferred_batch_norm, tied=self.tied, seed=self.seed,
            steps_done=self.steps_done,
        )

    def save_checkpoint(self, directory: str | Path, *, files: dict[str, Any] | None = None) -> None:
        """Write this rank's shard (its stages' layers) into the checkpoint folder
        ``directory``; keys are the original module's names (see :func:`~gpipe_core.load_shards`).

        Collective over the world. Only the first data-parallel replica writes shards; every
        rank also writes its own ``files`` (name -> bytes, text, or an object for torch.save).
        Each file is written atomically; then global rank 0 writes ``index.json`` with every
        file's size and SHA-256 and the pipeline's :attr:`layout` (stage split, placement,
        schedule, chunks: what :meth:`from_checkpoint` rebuilds), and all ranks wait until it
        exists. A checkpoint folder with an ``index.json`` is therefore complete, and loading
        verifies each file against it.
        """
        replica = dist.get_rank(self.data_parallel_group) if self.data_parallel_group else 0
        save_stage_checkpoint(self.state_dict() if replica == 0 else None, Path(directory),
                              shard=self.pipeline_rank, num_shards=self.num_ranks, files=files,
                              pipeline=self.layout.to_json())

    def load_checkpoint(self, directory: str | Path) -> None:
        """Load this rank's parameters from a checkpoint written with any number of stages and
        any placement.

        Only the shards holding this rank's layers are read (the checkpoint's recorded layout
        says which; with the same balance and placement, this rank's own shard), so no rank
        reads the whole model; a checkpoint without a layout is read from this rank's own
        shard when that shard holds every key of the rank, else from every shard.
        """
        keys = set(self.state_dict())
        directory = Path(directory)
        layout = read_layout(directory)
        state: dict[str, Tensor] | None = None
        if layout is not None and sum(layout.balance) == len(self._layer_names):
            try:
                state = load_shards(directory, keys=keys, shards=self._shards_in(layout))
            except KeyError:  # a key outside its layer's shard (a tied weight): read them all
                state = None
        elif int(read_index(directory)["num_shards"]) == self.num_ranks:
            name = shard_name(self.pipeline_rank, self.num_ranks)
            verify_checkpoint(directory, [name])
            own = torch_load(directory / name, weights_only=True)
            if keys <= set(own):
                state = {key: own[key] for key in keys}
            del own
        self.load_state_dict(state if state is not None else load_shards(directory, keys=keys))
        if self._tied is not None:
            self._tied.sync()

    def _shards_in(self, layout: PipelineLayout) -> set[int]:
        """The shards of a checkpoint of ``layout`` that hold this rank's layers."""
        owner = [layout.placement[stage] for stage, count in enumerate(layout.balance)
                 for _ in range(count)]  # layer index -> the rank (shard) that saved it
        mine = {name for name in self._modules}
        return {owner[index] for index, name in enumerate(self._layer_names) if name in mine}

    @classmethod
    def from_checkpoint(
        cls,
        directory: str | Path,
        module: nn.Sequential,
        *,
        loss_fn: LossFn | None = None,
        balance: Sequence[int] | None = None,
        num_stages: int | None = None,
        resplit: Callable[[nn.Sequential, int], Balance] | None = None,
        chunks: int | None = None,
        schedule: str | Callable[[int, int], Schedule] | None = None,
        checkpoint: str | None = None,
        loss_reduction: str | None = None,
        deferred_batch_norm: bool | None = None,
        tied: tuple[str, str] | None = None,
        seed: int | None = None,
        group: Any = None,
        **options: Any,
    ) -> DistributedGPipe:
        """The pipeline a checkpoint folder was saved from, built on this pipeline group and
        loaded, for training, evaluation or decoding.

        ``module``: the whole network, as for the constructor (on ``meta``: each rank
        materializes and reads only its own layers). Every argument left None is the one
        recorded in the checkpoint's ``index.json`` (:class:`~gpipe_core.PipelineLayout`):
        ``chunks``, ``schedule``, ``checkpoint``, ``loss_reduction``, ``deferred_batch_norm``,
        ``tied``, ``seed``; ``steps_done`` is restored too, so training continues the random
        streams. Other keyword arguments (``device``, ``data_parallel_group``, ``timeout_s``,
        ``quiet_io``, ...) go to the constructor. ``loss_fn`` is needed to train or evaluate a
        loss, not to decode.

        The stage split: ``balance`` when given; else the recorded one when this pipeline has
        ``num_stages`` stages (default: the recorded stages per rank times this group's size)
        and that number divides the recorded one (adjacent recorded stages are joined: ``[2, 2,
        2, 2]`` on 2 ranks is ``[4, 4]``); else ``resplit(module, num_stages)`` (e.g.
        ``gp.balance_by_params``) when given; else ValueError naming the values and the fix.
        A checkpoint written before the layout was recorded needs ``balance`` or ``resplit``
        (and runs ``"gpipe"`` unless ``schedule`` is given). To load a checkpoint into the plain
        module instead: ``module.load_state_dict(gp.load_shards(directory))``.
        """
        _require_distributed()
        directory = Path(directory)
        layout = read_layout(directory)  # FileNotFoundError without an index.json
        num_ranks = dist.get_world_size(group)
        balance = stage_split(
            directory, layout, num_layers=len(module), num_ranks=num_ranks,
            num_stages=num_stages, balance=balance,
            resplit=None if resplit is None else functools.partial(resplit, module))
        if schedule is None:
            schedule = layout.schedule if layout is not None else "gpipe"
        if schedule is None:
            raise ValueError(f"checkpoint {directory} was trained with a schedule factory, which "
                             "cannot be rebuilt from a name; pass schedule=")
        recorded = layout or PipelineLayout((), (), num_ranks, "gpipe", 1)
        pipe = cls(
            module, list(balance),
            chunks=chunks if chunks is not None else recorded.chunks,
            checkpoint=checkpoint if checkpoint is not None else recorded.checkpoint,
            schedule=schedule,
            loss_fn=loss_fn if loss_fn is not None else _no_loss_fn,
            loss_reduction=(loss_reduction if loss_reduction is not None
                            else recorded.loss_reduction),
            deferred_batch_norm=(deferred_batch_norm if deferred_batch_norm is not None
                                 else recorded.deferred_batch_norm),
            tied=tied if tied is not None else recorded.tied,
            seed=seed if seed is not None else recorded.seed,
            group=group,
            **options,
        )
        pipe.load_checkpoint(directory)
        pipe.steps_done = recorded.steps_done
        return pipe


def _require_distributed() -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised; launch with torchrun and call "
            "gp.init_process_groups(num_stages) (or dist.init_process_group) first"
        )


def _no_loss_fn(outputs: Any, targets: Any) -> Tensor:
    raise TypeError("this pipeline was built from a checkpoint without loss_fn; pass loss_fn= "
                    "to DistributedGPipe.from_checkpoint to train or evaluate a loss")


def _to_device(batch: Any, device: torch.device) -> Any:
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


class _MergedTimeline(list[TimelineEvent]):
    """The events of several stages' timelines (a rank's virtual stages) in time order; its
    :meth:`clear` clears those timelines, so that ``pipe.timeline.clear()`` does what it says
    whatever the stages per rank."""

    def __init__(self, sources: list[list[TimelineEvent]]) -> None:
        super().__init__(sorted((e for source in sources for e in source), key=lambda e: e.start))
        self._sources = sources

    def clear(self) -> None:
        for source in self._sources:
            source.clear()
        super().clear()
