"""GPipe pipeline parallelism for PyTorch: micro-batches, re-materialization, schedules as data."""

from .batchnorm import DeferredBatchNorm
from .channel import Channel
from .costs import LayerCosts, layer_costs
from .cpu import bind_cpus, hold_freed_memory
from .devices import DEVICES, OPTIMIZER_BYTES, Device, get_device
from .distributed import DistributedGPipe
from .events import TimelineEvent
from .failure import PipelineFailure, collectives, report_failure
from .groups import group_timeout_s, init_process_groups
from .layout import PipelineLayout, read_layout
from .materialization import materialize
from .partition import Balance, balance_by_memory, balance_by_params, balance_by_time
from .pipe import GPipe
from .planner import NoPlanFits, Plan, plan, plan_largest
from .precision import PRECISIONS, LossScaler
from .profile import profile_stages, profile_timeline
from .remat import Remat
from .schedule import (
    Action,
    Schedule,
    ScheduleError,
    dualpipe_v,
    fill_drain,
    get_schedule,
    interleaved_1f1b,
    interleaved_zb,
    one_f_one_b,
    zb_h1,
    zb_h2,
    zb_v,
)
from .schedule import gpipe as gpipe  # deprecated (it warns): fill_drain; not in __all__
from .sequentializer import SequentializeError, Shared, sequentialize
from .shards import load_shards, save_shards
from .simulator import Simulation, simulate
from .stage_profile import StageProfile
from .storage import CheckpointCorruptError, verify_checkpoint, write_atomic
from .tune import TunedPlan, shortlist, tune

__all__ = [
    "GPipe",
    "Remat",
    "DistributedGPipe",
    "LossScaler",
    "PRECISIONS",
    "PipelineLayout",
    "read_layout",
    "Channel",
    "PipelineFailure",
    "group_timeout_s",
    "init_process_groups",
    "collectives",
    "report_failure",
    "bind_cpus",
    "hold_freed_memory",
    "load_shards",
    "save_shards",
    "verify_checkpoint",
    "write_atomic",
    "CheckpointCorruptError",
    "materialize",
    "simulate",
    "Simulation",
    "profile_stages",
    "profile_timeline",
    "StageProfile",
    "plan",
    "plan_largest",
    "Plan",
    "NoPlanFits",
    "tune",
    "shortlist",
    "TunedPlan",
    "layer_costs",
    "LayerCosts",
    "Device",
    "DEVICES",
    "OPTIMIZER_BYTES",
    "get_device",
    "DeferredBatchNorm",
    "Balance",
    "balance_by_params",
    "balance_by_time",
    "balance_by_memory",
    "Action",
    "Schedule",
    "get_schedule",
    "TimelineEvent",
    "ScheduleError",
    "fill_drain",
    "one_f_one_b",
    "zb_h1",
    "zb_h2",
    "interleaved_1f1b",
    "interleaved_zb",
    "zb_v",
    "dualpipe_v",
    "sequentialize",
    "Shared",
    "SequentializeError",
]
__version__ = "0.1.0"
