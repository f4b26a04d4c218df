"""DistributedGPipe: one partition per process under ``torchrun``, on ``torch.distributed``.

Every rank of the pipeline group builds the same ``DistributedGPipe`` (the module may be on the
``meta`` device: a rank materializes only its own partition) and calls :meth:`step` with the
same arguments each step. Rank ``s`` of the pipeline group runs stage ``s``; it walks its row of
the schedule with the same runtime and stage code as :class:`~gpipe_core.GPipe`, exchanging
activations and gradients with its neighbours point to point::

    rank 0: [stage 0] --activations--> rank 1: [stage 1] --> ... --> rank K-1: [stage K-1] + loss
            [stage 0] <--gradients---- rank 1: [stage 1] <-- ... <-- rank K-1

With a data-parallel group as well (pipeline x data parallel), gradients are averaged over the
replicas of each stage after the pipeline's backward. If any rank fails, the others stop within
``timeout_s`` seconds with an error naming the rank and stage that failed first.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .batchnorm import DeferredBatchNorm
from .remat import CHECKPOINT_MODES, fork_rng
from .cpu import bind_cpus, hold_freed_memory
from .materialize import InitFn, is_meta, materialize_layer
from .microbatch import batch_size, gather, scatter
from .partition import split_module, verify_module
from .runtime import StageRuntime, StepState, TimelineEvent
from .schedule import Schedule, get_schedule
from .stage import LossFn, Stage
from .storage import FileEntry, read_index, torch_load, verify_checkpoint, write_atomic, write_index
from .transport import DistributedTransport, PeerError

__all__ = [
    "DistributedGPipe",
    "PipelineFailure",
    "collectives",
    "init_process_groups",
    "load_checkpoint",
    "report_failure",
    "save_checkpoint",
]

_FAILURE_KEY = "gpipe/first_failure"
_MARK_KEY = "gpipe/mark/{rank}"  # the `collectives` block each rank last entered (or failed in)
_sections = itertools.count()  # blocks entered by this process, in order
_GRACE_S = 2.0  # how long a failing rank waits for others' marks to settle before naming them


class PipelineFailure(RuntimeError):
    """Another rank of the pipeline failed; the message names it and its error."""


_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - the store is a best-effort side channel
        return None


def _watch_launcher(poll_s: float = 1.0) -> None:
    """Under torchrun, send this worker SIGTERM when its agent dies (a lost node).

    A worker whose agent was killed would otherwise run on as an orphan, and the agent of the
    other node would count the job a success. A daemon thread polls the parent's pid; SIGTERM
    lets a training loop checkpoint and stop (see apps.common.Interrupt), and its peers see the
    stop too.
    """
    global _launcher_watched
    if "TORCHELASTIC_RUN_ID" not in os.environ or _launcher_watched:
        return
    _launcher_watched = True
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="gpipe-launcher-watch", daemon=True).start()


_launcher_watched = False


def report_failure(exc: BaseException, *, where: str | None = None) -> None:
    """Record ``exc`` in the c10d store as the run's first failure (if none was recorded yet).

    Other ranks that then fail waiting for this one name it and its error instead of a timeout.
    Call it from a script's top-level error handler; DistributedGPipe does for its own steps.
    """
    if isinstance(exc, PipelineFailure) or not dist.is_initialized():
        return
    store = _default_store()
    if store is None:
        return
    where = where or f"rank {dist.get_rank()}"
    try:
        # compare_set writes only if nobody failed before us: the first failure wins.
        store.compare_set(_FAILURE_KEY, "", f"{where}: {type(exc).__name__}: {exc}")
    except Exception:  # noqa: BLE001
        pass


def _first_failure(store: Any, wait_s: float) -> str | None:
    """The first failure recorded in the store, waiting up to ``wait_s`` for one."""
    # polls with check(): store.wait() would print a warning from c10d when it times out
    deadline = time.monotonic() + wait_s
    try:
        while not store.check([_FAILURE_KEY]):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        first: str = store.get(_FAILURE_KEY).decode()
        return first or None
    except Exception:  # noqa: BLE001
        return None


def _set_mark(store: Any, rank: int, section: int, what: str, state: str) -> None:
    global _marks_off
    if _marks_off:
        return
    mark = json.dumps({"section": section, "what": what, "state": state})
    try:
        store.set(_MARK_KEY.format(rank=rank), mark)
    except Exception:  # noqa: BLE001 - the store is a side channel; the collective still runs
        _marks_off = True  # its host is gone (a lost node): stop asking, and warning, each time


_marks_off = False


def _get_marks(store: Any, world: int) -> dict[int, dict[str, Any]]:
    marks = {}
    for rank in range(world):
        key = _MARK_KEY.format(rank=rank)
        try:
            if store.check([key]):
                marks[rank] = json.loads(store.get(key).decode())
        except Exception:  # noqa: BLE001
            continue
    return marks


@contextlib.contextmanager
def collectives(what: str) -> Iterator[None]:
    """A block of collectives outside ``step()`` that fails, naming the rank, instead of hanging.

    Every rank of the world must enter the same blocks in the same order (a collective needs all
    its ranks anyway). A collective waits at most the process group's timeout
    (``init_process_groups(timeout_s=...)``, the same bound as the pipeline's); when one fails
    (a rank stopped answering, or died), the block raises :class:`PipelineFailure` naming the
    rank(s) that did not get there: each rank records in the c10d store which block it entered
    (and that it failed there), and the ranks still behind, or inside the block without having
    failed within a short grace, are named.
    A rank that raised instead is named with its error (:func:`report_failure`).
    """
    store = _default_store() if dist.is_initialized() else None
    if store is None:
        yield
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    section = next(_sections)
    _set_mark(store, rank, section, what, "in")
    try:
        yield
    except PipelineFailure:
        raise
    except RuntimeError as exc:
        if not _is_communication_error(exc):
            raise  # a bug in the block, not a peer: its own error and traceback
        _set_mark(store, rank, section, what, "failed")
        raise _collective_failure(store, rank, world, section, what, exc) from exc
    # no mark on the way out (one store round trip per block is enough): a rank that left this
    # block and hangs before the next one is found behind by whoever waits in the next one


_COMMUNICATION_WORDS = ("gloo", "nccl", "timed out", "connection", "socket", "peer")


def _is_communication_error(exc: BaseException) -> bool:
    """Whether a collective failed for want of a peer (gloo raises plain RuntimeErrors: timed
    out, connection reset or closed), as opposed to an error in the caller's own code."""
    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or any(word in text for word in _COMMUNICATION_WORDS)


def _collective_failure(store: Any, rank: int, world: int, section: int, what: str,
                        exc: BaseException) -> PipelineFailure:
    where = f"rank {rank} stops"
    first = _first_failure(store, 0.5)
    if first:
        return PipelineFailure(f"{where}: the run failed at {first}")

    def stuck(marks: dict[int, dict[str, Any]]) -> dict[int, str]:
        found = {}
        for other in range(world):
            mark = marks.get(other)
            if other == rank:
                continue
            if mark is None:
                found[other] = "never entered a collective block"
            elif mark["section"] < section:
                found[other] = f"is still at {mark['what']!r}"
            elif mark["section"] == section and mark["state"] == "in":
                found[other] = "is inside it and has not failed"
        return found

    deadline = time.monotonic() + _GRACE_S  # ranks that time out a moment after us drop out
    found = stuck(_get_marks(store, world))
    while found and time.monotonic() < deadline:
        time.sleep(0.2)
        found = stuck(_get_marks(store, world))
    first = _first_failure(store, 0.1)
    if first:
        return PipelineFailure(f"{where}: the run failed at {first}")
    error = " ".join(str(exc).split())[:300]
    if not found:
        return PipelineFailure(f"{where}: a collective in {what!r} failed ({error})")
    names = "; ".join(f"rank {r} {why}" for r, why in found.items())
    return PipelineFailure(
        f"{where}: a collective in {what!r} got no answer ({names}; that rank hangs or died; "
        f"{error})"
    )


def init_process_groups(
    num_stages: int,
    *,
    backend: str | None = None,
    timeout_s: float = 60.0,
    pin_cpus: bool = False,
    hold_memory: bool = False,
) -> tuple[Any, Any]:
    """Initialise torch.distributed from torchrun's environment and build the two groups.

    Ranks are laid out pipeline-major: with world size ``W`` and ``K = num_stages`` there are
    ``W / K`` replicas; replica ``r`` holds ranks ``r*K ... r*K + K-1`` (its stages in order).
    Returns ``(pipeline_group, data_parallel_group)`` of the calling rank; the data-parallel
    group links the ranks that hold the same stage. Backend: NCCL with CUDA, else gloo.
    ``pin_cpus``: first give each local rank its own share of the CPU cores
    (:func:`~gpipe_core.bind_cpus`); ``hold_memory``: keep freed blocks mapped
    (:func:`~gpipe_core.hold_freed_memory`). Both are worth it when stages compute on the CPU.
    """
    if not dist.is_initialized() and not all(k in os.environ for k in _TORCHRUN_ENV):
        missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
        raise RuntimeError(
            f"not launched by torchrun ({', '.join(missing)} unset): start one process per "
            f"stage with `python -m torch.distributed.run --nproc-per-node {num_stages} "
            "<script>` (or call dist.init_process_group yourself first)"
        )
    _watch_launcher()
    if pin_cpus:
        bind_cpus()
    if hold_memory:
        hold_freed_memory()
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % num_stages != 0:
        raise ValueError(
            f"world size {world} is not a multiple of num_stages={num_stages}; launch "
            f"torchrun with --nproc-per-node a multiple of {num_stages}"
        )
    replicas = world // num_stages
    pipeline_group = data_group = None
    # new_group must be called by every rank for every group, in the same order.
    for replica in range(replicas):
        ranks = list(range(replica * num_stages, (replica + 1) * num_stages))
        group = dist.new_group(ranks)
        if rank in ranks:
            pipeline_group = group
    for stage in range(num_stages):
        ranks = [replica * num_stages + stage for replica in range(replicas)]
        group = dist.new_group(ranks)
        if rank in ranks:
            data_group = group
    return pipeline_group, data_group


class DistributedGPipe(nn.Module):
    """The local stage of a pipeline that spans the ranks of ``group``.

    Args:
        module: the whole network as ``nn.Sequential`` (on ``meta`` to save memory).
        balance: layers per stage; ``len(balance)`` must equal the pipeline group's size.
        chunks: micro-batches per step (M).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        schedule: ``"gpipe"`` (fill-drain), ``"1f1b"``, ``"1f1b_slack1"`` (1F1B with one more
            forward ahead on every stage but the last: hides message latency for one more
            micro-batch's activations; see :func:`~gpipe_core.one_f_one_b`), or a factory
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
        timeout_s: how long a rank waits for a neighbour before declaring it failed.
        record: keep a per-action timeline for :meth:`trace`.
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int],
        *,
        chunks: int,
        checkpoint: str = "except_last",
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
        timeout_s: float = 60.0,
        record: bool = False,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised; launch with torchrun and call "
                "gp.init_process_groups(num_stages) (or dist.init_process_group) first"
            )
        verify_module(module)
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks={chunks!r} must be a positive integer")
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint={checkpoint!r} is not one of {CHECKPOINT_MODES}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction={loss_reduction!r} must be 'mean' or 'sum'")
        self.group = group
        self.data_parallel_group = data_parallel_group
        self.num_stages = dist.get_world_size(group)
        self.stage_index = dist.get_rank(group)
        self.stage_ranks = [self._global_rank(i) for i in range(self.num_stages)]
        if len(balance) != self.num_stages:
            raise ValueError(
                f"len(balance)={len(balance)} does not match the pipeline group's size "
                f"{self.num_stages}; launch one process per partition (torchrun "
                f"--nproc-per-node {len(balance)}) or change balance"
            )
        # A parameter tied across the first and last stage is allowed; any other sharing isn't.
        partitions = split_module(module, balance) if tied is None else _split_tied(module, balance)
        self.balance = list(balance)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.schedule_name = schedule
        self.loss_reduction = loss_reduction
        self.timeout_s = timeout_s
        self.seed = torch.initial_seed() if seed is None else int(seed)
        self.device = torch.device(device) if device is not None else _default_device()
        first_layer_index = sum(self.balance[: self.stage_index])
        local = partitions[self.stage_index]
        meta = any(is_meta(layer) for _, layer in local)
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
        # A plain attribute would register the tied weight a second time under "_tied".
        self._tied_holder = [self._resolve_tie(tied)]
        self.stage = Stage(
            list(self._modules.items()),  # type: ignore[arg-type]
            stage_index=self.stage_index,
            num_stages=self.num_stages,
            first_layer_index=first_layer_index,
            device=self.device,
            checkpoint=checkpoint,
            seed=self.seed,
            loss_fn=loss_fn if self.stage_index == self.num_stages - 1 else None,
            restore_rng=False,  # _run_step forks the random state once per step
        )
        self.transport = DistributedTransport(
            self.stage_index, self.stage_ranks, self.device, group=None, timeout_s=timeout_s
        )
        if self.is_last:
            self.transport.loss_source = lambda: float(self._step_loss())
        self.runtime = StageRuntime(self.stage, self.transport, record=record)
        self._step = 0
        self._evaluations = 0
        self._sync_tied_weight()

    # -- structure -------------------------------------------------------------------------

    @property
    def _tied(self) -> nn.Parameter | None:
        return self._tied_holder[0]

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    @property
    def steps_done(self) -> int:
        """Steps run so far; part of every layer's random seed, so restore it when resuming."""
        return self._step

    @steps_done.setter
    def steps_done(self, value: int) -> None:
        self._step = int(value)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    def schedule(self, num_microbatches: int) -> Schedule:
        name = self.schedule_name
        if callable(name):
            return get_schedule(name(self.num_stages, num_microbatches), self.num_stages,
                                num_microbatches)
        return get_schedule(name, self.num_stages, num_microbatches)

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
        except PeerError as exc:
            raise self._failure(exc) from exc
        except BaseException as exc:
            self._report_failure(exc)
            raise

    def _run_step(self, inputs: Any, targets: Any, normalizer: float | None, train: bool,
                  keep_outputs: bool) -> tuple[Tensor, Any]:
        # Training and evaluation count separately; the step number seeds the random streams.
        if train:
            step = self._step
            self._step += 1
        else:
            step = -1 - self._evaluations
            self._evaluations += 1
        state = StepState(step, 0, keep_outputs=keep_outputs and self.is_last)
        if self.is_first:
            if inputs is None:
                raise ValueError("the first stage needs inputs: pipe.step(inputs, targets)")
            state.inputs = [_to_device(mb, self.device) for mb in scatter(inputs, self.chunks)]
            num_microbatches = len(state.inputs)
        else:
            num_microbatches = self.transport.recv_step(step)
        self.transport.begin_step(step, num_microbatches, backward=train)
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
        state.num_microbatches = num_microbatches
        if normalizer is not None:
            self.stage.loss_scale = 1.0 / float(normalizer)
        elif self.loss_reduction == "mean":
            self.stage.loss_scale = 1.0 / num_microbatches
        else:
            self.stage.loss_scale = None
        self.stage.begin_step(step, num_microbatches)
        actions = self.schedule(num_microbatches).actions[self.stage_index]
        if not train:
            actions = tuple(a for a in actions if a.kind == "F")
        with fork_rng([self.device]):  # layers draw from their own seeded streams
            self.runtime.run(actions, state)
        self.transport.finish()
        outputs = None
        if self.is_last:
            loss = self._step_loss()
            if keep_outputs:
                outputs = gather([state.outputs[mb] for mb in range(num_microbatches)])
        elif train:  # the step's last gradient message brought the loss
            loss = torch.tensor(self.transport.received_loss, dtype=torch.float64,
                                device=self.device)
        else:
            loss = torch.zeros((), device=self.device, dtype=torch.float64)
        self.stage.discard(step)
        try:
            if not train:
                dist.broadcast(loss, src=self.stage_ranks[-1], group=self.group)
            if train:
                self._reduce_tied_gradient()
                if self.data_parallel_group is not None:
                    self._average_data_parallel_gradients()
        except RuntimeError as exc:  # a peer died between our last message and the collective
            raise PeerError(-1, -1, f"collective after the step failed ({exc})") from exc
        return loss, outputs

    def _step_loss(self) -> Tensor:
        """The last stage's loss of the current step: its micro-batch losses summed in float64.

        Also what the step's last gradient message carries back to the other stages.
        """
        step, num_microbatches = self.transport.step, self.transport.num_microbatches
        loss = torch.zeros((), device=self.device, dtype=torch.float64)
        for mb in range(num_microbatches):
            loss += self.stage.losses[(step, mb)].double()
        return loss

    # -- failure ---------------------------------------------------------------------------

    def _report_failure(self, exc: BaseException) -> None:
        report_failure(exc, where=f"rank {dist.get_rank()} (stage {self.stage_index})")

    def _failure(self, exc: PeerError) -> PipelineFailure:
        store = _default_store()
        first = _first_failure(store, 5) if store is not None else None
        where = f"rank {dist.get_rank()} (stage {self.stage_index})"
        if first:
            return PipelineFailure(f"{where} stops: the pipeline failed at {first}")
        return PipelineFailure(
            f"{where} stops: {exc} (no answer within {self.timeout_s:g} s or connection "
            "closed; that rank failed or hangs)"
        )

    # -- gradients -------------------------------------------------------------------------

    def _average_data_parallel_gradients(self) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.data_parallel_group)
        flat /= dist.get_world_size(self.data_parallel_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _resolve_tie(self, tied: tuple[str, str] | None) -> nn.Parameter | None:
        if tied is None:
            return None
        if self.num_stages == 1:
            return None
        first_name, last_name = tied
        name = first_name if self.is_first else last_name if self.is_last else None
        if name is None:
            return None
        params = dict(self.named_parameters())
        if name not in params:
            raise ValueError(f"tied parameter {name!r} is not on stage {self.stage_index}")
        return params[name]

    def _sync_tied_weight(self) -> None:
        """Start from the first stage's copy of a tied weight."""
        if self._tied is None:
            return
        with torch.no_grad():
            if self.is_first:
                self.transport.send_tensor(self._tied.data, self.num_stages - 1)
                self.transport.finish()
            else:
                self.transport.recv_tensor(self._tied.data, 0)

    def _reduce_tied_gradient(self) -> None:
        """Sum the gradients of the tied weight's two copies; both copies get the sum."""
        if self._tied is None:
            return
        param = self._tied
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        other = torch.empty_like(grad)
        peer = self.num_stages - 1 if self.is_first else 0
        if self.is_first:
            self.transport.send_tensor(grad, peer)
            self.transport.recv_tensor(other, peer)
        else:
            self.transport.recv_tensor(other, peer)
            self.transport.send_tensor(grad, peer)
        self.transport.finish()
        param.grad = grad + other

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip gradients by one norm over all stages' parameters; return that total norm."""
        params = [p for p in self.parameters() if p.grad is not None]
        if norm_type == float("inf"):
            local = max((p.grad.abs().max() for p in params), default=torch.zeros(()))  # type: ignore[union-attr]
            total = local.to(self.device, torch.float64)
            with collectives("clip_grad_norm_"):
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.group)
        else:
            local = torch.zeros((), dtype=torch.float64, device=self.device)
            for p in params:
                if self._tied is not None and p is self._tied and not self.is_first:
                    continue  # count the tied weight once
                local += p.grad.detach().double().norm(norm_type) ** norm_type  # type: ignore[union-attr]
            with collectives("clip_grad_norm_"):
                dist.all_reduce(local, group=self.group)
            total = local ** (1.0 / norm_type)
        coef = max_norm / (float(total) + 1e-6)
        if coef < 1.0:
            for p in params:
                p.grad.detach().mul_(coef)  # type: ignore[union-attr]
        return total

    # -- timeline --------------------------------------------------------------------------

    @property
    def timeline(self) -> list[TimelineEvent]:
        return self.runtime.timeline

    def trace(self, json_path: str | Path, png_path: str | Path | None = None) -> None:
        """Gather every stage's timeline on the first rank; write Chrome-trace JSON and a PNG.

        Collective: every rank of the pipeline group must call it.
        """
        from .trace import write_chrome_trace, write_timeline_png

        events: list[Any] = [None] * self.num_stages
        local = [(e.stage, e.action, e.start, e.end) for e in self.runtime.timeline]
        with collectives("trace"):
            dist.all_gather_object(events, (dist.get_rank(), local), group=self.group)
        if self.is_first:
            merged = [TimelineEvent(*e) for _, stage_events in events for e in stage_events]
            write_chrome_trace(merged, json_path)
            if png_path is not None:
                write_timeline_png(merged, png_path, num_stages=self.num_stages)

    # -- checkpoints -----------------------------------------------------------------------

    def save_checkpoint(self, directory: str | Path, *, files: dict[str, Any] | None = None) -> None:
        """Write this stage's shard; keys are the original module's names (see load_checkpoint).

        Collective over the world. Only the first data-parallel replica writes shards; every
        rank also writes its own ``files`` (name -> bytes, text, or an object for torch.save).
        Each file is written atomically; then global rank 0 writes ``index.json`` with every
        file's size and SHA-256, and all ranks wait until it exists. A checkpoint folder with an
        ``index.json`` is therefore complete, and loading verifies each file against it.
        """
        directory = Path(directory)
        replica = dist.get_rank(self.data_parallel_group) if self.data_parallel_group else 0
        entries: dict[str, FileEntry] = {}
        if replica == 0:
            entries.update(save_checkpoint(self.state_dict(), directory, shard=self.stage_index,
                                           num_shards=self.num_stages, index=False))
        for name, content in (files or {}).items():
            entries[name] = write_atomic(directory / name, content)
        gathered: list[Any] = [None] * dist.get_world_size()
        with collectives(f"save_checkpoint({directory.name})"):
            dist.all_gather_object(gathered, entries)
            if dist.get_rank() == 0:
                merged: dict[str, FileEntry] = {}
                for part in gathered:
                    merged.update(part)
                write_index(directory, self.num_stages, merged)
            dist.barrier()

    def load_checkpoint(self, directory: str | Path) -> None:
        """Load this stage's parameters from a checkpoint written with any number of stages."""
        wanted = set(self.state_dict())
        state = load_checkpoint(directory, keys=wanted)
        self.load_state_dict(state)
        self._sync_tied_weight()


def _split_tied(module: nn.Sequential, balance: Sequence[int]) -> list[list[tuple[str, nn.Module]]]:
    """Like split_module but tolerates sharing between the first and last partition only."""
    named = list(module._modules.items())
    partitions, start = [], 0
    for size in balance:
        partitions.append(named[start : start + size])
        start += size
    return partitions  # type: ignore[return-value]


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_device(batch: Any, device: torch.device) -> Any:
    from .microbatch import map_tensors

    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def shard_name(shard: int, num_shards: int) -> str:
    """File name of one shard of a checkpoint."""
    return f"shard-{shard:03d}-of-{num_shards:03d}.pt"


def save_checkpoint(
    state_dict: dict[str, Tensor],
    directory: str | Path,
    *,
    shard: int = 0,
    num_shards: int = 1,
    index: bool = True,
) -> dict[str, FileEntry]:
    """Write one shard of a checkpoint: ``shard-{i}-of-{n}.pt`` holding original-name keys.

    The file is written atomically. With ``index`` (and a single shard) ``index.json`` records
    its size and SHA-256; with several shards the caller gathers the returned entries
    (``{name: {"bytes", "sha256"}}``) and writes the index (``DistributedGPipe.save_checkpoint``
    does). Shard 0 of several writes an index listing itself only, which loads unverified
    for the other shards.
    """
    directory = Path(directory)
    name = shard_name(shard, num_shards)
    entry = write_atomic(directory / name, {k: v.detach().cpu() for k, v in state_dict.items()})
    if index and shard == 0:
        write_index(directory, num_shards, {name: entry})
    return {name: entry}


def load_checkpoint(directory: str | Path, *, keys: set[str] | None = None) -> dict[str, Tensor]:
    """Merge the shards of a checkpoint into one state dict (optionally only ``keys``).

    The result loads into the plain module, into ``GPipe`` and, key by key, into a
    ``DistributedGPipe`` with any number of stages. Each shard is checked against the size and
    SHA-256 in ``index.json`` first: a damaged one raises CheckpointCorruptError naming it.
    """
    directory = Path(directory)
    num_shards = int(read_index(directory)["num_shards"])
    merged: dict[str, Tensor] = {}
    for shard in range(num_shards):
        path = directory / shard_name(shard, num_shards)
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint shard {path} is missing")
        verify_checkpoint(directory, [path.name])
        part = torch_load(path, weights_only=True)
        merged.update({k: v for k, v in part.items() if keys is None or k in keys})
    if keys is not None and set(keys) - set(merged):
        raise KeyError(f"checkpoint {directory} lacks {sorted(set(keys) - set(merged))[:5]}")
    return merged
