r"""Graded handling of large gradients and updates, on the device
(`SafeOptimizer(clip="adaptive")`).

Each step passes the grades below, all decided inside the compiled step with
no branch and no host read:

1. **Non-finite** gradients or new values, and (with `spike_factor`)
   **extreme** norms: the step is rejected, as without `clip`.
2. **A moderate outlier of the global norm** is clipped to a threshold learnt
   from the run's own norms, as ZClip (Kumar et al., 2025) does: an EMA of the
   norm's mean :math:`\mu` and variance :math:`\sigma^2` (:math:`\alpha =
   0.97`), started from the mean and variance of the first 25 steps; a norm
   whose z-score :math:`z = (\|g\| - \mu) / \sigma` passes :math:`z_t = 2.5`
   is clipped to

   .. math:: \mu + \frac{z_t\,\sigma}{z / z_t},

   and the EMA takes the clipped value. `clipnorm`, when set, still caps it
   (as ZClip's `max_grad_norm`).
3. **A layer whose gradient outgrows its own history** is clipped to
   :math:`\lambda = 1.05` times an EMA (:math:`\beta = 0.98`) of its own
   clipped norms, after the same 25 steps (AdaGC, 2025): one tensor's burst
   does not have to move the global norm to be caught.
4. **Each weight tensor's update** is bounded relative to the tensor:

   .. math:: \mathrm{RMS}(\Delta w) \le \rho \, \frac{\eta_t}{\max_{s \le t} \eta_s}
             \max(\mathrm{RMS}(w), f),

   :math:`\rho` = `max_update_ratio` (0.01 by default) times the step's
   learning rate over the highest rate a step has run at, the update scaled
   down where it is larger. The bound anneals as the schedule does: a run
   whose rate is far above the bound would otherwise never feel its cosine
   decay, and its weights (and BatchNormalization's moving statistics,
   which trail them) would never settle. Vectors (biases, normalization
   scales and offsets) count an RMS of :math:`f = 1` at least, matrices
   :math:`f = 10^{-3}`. Gradient clipping cannot reach what makes a run
   at a high learning rate diverge with Adam-type optimizers, which divide
   the gradient's scale away: the step's size is the learning rate itself.
   Adafactor clips each tensor's update to an RMS of 1 in units of the rate,
   and StableAdamW (Wortsman et al., 2023) adds that to AdamW; both still
   let a tensor move by the rate, however small the tensor. Bounding the
   update *relative to the weight* (the trust ratio of LARS and LAMB, as a
   bound rather than a rescaling, and AGC's floor of 1e-3 for tensors near
   zero) keeps each step a small fraction of what it changes, whatever the
   rate, and leaves a step already under the bound bit for bit as the inner
   optimizer made it. 0.01, the floors and the annealing were chosen on a
   tuning seed of the character-level GPT of `benchmarks/bench_stable_lr.py`
   and judged on its other seeds and on the digits CNN (which the annealing
   was not blind to: BENCHMARKS.md says how).

Rejected steps leave every statistic as it was. The state is a few scalars
and one per tensor: `ClipState`, variables of the optimizer, saved with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_nanguard import _kernels as kernels
from keras_nanguard._backend import current as backend

# ZClip's published defaults.
ALPHA = 0.97
Z_THRESHOLD = 2.5
WARMUP_STEPS = 25
EPSILON = 1e-6
# AdaGC's published per-tensor factor and EMA decay.
LAYER_FACTOR = 1.05
LAYER_BETA = 0.98
# The update bound: `max_update_ratio`'s default, and the RMS a tensor near
# zero counts as (AGC's floor).
MAX_UPDATE_RATIO = 0.01
WEIGHT_FLOOR = 1e-3
VECTOR_FLOOR = 1.0


@dataclasses.dataclass(eq=False)
class ClipState:
    """The graded handling's variables (of the optimizer, saved with it).

    `norm_stats` and `layer_norms` are state a rollback restores; the others
    are reports of what happened.
    """

    norm_stats: keras.Variable  # steps seen (up to the warm-up), EMA mean, variance
    layer_norms: keras.Variable  # per built variable, EMA of its clipped norm; 0 spare
    clip_threshold: keras.Variable  # the global norm above which a step is clipped
    bounded_update_steps: keras.Variable  # accepted steps with an update bounded
    moment_resets: keras.Variable  # resets of the inner optimizer's moments
    update_ratio: keras.Variable  # `max_update_ratio` (a variable: settable)
    peak_rate: keras.Variable  # the highest learning rate a step has run at

    @classmethod
    def create(
        cls,
        optimizer: keras.optimizers.Optimizer,
        n: int,
        clipnorm: float | None,
        ratio: float | None,
    ) -> ClipState:
        """New variables of `optimizer`, for `n` built variables, with the
        optimizer's `clipnorm` and `max_update_ratio`."""

        def make(name: str, shape: tuple, dtype: str, initial: float) -> Any:
            return kernels.state_variable(optimizer, name, shape, dtype, initial)

        return cls(
            norm_stats=make("clip_norm_stats", (3,), "float32", 0.0),
            layer_norms=make("clip_layer_norms", (n + 1,), "float32", 0.0),
            clip_threshold=make(
                "clip_threshold",
                (),
                "float32",
                kernels.FLOAT32_MAX if clipnorm is None else clipnorm,
            ),
            bounded_update_steps=make("bounded_update_steps", (), "int32", 0),
            moment_resets=make("moment_resets", (), "int32", 0),
            update_ratio=make("update_ratio", (), "float32", ratio or 0.0),
            peak_rate=make("peak_rate", (), "float32", 0.0),
        )

    def variables(self) -> list[keras.Variable]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def history_variables(self) -> list[keras.Variable]:
        """The reports and the setting (kept through a rollback, not checked
        by snapshots)."""
        return [
            self.clip_threshold,
            self.bounded_update_steps,
            self.moment_resets,
            self.update_ratio,
            self.peak_rate,
        ]

    def count(self, ok: Any, bounded: Any, reset: Any) -> None:
        """Counts an accepted step whose update was bounded (`bounded`:
        `None` without the bound) and a moment reset (`reset`: `None`
        without `reset_moments`)."""
        if bounded is not None:
            self.bounded_update_steps.assign(
                self.bounded_update_steps.value
                + ops.cast(ops.logical_and(ok, bounded), "int32")
            )
        if reset is not None:
            self.moment_resets.assign(
                self.moment_resets.value + ops.cast(reset, "int32")
            )

    def read(self, values: Sequence[Any] | None = None) -> dict[str, float | int]:
        """The scalar reports as Python numbers (a host read); `values`: the
        values of `variables()`, by default the variables'."""
        named = dict(
            zip(
                [f.name for f in dataclasses.fields(self)],
                self.variables() if values is None else values,
                strict=True,
            )
        )
        threshold = kernels.from_finite(backend.host_view(named["clip_threshold"]))
        return {
            "clip_threshold": float(threshold),
            "bounded_update_steps": int(
                backend.host_view(named["bounded_update_steps"])
            ),
            "moment_resets": int(backend.host_view(named["moment_resets"])),
        }


class Clipping:
    """One step's clipping: the factor each checked gradient is scaled by,
    and what the statistics take from the step once it is decided."""

    def __init__(
        self,
        state: ClipState,
        norm: Any,
        grad_sq: Any,
        index: tuple[int, ...],
        clipnorm: float | None,
    ) -> None:
        """`norm`: the global norm of the raw gradients; `grad_sq`: each
        checked gradient's sum of squares; `index`: each one's position among
        the built variables (-1: none, which has no layer statistics)."""
        self.state = state
        # A gradient of a variable the optimizer was not built with reads and
        # writes the last entry, which stays 0 ("no statistics yet").
        spare = int(state.layer_norms.shape[0]) - 1
        self._positions = np.array([i if i >= 0 else spare for i in index], "int32")
        self._spare = self._positions == spare
        self._stats = stats = ops.cast(state.norm_stats.value, "float32")
        seen, mean, var = stats[0], stats[1], stats[2]
        norm = ops.cast(norm, "float32")
        self.norm = norm
        std = ops.sqrt(var)
        z = (norm - mean) / (std + EPSILON)
        self.warm = seen < WARMUP_STEPS
        outlier = ops.logical_and(ops.logical_not(self.warm), z > Z_THRESHOLD)
        # ZClip's threshold for an outlier: lower the further out it is.
        self.adaptive = ops.where(
            outlier, mean + Z_THRESHOLD * std / (z / Z_THRESHOLD), np.inf
        )
        threshold = self.adaptive
        if clipnorm is not None:
            threshold = ops.minimum(threshold, clipnorm)
        self.clipnorm = clipnorm
        global_factor = ops.minimum(1.0, threshold / norm)
        tensor_norms = ops.sqrt(ops.cast(grad_sq, "float32")) * global_factor
        ema = ops.take(state.layer_norms.value, self._positions)
        held = ops.logical_or(self.warm, ema <= 0.0)
        limits = ops.where(held, np.inf, LAYER_FACTOR * ema)
        layer_factor = ops.minimum(1.0, limits / tensor_norms)
        self.clipped_norms = tensor_norms * layer_factor
        self.factors = global_factor * layer_factor
        self.clipped = ops.any(self.factors < 1.0)

    def record(self, ok: Any) -> None:
        """The statistics after the step: an accepted step's norm enters them
        (the global EMA takes the adaptive threshold where it clipped, each
        layer its clipped norm); a rejected one changes nothing."""
        state, stats = self.state, self._stats
        seen, mean, var = stats[0], stats[1], stats[2]
        taken = ops.minimum(self.norm, self.adaptive)
        # Warm-up: the running mean and variance of the first norms (at its
        # end, their mean and population variance, as ZClip starts its EMA).
        count = seen + 1.0
        warm_mean = mean + (taken - mean) / count
        warm_var = var + ((taken - mean) * (taken - warm_mean) - var) / count
        ema_mean = ALPHA * mean + (1.0 - ALPHA) * taken
        ema_var = ALPHA * var + (1.0 - ALPHA) * ops.square(taken - ema_mean)
        new = ops.stack(
            [
                ops.minimum(count, float(WARMUP_STEPS)),
                ops.where(self.warm, warm_mean, ema_mean),
                ops.where(self.warm, warm_var, ema_var),
            ]
        )
        kept = ops.where(ok, new, stats)
        state.norm_stats.assign(kept)
        # What the next step is judged against: a norm above the boundary of
        # the warm statistics (or `clipnorm`) is clipped; inf before that.
        boundary = ops.where(
            kept[0] >= WARMUP_STEPS,
            kept[1] + Z_THRESHOLD * ops.sqrt(kept[2]),
            np.inf,
        )
        if self.clipnorm is not None:
            boundary = ops.minimum(boundary, self.clipnorm)
        state.clip_threshold.assign(kernels.to_finite(boundary))
        old = ops.take(state.layer_norms.value, self._positions)
        ema = ops.where(
            old <= 0.0,
            self.clipped_norms,
            LAYER_BETA * old + (1.0 - LAYER_BETA) * self.clipped_norms,
        )
        ema = ops.where(ok, ema, old)
        if self._spare.any():
            ema = ops.where(self._spare, 0.0, ema)
        state.layer_norms.assign(
            ops.scatter_update(state.layer_norms.value, self._positions[:, None], ema)
        )


def step_ratio(state: ClipState, rate: Any) -> Any:
    """The bound of this step: `max_update_ratio` times the learning rate
    `rate` over the highest one any step has run at (kept in `peak_rate`),
    so that the bound anneals as the schedule does (a cosine decay to a
    tenth ends with a tenth of the bound). During a warm-up the rate is its
    highest yet: the bound whole."""
    rate = ops.cast(rate, "float32")
    peak = ops.maximum(state.peak_rate.value, rate)
    state.peak_rate.assign(peak)
    return state.update_ratio.value * ops.where(peak > 0.0, rate / peak, 1.0)


def update_scales(old: list[Any], new: list[Any], ratio: Any) -> Any:
    """Per weight tensor, the factor its update `new - old` is scaled by so
    that its RMS is at most `ratio` times the tensor's (`WEIGHT_FLOOR` at
    least): 1 where it already is. A float32 vector."""
    sizes = np.array([max(int(np.prod(tuple(v.shape))), 1) for v in old], "float32")
    floors = np.array(
        [WEIGHT_FLOOR if len(v.shape) >= 2 else VECTOR_FLOOR for v in old], "float32"
    )
    update_sq, weight_sq = backend.update_sums(old, new)
    weight_rms = ops.sqrt(ops.cast(weight_sq, "float32") / sizes)
    update_rms = ops.sqrt(ops.cast(update_sq, "float32") / sizes)
    limit = ratio * ops.maximum(weight_rms, floors)
    return ops.minimum(1.0, limit / update_rms)
