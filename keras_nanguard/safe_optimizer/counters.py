"""SafeOptimizer's counters, and the reports made of them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from keras_nanguard.errors import NonFiniteError

_REASONS = {
    0: "none",
    1: "gradient",
    2: "update",
    3: "spike",
    4: "loss_scale_overflow",
    5: "loss",
}
_COUNTERS = (
    ("skipped_steps", "int32", 0),
    ("consecutive_skips", "int32", 0),
    ("nonfinite_gradient_steps", "int32", 0),
    ("nonfinite_update_steps", "int32", 0),
    ("clipped_steps", "int32", 0),
    ("last_grad_norm", "float32", 0.0),
    ("rejected_grad_norm", "float32", 0.0),
    ("last_rejection", "int32", 0),
    ("last_nonfinite_index", "int32", -1),
    ("lr_scale", "float32", 1.0),
    ("consecutive_accepts", "int32", 0),
    ("accepted_grad_norm", "float32", 0.0),
    ("spike_steps", "int32", 0),
    ("loss_scale_steps", "int32", 0),
    ("recent_rejections", "int32", 0),
)
# Files of earlier versions have fewer counters (new counters go last, so
# that they still load): see `file_layouts`.
# `recent_rejections` holds the outcomes of the last `RECENT_STEPS` steps.
RECENT_STEPS = 30
# Counters that are history (NaNGuard keeps them through a rollback); the
# others (consecutive_skips, lr_scale, consecutive_accepts) are control state.
_HISTORY = (
    "skipped_steps",
    "spike_steps",
    "loss_scale_steps",
    "nonfinite_gradient_steps",
    "nonfinite_update_steps",
    "clipped_steps",
    "last_grad_norm",
    "rejected_grad_norm",
    "last_rejection",
    "last_nonfinite_index",
    "recent_rejections",
)


class ReportsMixin:
    """Reading SafeOptimizer's counters on the host, where a person looks."""

    def counters(
        self, optimizer_variables: Sequence[Any] | None = None
    ) -> dict[str, float | int]:
        """The counters as Python numbers (reads them from the device).

        Args:
            optimizer_variables: in a JAX stateless loop, the values
                `stateless_apply` returned (in `optimizer.variables` order);
                by default this optimizer's own variables.

        Example:

        >>> import keras, keras_nanguard as ng
        >>> ng.SafeOptimizer(keras.optimizers.SGD(0.1)).counters()["skipped_steps"]
        0
        """
        values = self._counter_values(optimizer_variables)
        out: dict[str, float | int] = {}
        for (counter, dtype, _), value in zip(_COUNTERS, values, strict=True):
            value = ops.convert_to_numpy(value)
            out[counter] = float(value) if dtype == "float32" else int(value)
        return out

    def _counter_values(self, optimizer_variables: Sequence[Any] | None) -> list:
        if optimizer_variables is None:
            return [getattr(self, counter) for counter, _, _ in _COUNTERS]
        values = list(optimizer_variables)
        if len(values) != len(self.variables):
            raise ValueError(
                "`optimizer_variables` must hold one value per variable of "
                f"`optimizer.variables` ({len(self.variables)}), as "
                f"`stateless_apply` returns them. Received: {len(values)} values"
            )
        return values[: len(_COUNTERS)]  # the counters come first

    def describe_last_rejection(
        self, optimizer_variables: Sequence[Any] | None = None
    ) -> str:
        """The last rejected step in words, or `""` if none was rejected.

        Args:
            optimizer_variables: as for `counters`.

        Example:

        >>> import keras, keras_nanguard as ng
        >>> ng.SafeOptimizer(keras.optimizers.SGD(0.1)).describe_last_rejection()
        ''
        """
        c = self.counters(optimizer_variables)
        reason = _REASONS.get(int(c["last_rejection"]), "none")
        if reason == "none":
            return ""
        names = [_path(v) for v in getattr(self, "_trainable_variables", [])]
        names += [_path(v, optimizer=True) for v in self.inner_optimizer.variables]
        index = int(c["last_nonfinite_index"])
        where = names[index] if 0 <= index < len(names) else f"variable #{index}"
        norm = c["rejected_grad_norm"]
        if reason == "spike":
            last = self.last_spike.value
            if optimizer_variables is not None:  # the window follows the counters
                last = list(optimizer_variables)[len(_COUNTERS) + 2]
            threshold, reference = (float(v) for v in ops.convert_to_numpy(last))
            return (
                f"the global gradient norm {norm:.4g} was a spike, more than "
                f"{self.spike_factor:g} times the 90th percentile of the last "
                f"{self.spike_window} steps' norms ({reference:.4g}): above "
                f"{threshold:.4g}"
            )
        if reason == "loss_scale_overflow":
            return (
                "the loss-scaled gradients overflowed (mixed precision): the "
                "LossScaleOptimizer skipped the step and halved its loss "
                "scale, its routine"
            )
        if reason == "loss":
            return (
                "the loss was not finite (a bad batch: non-finite inputs, "
                "targets or loss terms), so the loss-scaled gradients were "
                "not either; the LossScaleOptimizer's scale was kept"
            )
        if reason == "gradient":
            return (
                f"the gradient of {where} was not finite "
                f"(global gradient norm {norm:.4g})"
            )
        return (
            f"the update would have made {where} non-finite although the "
            f"gradients were finite (global gradient norm {norm:.4g}); the "
            "learning rate is probably too high for these gradients"
        )

    def check_halted(self, optimizer_variables: Sequence[Any] | None = None) -> None:
        """Raises `NonFiniteError` if `max_consecutive_skips` was reached.

        Call it where your loop reads values back anyway (e.g. when logging).

        Args:
            optimizer_variables: as for `counters`.

        Example:

        >>> import keras, keras_nanguard as ng
        >>> opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1), max_consecutive_skips=3)
        >>> opt.check_halted()  # nothing rejected yet: returns quietly
        """
        if self.max_consecutive_skips is None:
            return
        if self._halted(optimizer_variables):
            raise NonFiniteError(
                f"SafeOptimizer {self._halt_message(optimizer_variables)} "
                "Training cannot make progress from this state: restore a good "
                "checkpoint, lower the learning rate or check the data.",
                report=self.counters(optimizer_variables),
            )

    def _halted(self, optimizer_variables: Sequence[Any] | None = None) -> bool:
        consecutive = self.counters(optimizer_variables)["consecutive_skips"]
        return consecutive >= self.max_consecutive_skips

    def _halt_message(self, optimizer_variables: Sequence[Any] | None = None) -> str:
        c = self.counters(optimizer_variables)
        return (
            f"rejected {c['consecutive_skips']} steps in a row "
            f"(max_consecutive_skips={self.max_consecutive_skips}) and halted; "
            f"last, {self.describe_last_rejection(optimizer_variables)}."
        )

    def _history_variables(self) -> list[keras.Variable]:
        return [getattr(self, name) for name in _HISTORY]


def _path(v: keras.Variable, optimizer: bool = False) -> str:
    name = f"'{getattr(v, 'path', None) or v.name}'"
    return f"optimizer variable {name}" if optimizer else name
