"""The configuration schema: nested frozen dataclasses, one per YAML section.

Every field carries its documentation in ``metadata["doc"]`` and, where it has one, its allowed
range (``ge``, ``gt``, ``le``, ``lt``, ``finite``); closed choices are ``Literal``. The validator,
``safetrain check-config`` and the site's configuration reference (docs/configuration.md, generated
at build time) are all read off these fields. Defaults
for the recovery policy come from :mod:`safetrain.kinds`. No torch, no I/O beyond YAML text.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Literal, Mapping, Optional, Union

import yaml

from ..kinds import DEFAULT_ESCALATE, DEFAULT_FIRST

__all__ = [
    "TrainConfig",
    "DetectConfig",
    "ReplayConfig",
    "SanitizeConfig",
    "SpikeConfig",
    "DivergenceConfig",
    "GuardConfig",
    "ClipConfig",
    "AmpConfig",
    "RecoveryConfig",
    "SnapshotConfig",
    "LogConfig",
    "SanitizeAction",
    "REPLACED_KEYS",
    "iter_fields",
    "to_dict",
    "to_yaml",
]

#: What ``sanitize.inputs`` / ``sanitize.targets`` may say: :data:`safetrain.kinds.SANITIZE_ACTIONS`
#: (spelled out so type checkers see the choices; a test keeps the two equal).
SanitizeAction = Literal["skip_batch", "drop_rows", "replace", "raise", "off"]

#: Keys of earlier versions whose meaning changed: a config that still sets one is refused with
#: what replaced it (a ratio to a loss means nothing for a loss that may be negative or offset).
REPLACED_KEYS: Dict[str, str] = {
    "guard.end_loss_ratio": (
        "replaced by guard.end_margin: the end of a run is judged in its own noise (robust standard "
        "deviations of its losses), not as a ratio to its first loss, which may be negative or near zero; "
        "guard.end_margin: null turns the check off"
    ),
}


def _f(default: Any = dataclasses.MISSING, doc: str = "", factory: Any = None, **rules: Any) -> Any:
    """A dataclass field with its documentation and validation rules in metadata."""
    meta = {"doc": doc, **rules}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ReplayConfig:
    """Diagnosis by replay of a step that tripped: budget and limits."""

    enabled: bool = _f(
        True, "replay a tripped step with full hooks and anomaly mode to name the layer, op and bad rows"
    )
    max_per_run: int = _f(20, "at most this many replays in one run; later trips are journaled without a replay", ge=0)
    time_limit_s: float = _f(60.0, "give up a replay (and its bisection) after this many seconds", gt=0)
    keep_steps: int = _f(
        16,
        "keep the batches and LRs of up to this many updates after a snapshot, to replay a weights fault "
        "to the update that broke it (0: off; those batches stay in memory)",
        ge=0,
    )
    keep_mb: float = _f(
        256.0,
        "...and stop keeping them (no weight replay until the next snapshot) once their batches "
        "hold more than this many MiB, wherever they live (host or device memory)",
        ge=0,
    )


@dataclass(frozen=True)
class DetectConfig:
    """What the detectors watch and how much they cost on a healthy step."""

    mode: Literal["eager", "lazy", "off"] = _f(
        "eager",
        "eager: activation hooks (see granularity and skip_passthrough); lazy: loss, gradient and weight "
        "checks only; off: no checks",
    )
    include: List[str] = _f(
        doc="module-name globs to monitor in eager mode ('' is the root model)", factory=lambda: ["*"]
    )
    exclude: List[str] = _f(doc="module-name globs never monitored (wins over include)", factory=list)
    nan_only: List[str] = _f(
        doc="module-name globs whose outputs may hold +-inf legitimately (attention masks): only NaN trips there",
        factory=list,
    )
    skip_passthrough: bool = _f(
        True,
        "leave ReLU-like activations, dropout, pooling and reshapes unhooked (finite in, finite out: "
        "never where a NaN starts); about halves the eager hook cost of MLPs and CNNs",
    )
    granularity: Literal["block", "module"] = _f(
        "block",
        "eager mode: block hooks each repeated block (children of one class in a ModuleList/Sequential: "
        "transformer layers) instead of the modules inside it, and a trip is named at the layer inside by an "
        "exact re-run; module hooks every module (the finest, and the dearest on models of many small modules)",
    )
    check_weights_every: int = _f(
        100,
        "check every parameter for NaN/Inf every N optimizer steps (0: never; a "
        "forward, loss or gradient trip checks them anyway)",
        ge=0,
    )
    replay: ReplayConfig = _f(doc="diagnosis by replay of a tripped step", factory=ReplayConfig)


@dataclass(frozen=True)
class SanitizeConfig:
    """What to do with non-finite values in the batch before the forward pass."""

    inputs: SanitizeAction = _f(
        "drop_rows", "non-finite input rows: skip_batch | drop_rows (with their targets) | replace | raise | off"
    )
    targets: SanitizeAction = _f("skip_batch", "non-finite target rows: skip_batch | drop_rows | replace | raise | off")
    nan: float = _f(0.0, "value that replaces NaN under 'replace'", finite=True)
    posinf: float = _f(
        0.0, "value that replaces +inf under 'replace' (not the dtype's max, which overflows again)", finite=True
    )
    neginf: float = _f(0.0, "value that replaces -inf under 'replace'", finite=True)


@dataclass(frozen=True)
class SpikeConfig:
    """Loss-spike detection on robust statistics of recent healthy losses (invariant to the loss's offset and scale)."""

    enabled: bool = _f(True, "catch loss blow-ups that are still finite")
    window: int = _f(128, "number of recent healthy losses the median and MAD are taken over", ge=2)
    min_history: int = _f(20, "no spike is called before this many healthy losses are in the window", ge=2)
    zscore: float = _f(6.0, "a loss more than this many robust standard deviations above the median is a spike", gt=0)
    min_ratio: float = _f(
        2.0,
        "...and above the window's lowest loss by this many times the largest excess of a window loss over the "
        "lowest when it came (keeps converged runs quiet)",
        ge=1,
    )
    hard_ratio: Optional[float] = _f(
        100.0,
        "a loss at least this many times the run's range (highest minus lowest healthy loss) above the run's lowest "
        "is a spike from the 4th healthy step on, before min_history, and its square from the 3rd (null: off)",
        gt=1,
        finite=True,
    )


@dataclass(frozen=True)
class DivergenceConfig:
    """Divergence: a finite loss growing geometrically over consecutive steps, judged from the first step
    (invariant to the loss's offset and scale: increments and rises measured in the run's own spread)."""

    enabled: bool = _f(True, "catch a loss that keeps growing geometrically (an LR too high), with no warm-up")
    growth: float = _f(
        2.0, "a step whose increment is at least this many times the one before counts toward steps", gt=1, finite=True
    )
    steps: int = _f(3, "this many such increments in a row, to new highs of the recent losses, are divergence", ge=2)
    ratio: float = _f(
        100.0,
        "...or a climb begun before this step that rises this many scales (the spread before it, or its first "
        "increment) above where it began (or the level before the last divergence)",
        gt=1,
        finite=True,
    )


@dataclass(frozen=True)
class ClipConfig:
    """Gradient-norm clipping: a fixed norm, or adaptive (ZClip: z-score of the norm against its EMA statistics)."""

    mode: Literal["fixed", "adaptive"] = _f(
        "fixed",
        "fixed: clip to guard.clip_grad_norm (if set); adaptive: clip a norm more than zscore EMA standard "
        "deviations above its EMA mean to mean + zscore^2 * std / z (ZClip); guard.clip_grad_norm, if set, stays a "
        "ceiling (the only clip in the warm-up)",
    )
    zscore: float = _f(2.5, "adaptive: a norm more than this many standard deviations above the mean is clipped", gt=0)
    alpha: float = _f(0.97, "adaptive: smoothing factor of the EMA mean and variance of the total norm", gt=0, lt=1)
    warmup_steps: int = _f(
        25, "adaptive: trained steps whose norms start the statistics (no adaptive clip or anomaly before)", ge=1
    )
    anomaly_zscore: float = _f(
        12.0,
        "guard.grad_norm_threshold: adaptive: a norm this many standard deviations (at least a quarter of the "
        "mean each) above the EMA mean is a grad_norm anomaly",
        gt=0,
        finite=True,
    )


@dataclass(frozen=True)
class GuardConfig:
    """The per-step guard: clipping, gradient-norm threshold, spikes, accumulation, schedulers."""

    clip_grad_norm: Optional[float] = _f(None, "clip the total gradient norm to this value (null: no clipping)", gt=0)
    clip: ClipConfig = _f(doc="fixed or adaptive (ZClip) gradient-norm clipping", factory=ClipConfig)
    grad_norm_threshold: Optional[Union[float, Literal["adaptive"]]] = _f(
        None,
        "a total gradient norm above this is a grad_norm anomaly; parameters above it are named; adaptive: above "
        "guard.clip.anomaly_zscore standard deviations of its EMA statistics (null: off)",
        gt=0,
    )
    end_margin: Optional[float] = _f(
        4.0,
        "a run whose last trained losses (lower quartile of 16) end more than this many robust standard deviations "
        "of its losses above its first (median of 5) aborts instead of finishing worse than it started (null: off)",
        gt=0,
        finite=True,
    )
    spike: SpikeConfig = _f(doc="loss-spike detection", factory=SpikeConfig)
    divergence: DivergenceConfig = _f(doc="divergence detection (scale_lr first)", factory=DivergenceConfig)
    accumulate_steps: int = _f(1, "micro-batches whose gradients are summed before one optimizer step", ge=1)
    to_device: bool = _f(
        True,
        "copy each batch's CPU tensors to the model's accelerator before the forward, non_blocking on CUDA "
        "(pin the loader's memory); false: the model or step_fn places them",
    )
    scheduler_follows: Literal["optimizer", "batch"] = _f(
        "optimizer", "optimizer: the LR scheduler steps only when the optimizer did; batch: on every batch seen"
    )
    scheduler_interval: Literal["step", "epoch"] = _f(
        "step",
        "step the LR scheduler after every optimizer step, or once per epoch (ReduceLROnPlateau gets the mean loss)",
    )


@dataclass(frozen=True)
class AmpConfig:
    """Mixed precision: autocast dtype and the fp16 GradScaler's limits."""

    dtype: Optional[Literal["float16", "bfloat16"]] = _f(
        None, "autocast dtype: null (full precision) | float16 (with GradScaler) | bfloat16 (no scaler)"
    )
    init_scale: float = _f(2.0**16, "GradScaler's initial loss scale (float16 only)", gt=0, finite=True)
    min_scale: float = _f(1.0, "a loss scale below this is a scaler anomaly, not a normal overflow", gt=0, finite=True)
    max_overflows: int = _f(10, "this many scaler overflows in a row are a scaler anomaly", ge=1)


@dataclass(frozen=True)
class RecoveryConfig:
    """The recovery policy: first action per anomaly kind, the escalation ladder and its limits."""

    actions: Dict[str, str] = _f(
        doc="anomaly kind -> first action (input and target take theirs from sanitize.*)",
        factory=lambda: {kind.value: action.value for kind, action in DEFAULT_FIRST.items()},
    )
    escalate: List[str] = _f(
        doc="actions taken by the 2nd, 3rd... consecutive anomalous step (the last repeats until max_retries)",
        factory=lambda: [action.value for action in DEFAULT_ESCALATE],
    )
    max_retries: int = _f(5, "abort after this many consecutive anomalous steps", ge=0)
    reset_after: int = _f(20, "this many healthy steps in a row put the ladder back at its first rung", ge=1)
    lr_factor: float = _f(0.5, "scale_lr multiplies the learning rate by this", gt=0, lt=1)
    min_lr: float = _f(0.0, "scale_lr never takes a learning rate below this", ge=0, finite=True)
    lr_restore_after: Optional[int] = _f(
        None, "after this many healthy steps the LR scale climbs back one notch (null: never)", ge=1
    )
    max_skip_fraction: float = _f(
        0.5, "abort if more than this fraction of the last skip_window steps were not trained", gt=0, le=1
    )
    skip_window: int = _f(100, "number of recent steps max_skip_fraction is measured over", ge=1)
    skip_batches_after_restore: int = _f(
        0, "after a restore, skip this many batches (PaLM: roll back and skip the data that led in)", ge=0
    )
    cause_test: bool = _f(
        True,
        "before a spike escalates, test its cause on the batch with the snapshots' models: a damaged model "
        "restores the snapshot that does well, data that changed trains on (false: the ladder alone)",
    )


@dataclass(frozen=True)
class SnapshotConfig:
    """Snapshots of the whole training state for restore and resume."""

    store: Literal["memory", "safetensors"] = _f(
        "memory", "memory (fast, lost with the process) | safetensors (on disk)"
    )
    every: Union[int, Literal["auto"]] = _f(
        "auto",
        "take a snapshot after this many healthy optimizer steps; auto: the fewest whose training time pays for "
        "one within snapshot.overhead (measured: ceil(snapshot time / (overhead x step time)), within "
        "min_every..max_every)",
        ge=1,
    )
    overhead: float = _f(0.01, "every: auto: the share of training time snapshots may take", gt=0, lt=1)
    min_every: int = _f(5, "every: auto: the fewest healthy steps between two snapshots", ge=1)
    max_every: int = _f(1000, "every: auto: the most healthy steps between two snapshots", ge=1)
    dir: Optional[str] = _f(None, "directory of safetensors snapshots (null: <log.dir>/snapshots)")
    keep: int = _f(
        2,
        "number of snapshots kept; older ones are deleted (the memory store holds keep full copies of the state)",
        ge=1,
    )
    device: Literal["cpu", "model"] = _f("cpu", "where the memory store keeps its copy: cpu (pinned on CUDA) | model")
    on_signal: bool = _f(
        True, "on a caught SIGTERM/SIGINT, snapshot the step fit stopped at (safetensors store only), for resume"
    )
    overwrite: bool = _f(
        False,
        "let a fresh run (no resume=) start in a snapshot dir holding another run's snapshots, deleting them first",
    )
    async_save: bool = _f(
        False,
        "FSDP2 sharded snapshots: save in the background once the state is staged (DCP async_save); "
        "awaited before the next save, any restore and close",
    )


@dataclass(frozen=True)
class LogConfig:
    """Journal, logging and progress bar, and how ``fit`` meets a stop signal (preemption)."""

    dir: Optional[str] = _f(None, "run directory for events.jsonl and reports (null: journal in memory only)")
    progress: bool = _f(True, "show a tqdm progress bar in a terminal or a Jupyter notebook (never in piped output)")
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = _f(
        "INFO", "level of the 'safetrain' logger under the CLI (a library run leaves levels to the application)"
    )
    tensorboard: bool = _f(
        False, "write loss, LR, grad norm, counters and events to <log.dir>/tensorboard (pip install tensorboard)"
    )
    signals: Literal["term", "term+int", "off"] = _f(
        "term+int",
        "signals fit catches to stop cleanly after the current step: SIGTERM, SIGTERM and SIGINT (Ctrl-C), or none",
    )
    on_signal: Literal["raise", "return"] = _f(
        "raise", "after a caught signal fit raises TrainingInterrupted, or returns the FitResult (ended: interrupted)"
    )


@dataclass(frozen=True)
class TrainConfig:
    """The whole safetrain configuration; load it with :func:`load_config`."""

    detect: DetectConfig = _f(doc="detectors", factory=DetectConfig)
    sanitize: SanitizeConfig = _f(doc="batch sanitizer", factory=SanitizeConfig)
    guard: GuardConfig = _f(doc="per-step guard", factory=GuardConfig)
    amp: AmpConfig = _f(doc="mixed precision", factory=AmpConfig)
    recovery: RecoveryConfig = _f(doc="recovery policy", factory=RecoveryConfig)
    snapshot: SnapshotConfig = _f(doc="snapshots", factory=SnapshotConfig)
    log: LogConfig = _f(doc="journal and progress", factory=LogConfig)


def iter_fields(cfg: Any, prefix: str = "") -> Iterable[tuple]:
    """Yield ``(dotted_key, dataclasses.Field, value)`` for every field of a config, depth first."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        dotted = f"{prefix}{f.name}"
        yield dotted, f, value
        if dataclasses.is_dataclass(value):
            yield from iter_fields(value, dotted + ".")


def to_dict(cfg: TrainConfig) -> dict:
    """A plain, JSON-ready nested dict of a config (tuples as lists, mappings as dicts)."""
    out: dict = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, Mapping):
            value = dict(value)
        out[f.name] = value
    return out


def to_yaml(cfg: TrainConfig) -> str:
    """The resolved configuration as YAML, in schema order."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def without_replays(cfg: TrainConfig, why: str) -> TrainConfig:
    """The config with ``detect.replay.enabled`` false; ``why`` goes to the log (once) when they were on."""
    if not cfg.detect.replay.enabled:
        return cfg
    logging.getLogger(__name__).info("%s", why)
    detect = dataclasses.replace(cfg.detect, replay=dataclasses.replace(cfg.detect.replay, enabled=False))
    return dataclasses.replace(cfg, detect=detect)
