"""StableSoftmax: a drop-in for `keras.layers.Softmax` that cannot make NaN."""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_nanguard import _kernels as kernels
from keras_nanguard._validation import is_int, is_number

_NAN_LOGITS = ("propagate", "mask")


@keras.saving.register_keras_serializable(package="keras_nanguard")
class StableSoftmax(keras.layers.Layer):
    r"""Softmax that never returns NaN for finite or infinite logits.

    A drop-in for `keras.layers.Softmax`, computed in float32 whatever the
    input dtype (mixed precision) and returned in the layer's compute dtype:

    - `+inf` logits share the probability of their row; `-inf` logits get 0;
    - masked entries (Keras masking or the `mask` argument) get exactly 0, and
      a fully masked row (or a row of `-inf`) gives all zeros (Keras's
      `Softmax` zeroes masked entries too, but gives NaN for a row of `-inf`
      logits and for `+inf` logits);
    - `soft_cap` bounds logits smoothly, :math:`C \tanh(x / C)` (Gemma 2), so
      huge and infinite logits have a finite value and a finite gradient;
      `hard_cap` clips them instead;
    - `min_prob` floors every allowed probability at `min_prob` while rows
      still sum to 1: :math:`p' = (1 - K\epsilon)\,p + \epsilon` over the `K`
      allowed entries of the row;
    - `log_probs=True` returns log-probabilities computed in log space
      (:math:`x_i - \log\sum_j e^{x_j}`), finite wherever the probability can
      be non-zero even when it underflows (`[0, -120]` gives `[0, -120]`, not
      `[0, -inf]`), never `-inf` for allowed entries when `min_prob > 0`.
      Masked and impossible entries get the most negative finite value of the
      output dtype, so `p * log p` is 0 there, not NaN.
    - NaN logits: `nan_logits="propagate"` (default) makes their row NaN, so a
      bug upstream stays visible; `"mask"` treats them as masked.

    Gradients are finite for every input above except NaN logits.

    Args:
        axis: int or tuple of ints, the axis of the classes. Defaults to -1.
        soft_cap: float > 0 or `None`. Defaults to `None`.
        hard_cap: float > 0 or `None` (clip logits to `[-hard_cap, hard_cap]`).
            Defaults to `None`.
        temperature: float > 0; logits are divided by it (before capping).
            Defaults to 1.0.
        min_prob: float in `[0, 1/n)` for `n` classes. Defaults to 0.0.
        log_probs: bool, return log-probabilities. Defaults to `False`.
        nan_logits: `"propagate"` or `"mask"`. Defaults to `"propagate"`.
        **kwargs: base layer keyword arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: the logits.
        mask: optional bool tensor broadcastable to `inputs`; True = allowed.

    Call returns:
        Probabilities (or log-probabilities), same shape as `inputs`.

    Example:

    >>> import numpy as np, keras_nanguard as ng
    >>> from keras import ops
    >>> logits = np.array([[0.0, np.inf, 0.0], [-np.inf, -np.inf, -np.inf]])
    >>> ops.convert_to_numpy(ng.StableSoftmax()(logits)).tolist()
    [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    >>> logp = ng.StableSoftmax(log_probs=True)(np.array([[0.0, -120.0]]))
    >>> ops.convert_to_numpy(logp).round(2).tolist()
    [[0.0, -120.0]]
    """

    def __init__(
        self,
        axis: int | tuple[int, ...] = -1,
        *,
        soft_cap: float | None = None,
        hard_cap: float | None = None,
        temperature: float = 1.0,
        min_prob: float = 0.0,
        log_probs: bool = False,
        nan_logits: str = "propagate",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.axis = _check_axis(axis)
        for name, value in (("soft_cap", soft_cap), ("hard_cap", hard_cap)):
            if value is not None and not (is_number(value) and value > 0):
                raise ValueError(
                    f"`{name}` must be a finite number > 0 or None. Received: {name}={value!r}"
                )
        if soft_cap is not None and hard_cap is not None:
            raise ValueError(
                "Set `soft_cap` or `hard_cap`, not both. "
                f"Received: soft_cap={soft_cap}, hard_cap={hard_cap}"
            )
        if not (is_number(temperature) and temperature > 0):
            raise ValueError(
                f"`temperature` must be a finite number > 0. Received: temperature={temperature!r}"
            )
        if not (is_number(min_prob) and 0 <= min_prob < 1):
            raise ValueError(
                f"`min_prob` must be in [0, 1/n) for n classes. Received: min_prob={min_prob!r}"
            )
        if nan_logits not in _NAN_LOGITS:
            raise ValueError(
                f"`nan_logits` must be one of {_NAN_LOGITS}. Received: nan_logits={nan_logits!r}"
            )
        self.soft_cap = None if soft_cap is None else float(soft_cap)
        self.hard_cap = None if hard_cap is None else float(hard_cap)
        self.temperature = float(temperature)
        self.min_prob = float(min_prob)
        if not isinstance(log_probs, bool | np.bool_):
            raise TypeError(
                f"`log_probs` must be True or False. Received: log_probs={log_probs!r}"
            )
        self.log_probs = bool(log_probs)
        self.nan_logits = nan_logits
        self.supports_masking = True

    def build(self, input_shape: tuple) -> None:
        rank = len(input_shape)
        axes = self.axis if isinstance(self.axis, tuple) else (self.axis,)
        for a in axes:
            if not -rank <= a < rank:
                raise ValueError(
                    f"`axis` is out of range for inputs of rank {rank}. "
                    f"Received: axis={self.axis}, input_shape={tuple(input_shape)}"
                )
        sizes = [input_shape[a] for a in axes]
        n = None if None in sizes else math.prod(sizes)
        if self.min_prob > 0 and n is not None and not self.min_prob * n < 1:
            raise ValueError(
                f"`min_prob` must be < 1/n for n={n} classes, or the floors alone "
                f"would exceed 1. Received: min_prob={self.min_prob}"
            )
        self._axes = tuple(sorted(a % rank for a in axes))
        self.built = True

    def call(self, inputs: Any, mask: Any = None) -> Any:
        axis = self._axes if len(self._axes) > 1 else self._axes[0]
        x = ops.cast(inputs, "float32")
        if self.temperature != 1.0:
            x = x / self.temperature
        if self.soft_cap is not None:
            x = self.soft_cap * ops.tanh(x / self.soft_cap)
        elif self.hard_cap is not None:
            x = ops.clip(x, -self.hard_cap, self.hard_cap)
        allowed = None
        if mask is not None:
            _check_mask(mask, x)
            allowed = (
                ops.cast(mask, "bool")
                if keras.backend.standardize_dtype(mask.dtype) == "bool"
                else ops.greater(mask, 0.5)
            )
            allowed = ops.broadcast_to(allowed, ops.shape(x))
        if self.nan_logits == "mask":
            finite_or_inf = ~ops.isnan(x)
            allowed = finite_or_inf if allowed is None else allowed & finite_or_inf
        if allowed is not None:
            x = ops.where(allowed, x, -np.inf)
        out = kernels.softmax_parts(x, axis, log=self.log_probs)
        if self.min_prob > 0:
            out = self._floor(out, x, axis)
        if self.log_probs:
            floor = float(
                np.finfo(keras.backend.standardize_dtype(self.compute_dtype)).min
            )
            out = ops.maximum(out, floor)  # -inf -> floor; NaN stays NaN
        return ops.cast(out, self.compute_dtype)

    def _floor(self, out: Any, x: Any, axis: Any) -> Any:
        # Allowed entries: not masked, not -inf. They get at least min_prob.
        possible = x > -np.inf
        eps = self.min_prob
        k = ops.sum(ops.cast(possible, "float32"), axis=axis, keepdims=True)
        p = ops.exp(out) if self.log_probs else out
        floored = (1.0 - k * eps) * p + eps
        if self.log_probs:
            return ops.where(
                possible, ops.log(ops.where(possible, floored, 1.0)), -np.inf
            )
        return ops.where(possible, floored, 0.0)

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        return mask

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return input_shape

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
                "axis": self.axis,
                "soft_cap": self.soft_cap,
                "hard_cap": self.hard_cap,
                "temperature": self.temperature,
                "min_prob": self.min_prob,
                "log_probs": self.log_probs,
                "nan_logits": self.nan_logits,
            }
        )
        return config


def _check_mask(mask: Any, x: Any) -> None:
    # The same rule and words as keras.layers.Softmax.
    m_shape, x_shape = tuple(mask.shape), tuple(x.shape)
    ok = len(m_shape) <= len(x_shape) and all(
        m in (1, None) or i is None or m == i
        for m, i in zip(m_shape[::-1], x_shape[::-1], strict=False)
    )
    if not ok:
        raise ValueError(
            "The `mask` must be broadcastable to `inputs`: each mask dimension "
            "must be 1 or match the corresponding input dimension. Received: "
            f"inputs.shape={x_shape}, mask.shape={m_shape}"
        )


def _check_axis(axis: Any) -> int | tuple[int, ...]:
    """`axis` as an int or a tuple of ints (a list is taken as a tuple)."""
    if isinstance(axis, list):
        axis = tuple(axis)
    if is_int(axis):
        return int(axis)
    if isinstance(axis, tuple) and axis and all(map(is_int, axis)):
        return tuple(int(a) for a in axis)
    raise TypeError(
        f"`axis` must be an int or a tuple of ints. Received: axis={axis!r}"
    )
