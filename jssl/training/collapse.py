"""Collapse statistics of a training run, and the alarm that acts on them (``config.monitor``).

A self-supervised run can collapse while its loss looks fine: every image mapped to one vector,
to a low-dimensional subspace, or, for methods that output distributions, to a uniform or a
one-hot output. The train step computes on the global batch, at log steps only
(:func:`step_statistics` under ``lax.cond``, so other steps pay nothing), for the head output of
crop 0 (none for DINO, whose head output is out_dim wide) and the trunk features: RankMe
(Garrido et al. 2023, Eq. 1; :func:`rankme`) and the std of the L2-normalised rows (SimSiam's
monitor, Chen & He 2021 Fig. 2; :func:`normalized_std`). Both are watched: SimSiam's
projections without the stop-gradient become +-v per image, which drops RankMe to 1 and leaves
the std at half its healthy value. The methods' entropies (DINO's teacher, SwAV's assignments,
as fractions of log K) come every step. :class:`Alarm` warns, or saves and stops
(``CollapseError``), when one stays past its bound for ``monitor.patience`` log steps.
Statistics, bounds and what they read on the demos: docs/operations.md, "Collapse alarms".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from jssl.losses._util import _embedding_std

PREFIX = "collapse/"
# The sizes the step's statistics are measured against (constants; not written as scalars).
SIZE_PREFIX = "collapse_size/"
RANKME_EPS = 1e-7  # Garrido et al. 2023, Sec. 3 (float32)
# RankMe below this (fewer than two effective directions) is collapse at any size, however
# small min(batch, dim) makes monitor.min_rank_fraction's bound.
MIN_RANKME = 2.0
MODES = ("off", "warn", "stop")
# The step's statistics of each of these LossOutput fields.
OUTPUTS = ("head", "features")


class CollapseError(RuntimeError):
    """Raised by the train engine when ``monitor.on_collapse=stop`` fires (after saving)."""


def rankme(x: jax.Array, eps: float = RANKME_EPS) -> jax.Array:
    """RankMe of the rows of ``x`` (n, d): ``exp(-sum_k p_k log p_k)`` with ``p_k = s_k /
    sum(s) + eps`` over the min(n, d) singular values ``s`` (Garrido et al. 2023, Eq. 1-2)."""
    x = x.reshape(x.shape[0], -1).astype(jnp.float32)
    s = jnp.linalg.svd(x, compute_uv=False)
    p = s / jnp.maximum(jnp.sum(s), jnp.finfo(jnp.float32).tiny) + eps
    return jnp.exp(-jnp.sum(p * jnp.log(p)))


def normalized_std(x: jax.Array) -> jax.Array:
    """The mean over dimensions of the standard deviation of the L2-normalised rows of ``x``:
    about 1/sqrt(dim) when healthy, 0 when collapsed. SimSiam's ``output_std`` and BYOL's
    ``target_std`` are the same function on both views' projections."""
    return _embedding_std(x.reshape(x.shape[0], -1), None)


def step_statistics(
    on: jax.Array, outputs: Mapping[str, jax.Array | None], axis_name: str | None
) -> dict[str, jax.Array]:
    """The step's statistics of ``outputs`` (``{name: (n, ...) local rows or None}``) over the
    global batch, computed only where ``on`` (the same on every replica; zeros elsewhere),
    and the sizes they are measured against. Runs per replica, inside ``shard_map``; with
    ``axis_name`` None, ``outputs`` are the global batch's rows (gathered by the caller)."""
    present = {k: v.reshape(v.shape[0], -1) for k, v in outputs.items() if v is not None}
    replicas = 1 if axis_name is None else jax.lax.psum(1, axis_name)
    names = [f"{PREFIX}{k}_{stat}" for k in present for stat in ("rank", "std")]

    def computed():
        out = {}
        for name, x in present.items():
            x = x.astype(jnp.float32)
            if axis_name is not None:
                x = jax.lax.all_gather(x, axis_name, axis=0, tiled=True)
            out[f"{PREFIX}{name}_rank"] = rankme(x)
            out[f"{PREFIX}{name}_std"] = normalized_std(x)
        return out

    def skipped():
        return {name: jnp.zeros((), jnp.float32) for name in names}

    stats = jax.lax.cond(on, computed, skipped)
    for name, x in present.items():
        stats[f"{SIZE_PREFIX}{name}"] = jnp.asarray(x.shape[1], jnp.float32)
        stats[f"{SIZE_PREFIX}batch"] = jnp.asarray(x.shape[0] * replicas, jnp.float32)
    return stats


def log_steps(every: int, last: int) -> Callable[[jax.Array], jax.Array]:
    """The steps (counted after the step) at which the train engine writes metrics."""
    return lambda step: (step % every == 0) | (step == last)


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one statistic is judged: its value as a fraction of its healthy scale, the bound
    (a ``monitor`` field) it must stay above (or below, ``upper``), and what to say."""

    field: str
    upper: bool
    what: str
    causes: str


_LOW_SPREAD = (
    "the embeddings are collapsing to a point or a low-dimensional subspace. Usual causes: a "
    "learning rate far too high (--config.optim.base_lr, no warmup), a missing stop-gradient or "
    "predictor (SimSiam, BYOL), a momentum encoder updated too fast, or too strong weight decay"
)
_UNIFORM = (
    "the outputs are becoming uniform (DINO's uniform collapse: centring dominates "
    "sharpening). Usual causes: a teacher temperature too high (--config.method.teacher_temp, "
    "warmup_teacher_temp), a learning rate too high, or a teacher that moves too fast"
)
_ONE_HOT = (
    "every image puts its mass on the same output (one dimension dominates: sharpening without "
    "enough centring, or SwAV's prototypes collapsing). Usual causes: centring off or too slow "
    "(--config.method.center_momentum close to 1), a teacher temperature too low, a learning "
    "rate too high, or for SwAV too few Sinkhorn iterations or a too small epsilon"
)
RULES = {
    "rank": Rule("min_rank_fraction", False, "effective rank (RankMe)", _LOW_SPREAD),
    "std": Rule("min_std_fraction", False, "std of the L2-normalised rows", _LOW_SPREAD),
    "mean_entropy": Rule("min_mean_entropy_fraction", False, "entropy of the mean", _ONE_HOT),
    "entropy": Rule("max_entropy_fraction", True, "mean entropy", _UNIFORM),
}


def rule_of(name: str) -> Rule | None:
    """The rule of statistic ``collapse/<name>`` (by its ending), None for one without."""
    for ending in ("mean_entropy", "entropy", "rank", "std"):
        if name.endswith(ending):
            return RULES[ending]
    return None


def fraction(name: str, value: float, sizes: Mapping[str, float]) -> tuple[float, str]:
    """``value`` of ``collapse/<name>`` on its healthy scale, 0 collapsed and 1 healthy, and
    that scale in words: RankMe as (RankMe - 1) / (min(batch, dim) - 1) (RankMe is 1 for rows
    along one direction, min(batch, dim) at full rank), the std times sqrt(dim); entropies are
    fractions of log K already."""
    which = name.rsplit("_", 1)[0]
    if name.endswith("_rank") and which in sizes:
        top = min(sizes["batch"], sizes[which])
        share = (value - 1.0) / (top - 1.0) if top > 1 else 1.0
        return share, f"the way from 1 to min(batch {sizes['batch']:.0f}, dim {sizes[which]:.0f})"
    if name.endswith("_std") and which in sizes:
        return value * math.sqrt(sizes[which]), f"1/sqrt(dim {sizes[which]:.0f})"
    return value, "log K"


@dataclasses.dataclass
class Finding:
    """A statistic past its threshold: where it was first, and what it is now."""

    name: str
    value: float
    fraction: float
    scale: str
    threshold: float
    rule: Rule
    first_step: int
    step: int

    def describe(self, patience: int) -> str:
        side = "above" if self.rule.upper else "below"
        floor = f" (or RankMe {MIN_RANKME:g})" if self.rule is RULES["rank"] else ""
        return (
            f"{PREFIX}{self.name} = {self.value:.4g}, the {self.rule.what} of "
            f"{_subject(self.name)}, is {self.fraction:.3g} of {self.scale}: {side} "
            f"monitor.{self.rule.field}={self.threshold:g}{floor} at {patience} log step(s) in "
            f"a row, since step {self.first_step}; now step {self.step}. This usually means "
            f"{self.rule.causes}."
        )


def _subject(name: str) -> str:
    """What statistic ``collapse/<name>`` is measured on, in words."""
    subjects = {
        "head": "the head output of crop 0",
        "features": "the trunk features",
        "teacher": "the teacher's output distributions",
        "assignment": "the predicted prototype assignments",
    }
    for prefix, subject in subjects.items():
        if name.startswith(prefix):
            return subject
    return name


class Alarm:
    """The host side of the collapse monitor: which values the engine writes at a log step,
    and the patience counters of each statistic. ``on_collapse=off`` still writes them."""

    def __init__(self, monitor: ml_collections.ConfigDict | None):
        self.mode = "off" if monitor is None else monitor.on_collapse
        self.config = monitor
        self.since: dict[str, int] = {}  # statistic -> first log step of the current streak
        self.count: dict[str, int] = {}
        self.fired: set[str] = set()  # warned about, until it recovers
        self.sizes: dict[str, float] = {}  # batch and dims of the step's statistics

    @classmethod
    def of(cls, config: ml_collections.ConfigDict) -> Alarm:
        return cls(config.get("monitor"))

    def scalars(self, mean: dict[str, float], last: Mapping[str, Any]) -> dict[str, float]:
        """The window's ``mean`` metrics to write, with the step's statistics taken from the
        log step's own metrics ``last`` (they are 0 on the steps between). The sizes they are
        measured against are kept for :meth:`check`, not written."""
        names = [f"{PREFIX}{w}_{s}" for w in OUTPUTS for s in ("rank", "std")]
        names += [k for k in last if k.startswith(SIZE_PREFIX)]
        own = {
            k: float(v) for k, v in jax.device_get({k: last[k] for k in names if k in last}).items()
        }
        self.sizes = {
            k.removeprefix(SIZE_PREFIX): v for k, v in own.items() if k.startswith(SIZE_PREFIX)
        }
        out = {k: v for k, v in mean.items() if k not in own}
        out.update({k: v for k, v in own.items() if not k.startswith(SIZE_PREFIX)})
        return out

    def check(self, step: int, scalars: dict[str, float], writer=None) -> Finding | None:
        """Updates the counters with a log step's ``scalars`` (what :meth:`scalars` gave: it
        also sets the sizes); warns about each statistic that has just run out of patience and
        returns the first one that must stop the run (``stop``), else None."""
        if self.mode == "off":
            return None
        patience = int(self.config.patience)
        stop = None
        for key, value in scalars.items():
            name = key.removeprefix(PREFIX)
            rule = rule_of(name) if key.startswith(PREFIX) else None
            if rule is None or not np.isfinite(value):
                continue
            share, scale = fraction(name, value, self.sizes)
            threshold = float(self.config[rule.field])
            past = share > threshold if rule.upper else share < threshold
            if not (past or (rule is RULES["rank"] and value < MIN_RANKME)):
                self.count[name] = 0
                self.fired.discard(name)  # recovered: it may fire again
                continue
            self.count[name] = self.count.get(name, 0) + 1
            if self.count[name] == 1:
                self.since[name] = step
            if self.count[name] < patience or name in self.fired:
                continue
            self.fired.add(name)
            finding = Finding(name, value, share, scale, threshold, rule, self.since[name], step)
            message = f"Collapse alarm: {finding.describe(patience)}"
            if writer is not None:
                writer.write_texts(step, {"collapse_alarm": message})
            if self.mode == "warn":
                logging.warning("%s Training goes on (monitor.on_collapse=warn).", message)
            stop = stop or finding
        return stop if self.mode == "stop" else None

    def stop_message(self, finding: Finding, saved: str, before: str) -> str:
        """The message of the CollapseError that ``stop`` ends the run with: the finding,
        the checkpoint just saved (``saved``) and the newest one from before the statistic
        first crossed its threshold (``before``: "" when there is none)."""
        patience = int(self.config.patience)
        restart = (
            f"To train again from before the collapse, start a new --workdir from {before} "
            "(--config.init.checkpoint=<it>: its weights, the schedule from the start)"
            if before
            else "To train again from before the collapse, start a new --workdir"
        )
        return (
            f"Collapse alarm (monitor.on_collapse=stop): {finding.describe(patience)} Training "
            f"stopped after saving step {finding.step} in {saved} (nothing is lost). {restart} "
            "with the change, e.g. a lower --config.optim.base_lr. If the run is healthy, rerun "
            "the same command with --config.monitor.on_collapse=warn to go on, or adjust "
            f"--config.monitor.{finding.rule.field} / --config.monitor.patience."
        )


def check_config(config: ml_collections.ConfigDict) -> None:
    """Start-up checks of ``config.monitor``: each failure names the field and the fix."""
    monitor = config.get("monitor")
    if monitor is None:
        return
    if monitor.on_collapse not in MODES:
        raise ValueError(
            f"monitor.on_collapse={monitor.on_collapse!r} is not one of {', '.join(MODES)}: "
            "set --config.monitor.on_collapse=warn (log a warning), stop (save and stop) or off."
        )
    if int(monitor.patience) < 1:
        raise ValueError(
            f"monitor.patience={monitor.patience} must be >= 1 (log steps in a row a statistic "
            "must stay past its threshold before the alarm acts)."
        )
    for field in sorted({rule.field for rule in RULES.values()}):
        value = float(monitor[field])
        if not 0.0 <= value <= 1.0:
            raise ValueError(
                f"monitor.{field}={value} must lie in [0, 1]: it is a fraction of the "
                "statistic's healthy scale (docs/operations.md); "
                "--config.monitor.on_collapse=off turns the alarm off."
            )
