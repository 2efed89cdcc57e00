"""Typed configuration: dataclass defaults < YAML file < dotted KEY=VALUE overrides (loading.py).

Each section is a frozen dataclass declared beside its rules (`check`: its values alone; methods such
as `check_under`: its values with the run's facts, given as arguments): data.py (data, mix),
training.py (model, train, ema, optim, sched), parallel.py (ddp, fsdp, checkpoint, net),
observing.py (debug, log); top.py holds the whole `Config`, its top-level options and the rules
between sections, rules.py the shapes of a rule (a choice, a range, a local path). Every name is
imported from here.
"""

from multicard.base.config.data import (
    DATASETS,
    DECODERS,
    LOADERS,
    MAX_IMAGE_SIZE,
    MAX_POLICY_MAGNITUDE,
    MAX_POLICY_OPS,
    MIN_IMAGE_SIZE,
    MIX_MODES,
    POLICIES,
    READS_ROOT,
    SMALL_IMAGE_MAX,
    DataConfig,
    MixConfig,
    check_decode,
)
from multicard.base.config.loading import config_from_dict, load_config, to_dict, to_yaml, with_overrides
from multicard.base.config.observing import DebugConfig, LogConfig, stall_seconds
from multicard.base.config.parallel import (
    CHECKPOINT_FORMATS,
    COMM_HOOKS,
    REPLICATE,
    CheckpointConfig,
    DDPConfig,
    FSDPConfig,
    NetConfig,
)
from multicard.base.config.rules import check_local_path
from multicard.base.config.top import COMPILE_MODES, MAX_THREADS, PRECISIONS, STRATEGIES, Config, parse_devices
from multicard.base.config.training import (
    LR_SCALING,
    OPTIMIZERS,
    SCHEDULES,
    EMAConfig,
    ModelConfig,
    OptimConfig,
    SchedConfig,
    TrainConfig,
    check_world_sizes,
    micro_batch,
)

__all__ = [
    "CHECKPOINT_FORMATS", "COMM_HOOKS", "COMPILE_MODES", "DATASETS", "DECODERS", "LOADERS", "LR_SCALING",
    "MAX_IMAGE_SIZE", "MAX_POLICY_MAGNITUDE", "MAX_POLICY_OPS", "MAX_THREADS", "MIN_IMAGE_SIZE", "MIX_MODES",
    "OPTIMIZERS", "POLICIES", "PRECISIONS", "READS_ROOT", "REPLICATE", "SCHEDULES", "SMALL_IMAGE_MAX", "STRATEGIES",
    "CheckpointConfig", "Config", "DDPConfig", "DataConfig", "DebugConfig", "EMAConfig", "FSDPConfig", "LogConfig",
    "MixConfig", "ModelConfig", "NetConfig", "OptimConfig", "SchedConfig", "TrainConfig", "check_decode",
    "check_local_path", "check_world_sizes", "config_from_dict", "load_config", "micro_batch", "parse_devices",
    "stall_seconds", "to_dict", "to_yaml",
    "with_overrides",
]  # fmt: skip
