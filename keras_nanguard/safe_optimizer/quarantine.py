"""Per-sample quarantine: the rows of a batch that hold a non-finite value, or
whose own loss is not finite, are left out of the step instead of the batch.

A compiled step has static shapes, so rows cannot be removed. They are made
harmless instead, on the device, with no branch and no host read:

- before the forward pass (`Quarantine.clean`), a row with a non-finite
  value in its inputs, targets or sample weight gets the values of a healthy
  row of the batch (a weight of 0 on a NaN row would still be
  `0 * NaN = NaN` in the loss and the gradients), and the loss and the
  metrics give it the weight 0;
- in the loss (`compute_loss`, wrapped on the model), a row whose own loss is
  not finite although its values are (`log(0)`, `x / 0` for that sample)
  gets the prediction and the target of a healthy row, and the weight 0;
- the healthy rows' weights are scaled by `batch / healthy`, so that Keras's
  `sum_over_batch_size` divides by the healthy count: the loss and the
  gradients are those of the batch with the bad rows removed;
- `compute_metrics` (wrapped too) sees the same rows with the weight 0.

When more than `max_fraction` of a batch is bad, nothing is changed: the step
runs as without quarantine, and is rejected as a bad step (a broken pipeline,
not bad rows). What each row was quarantined for is a bit mask per row
(`INPUT`, `TARGET`, `WEIGHT`, `LOSS`), which `end` hands to the attached
step for the counters (`Counters.record_quarantine`). What the wrapped
methods of one step tell each other and `end` goes through one channel:
the step's `_Rows`, held per thread.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import keras
from keras import ops

from keras_nanguard._backend import current as backend
from keras_nanguard.safe_optimizer import patches

# Why a row was quarantined: bits of its code.
INPUT, TARGET, WEIGHT, LOSS = 1, 2, 4, 8
REASONS = {
    INPUT: "non-finite input",
    TARGET: "non-finite target",
    WEIGHT: "non-finite sample weight",
    LOSS: "non-finite loss",
}
# Reductions under which scaling the healthy rows' weights by
# `batch / healthy` gives the mean over the healthy rows ("sum" needs none).
_SCALED = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


def reasons(code: int) -> list[str]:
    """The words of a row's code, e.g. `["non-finite input"]`."""
    return [words for bit, words in REASONS.items() if code & bit]


@dataclasses.dataclass
class _Rows:
    """What `clean` found in one step's batch (tensors of that trace)."""

    codes: Any  # int32 (batch,): the INPUT/TARGET/WEIGHT bits of each row
    # The codes with the LOSS bits and the limit, as `compute_loss` found
    # them, for `compute_metrics` to reuse; not on JAX, where `compute_loss`
    # runs under `jax.grad` and its values cannot leave it.
    with_loss: tuple[Any, Any] | None = None
    # The codes and the limit `compute_metrics` left out, for `end`.
    found: tuple[Any, Any] | None = None


class Quarantine:
    """The quarantine of one attached model's steps.

    Args:
        max_fraction: above this fraction of bad rows in a batch, the step is
            left as it is (and rejected as a bad step).
    """

    def __init__(self, max_fraction: float) -> None:
        self.max_fraction = max_fraction
        # The step under way, per thread: `tf.distribute` runs a step's
        # replicas in threads of their own.
        self._local = threading.local()

    @property
    def _rows(self) -> _Rows | None:
        return getattr(self._local, "rows", None)

    @_rows.setter
    def _rows(self, rows: _Rows | None) -> None:
        self._local.rows = rows

    # ------------------------------------------------------------ the data
    def clean(self, data: Any) -> Any:
        """The batch `data` with its rows of non-finite values made harmless
        (see the module); starts a quarantined step (`end` ends it)."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        cleaned = clean_rows(x, y, sample_weight, self.max_fraction)
        if cleaned is None:
            return data
        x, y, sample_weight, codes = cleaned
        self._rows = _Rows(codes)
        return keras.utils.pack_x_y_sample_weight(x, y, sample_weight)

    def end(self) -> tuple[Any, Any]:
        """Ends the step: each row's code and whether the batch was over the
        limit. Without `compute_metrics` (a `train_step` of the model's own
        that does not call it), the codes are those of the values alone."""
        rows, self._rows = self._rows, None
        if rows is None:
            raise RuntimeError("`Quarantine.end` without `clean` first.")
        if rows.found is not None:
            return rows.found
        return rows.codes, self._over(rows.codes > 0)

    def abandon(self) -> None:
        """Ends a step that raised."""
        self._rows = None

    @staticmethod
    def weigh_loss(before: list[Any], after: list[Any], codes: Any, over: Any) -> list:
        """The loss tracker's (total, count) after a quarantined step, from
        their values `before` and `after` it: the batch counted as its
        healthy rows (as the batch without the bad ones would be)."""
        size = ops.cast(ops.shape(codes)[0], "float32")
        left_out = ops.sum(ops.cast(ops.logical_and(codes > 0, ~over), "float32"))
        share = (size - left_out) / size
        return [
            b + (a - b) * ops.cast(share, a.dtype)
            for b, a in zip(before, after, strict=True)
        ]

    def _over(self, bad: Any) -> Any:
        return too_many(bad, self.max_fraction)

    # ------------------------------------------------------------ the model
    def wrap(self, model: keras.Model) -> None:
        """Wraps the model's `compute_loss` and `compute_metrics` (its public
        override points) so that quarantined steps leave the bad rows out;
        outside a quarantined step (`evaluate`, `predict`) they are the
        model's own."""
        if patches.owner_of(model, "compute_loss") is self:
            return
        loss, metrics = (
            _unquarantined(model, n) for n in ("compute_loss", "compute_metrics")
        )
        patches.patch(model, "compute_loss", self._loss_of(model, loss), self, loss)
        patches.patch(
            model, "compute_metrics", self._metrics_of(model, metrics), self, metrics
        )

    def unwrap(self, model: keras.Model) -> None:
        """Undoes `wrap`."""
        for name in ("compute_loss", "compute_metrics"):
            if patches.owner_of(model, name) is self:
                patches.unpatch(model, name)

    def _loss_of(self, model: keras.Model, original: Any) -> Callable[..., Any]:
        takes_training = getattr(model, "_compute_loss_has_training_arg", True)

        def compute_loss(
            x: Any = None,
            y: Any = None,
            y_pred: Any = None,
            sample_weight: Any = None,
            training: bool = True,
        ) -> Any:
            if self._rows is not None:
                y, y_pred, sample_weight = self._for_loss(
                    model, y, y_pred, sample_weight
                )
            if takes_training:
                return original(x, y, y_pred, sample_weight, training=training)
            return original(x, y, y_pred, sample_weight)

        return compute_loss

    def _metrics_of(self, model: keras.Model, original: Any) -> Callable[..., Any]:
        def compute_metrics(
            x: Any, y: Any, y_pred: Any, sample_weight: Any = None
        ) -> Any:
            rows = self._rows
            if rows is None:
                return original(x, y, y_pred, sample_weight)
            codes, over = self._codes(model, y, y_pred)
            y, y_pred, sample_weight = _without_bad_rows(
                codes, over, y, y_pred, sample_weight, to_healthy_mean=False
            )
            rows.found = (codes, over)
            return original(x, y, y_pred, sample_weight)

        return compute_metrics

    def _codes(self, model: keras.Model, y: Any, y_pred: Any) -> tuple[Any, Any]:
        """Each row's code with the LOSS bit of rows whose own loss is not
        finite, and whether the bad rows are over the limit (from
        `compute_loss` when it found them in this trace)."""
        rows = self._rows
        assert rows is not None
        if rows.with_loss is not None:
            return rows.with_loss
        codes = rows.codes
        losses = _per_sample_losses(model, y, y_pred)
        if losses is not None:
            loss_bad = ops.logical_and(_bad_rows_of(losses), codes == 0)
            codes = codes + LOSS * ops.cast(loss_bad, "int32")
        return codes, self._over(codes > 0)

    def _for_loss(
        self, model: keras.Model, y: Any, y_pred: Any, sample_weight: Any
    ) -> tuple[Any, Any, Any]:
        """`compute_loss`'s arguments with the rows whose loss is not finite
        given a healthy row's target and prediction, their weight 0, and
        the healthy rows' weights scaled to the mean over them."""
        codes, over = self._codes(model, y, y_pred)
        if not backend.STATELESS_TRAIN_STEP:
            rows = self._rows
            assert rows is not None
            rows.with_loss = (codes, over)
        return _without_bad_rows(
            codes, over, y, y_pred, sample_weight, to_healthy_mean=_scales(model)
        )


# ---------------------------------------------------------------- the rows
def clean_rows(
    x: Any, y: Any, sample_weight: Any, max_fraction: float
) -> tuple[Any, Any, Any, Any] | None:
    """`x`, `y` and `sample_weight` with the rows that hold a non-finite value
    given a healthy row's values (a sample weight 0), unless they are too
    many; and each row's code (INPUT, TARGET, WEIGHT bits). `None` for a
    batch without a tensor in `x`.

    No sample weight is added where there was none (a `train_step` of the
    model's own may unpack `x, y = data`): the wrapped `compute_loss` and
    `compute_metrics`, or `QuarantinedBatch.loss`, weigh the rows."""
    first = next((t for t in keras.tree.flatten(x) if t is not None), None)
    if first is None:
        return None
    codes = ops.zeros((ops.shape(first)[0],), "int32")
    for bit, part in ((INPUT, x), (TARGET, y), (WEIGHT, sample_weight)):
        for t in keras.tree.flatten(part):
            if _is_float(t):
                codes = codes + bit * ops.cast(_bad_rows(t), "int32")
    bad = codes > 0
    change = ops.logical_and(bad, ~too_many(bad, max_fraction))
    healthy = _first(~bad)
    x = keras.tree.map_structure(lambda t: _replace(t, change, healthy), x)
    y = keras.tree.map_structure(lambda t: _replace(t, change, healthy), y)
    if sample_weight is not None:
        sample_weight = keras.tree.map_structure(
            lambda w: ops.where(_rows_of(change, w), ops.zeros_like(w), w),
            sample_weight,
        )
    return x, y, sample_weight, codes


def _without_bad_rows(
    codes: Any,
    over: Any,
    y: Any,
    y_pred: Any,
    sample_weight: Any,
    *,
    to_healthy_mean: bool,
) -> tuple[Any, Any, Any]:
    """A loss's or the metrics' arguments without the bad rows (`codes` > 0),
    unless they are `over` the limit: the rows whose own loss is not finite
    get the first healthy row's target and prediction (no gradient through
    it), every bad row the weight 0, and with `to_healthy_mean` the healthy
    rows' weights are scaled by batch / healthy (a loss that divides by the
    batch then divides by the healthy count)."""
    bad = codes > 0
    healthy = _first(~bad)
    by_loss = ops.logical_and(_loss_bad(codes), ~over)
    y = keras.tree.map_structure(lambda t: _replace(t, by_loss, healthy), y)
    y_pred = keras.tree.map_structure(
        lambda t: _replace(t, by_loss, healthy, stop=True), y_pred
    )
    keep = ops.logical_or(~bad, over)
    scale = None
    if to_healthy_mean:
        # Over the healthy rows of the global batch: a replica's loss, which
        # the replicas average, divides by its share of them.
        size = ops.cast(ops.shape(bad)[0], "float32")
        kept = size - ops.sum(ops.cast(bad, "float32"))
        kept_all, replicas = backend.replica_sum(kept)
        scale = ops.where(over, 1.0, size * replicas / ops.maximum(kept_all, 1.0))
    return y, y_pred, _weights(sample_weight, keep, scale)


def too_many(bad: Any, max_fraction: float) -> Any:
    """Whether the rows `bad` are too many to quarantine: more than
    `max_fraction` of the (global) batch, or all of it."""
    counts = ops.stack(
        [ops.sum(ops.cast(bad, "float32")), ops.cast(ops.shape(bad)[0], "float32")]
    )
    counts, _ = backend.replica_sum(counts)
    count, size = counts[0], counts[1]
    return ops.logical_or(count > max_fraction * size, count >= size)


class QuarantinedBatch:
    """A batch of a custom training loop under quarantine
    (`SafeOptimizer.quarantine`): `x`, `y` and `sample_weight` with the rows
    of non-finite values given a healthy row's values, and `loss`, the loss
    on the healthy rows. The optimizer's next `apply` counts its rows.

    Args:
        x: the batch's inputs, as the user gave them.
        y: its targets (or `None`).
        sample_weight: its sample weights (or `None`).
        max_fraction: above this fraction of bad rows it is left whole.
    """

    def __init__(self, x: Any, y: Any, sample_weight: Any, max_fraction: float):
        self.max_fraction = max_fraction
        cleaned = clean_rows(x, y, sample_weight, max_fraction)
        if cleaned is None:
            raise ValueError(
                "`x` must hold a tensor with the batch along its first axis. "
                f"Received: x={x!r:.200}"
            )
        # Each row's code; `loss` adds the LOSS bits (in a JAX loop, set
        # it to the codes `loss` made, returned from under `jax.grad`).
        self.x, self.y, self.sample_weight, self.codes = cleaned

    @property
    def over(self) -> Any:
        """Whether the bad rows are too many: the batch is left whole."""
        return too_many(self.codes > 0, self.max_fraction)

    def loss(self, loss_fn: Any, y_pred: Any) -> Any:
        """The loss of `y_pred` against `y` on the healthy rows: the rows
        whose own loss is not finite are left out too (given a healthy
        row's target and prediction, weight 0), and the loss is reduced as
        `loss_fn` reduces it (`sum_over_batch_size`: over the healthy rows).

        Args:
            loss_fn: a `keras.losses.Loss` (any reduction), a loss name or a
                function of `(y_true, y_pred)` giving a value per sample
                (then reduced as `sum_over_batch_size`).
            y_pred: the model's outputs on `x` (one tensor).
        """
        loss = _as_loss(loss_fn)
        per_sample = _per_sample(loss)
        assert per_sample is not None  # `_as_loss` gives a Loss
        values = per_sample(self.y, y_pred)
        loss_bad = ops.logical_and(_bad_rows(values), self.codes == 0)
        self.codes = self.codes + LOSS * ops.cast(loss_bad, "int32")
        y, y_pred, weights = _without_bad_rows(
            self.codes,
            self.over,
            self.y,
            y_pred,
            self.sample_weight,
            to_healthy_mean=loss.reduction in _SCALED,
        )
        return loss(y, y_pred, sample_weight=weights)


def _as_loss(loss_fn: Any) -> keras.losses.Loss:
    """`loss_fn` as a `keras.losses.Loss` (a name or a per-sample function
    wrapped with `sum_over_batch_size`)."""
    if isinstance(loss_fn, str):
        loss_fn = keras.losses.get(loss_fn)
    if isinstance(loss_fn, keras.losses.Loss):
        return loss_fn
    if callable(loss_fn):
        return _PerSample(loss_fn)
    raise TypeError(
        "`loss_fn` must be a keras.losses.Loss, a loss name or a function of "
        f"(y_true, y_pred). Received: loss_fn={loss_fn!r}"
    )


class _PerSample(keras.losses.Loss):
    """A per-sample loss function as a `Loss` (`sum_over_batch_size`)."""

    def __init__(self, fn: Callable[[Any, Any], Any]) -> None:
        super().__init__(name=getattr(fn, "__name__", "loss"))
        self.fn = fn

    def call(self, y_true: Any, y_pred: Any) -> Any:
        return self.fn(y_true, y_pred)


# ---------------------------------------------------------------- tensors
def _is_float(t: Any) -> bool:
    return (
        t is not None
        and hasattr(t, "dtype")
        and keras.backend.is_float_dtype(keras.backend.standardize_dtype(t.dtype))
    )


def _bad_rows(t: Any) -> Any:
    """Rows (first axis) of `t` holding a non-finite value, as bools: the
    row sums of `t * 0`, 0 for a finite row and NaN for one with a NaN or
    inf (exact: `x * 0` cannot overflow). One pass where XLA fuses it, and
    on torch two light ones where `isfinite` makes five."""
    zeros = ops.multiply(t, 0.0)
    if len(t.shape) > 1:
        zeros = ops.sum(zeros, axis=tuple(range(1, len(t.shape))))
    return ops.isnan(zeros)


def _bad_rows_of(tensors: list[Any]) -> Any:
    bad = None
    for t in tensors:
        rows = _bad_rows(t)
        bad = rows if bad is None else ops.logical_or(bad, rows)
    return bad


def _loss_bad(codes: Any) -> Any:
    return ops.bitwise_and(codes, LOSS) > 0


def _first(flags: Any) -> Any:
    """The index of the first True of a bool vector (0 when none is)."""
    return ops.argmax(ops.cast(flags, "int32"))


def _rows_of(rows: Any, t: Any) -> Any:
    """The bool vector `rows` shaped to broadcast along `t`'s first axis."""
    return ops.reshape(rows, (-1,) + (1,) * (len(t.shape) - 1))


def _replace(t: Any, rows: Any, healthy: Any, stop: bool = False) -> Any:
    """`t` with its `rows` (float tensors) replaced by row `healthy`."""
    if not _is_float(t) or len(t.shape) == 0:
        return t
    source = ops.take(t, ops.reshape(healthy, (1,)), axis=0)
    if stop:
        source = ops.stop_gradient(source)
    return ops.where(_rows_of(rows, t), source, t)


def _weights(sample_weight: Any, keep: Any, scale: Any) -> Any:
    """The sample weights: 0 where not `keep`, times `scale` if given."""

    def one(w: Any) -> Any:
        w = ops.where(_rows_of(keep, w), w, ops.zeros_like(w))
        return w if scale is None else w * ops.cast(scale, w.dtype)

    if sample_weight is None:
        sample_weight = ops.cast(keep, keras.config.floatx())
        return sample_weight if scale is None else sample_weight * scale
    return keras.tree.map_structure(one, sample_weight)


# ---------------------------------------------------------------- the loss
def _loss_functions(model: keras.Model) -> Any:
    """The compiled loss as per-sample functions, in the structure of
    `compile(loss=...)`; `None` when they are not known (no compiled loss, a
    `compute_loss` of the model's own)."""
    if type(model).compute_loss is not keras.Model.compute_loss:
        return None
    loss = getattr(model, "loss", None)
    if loss is None:
        return None
    if isinstance(loss, dict):
        return {k: _per_sample(v) for k, v in loss.items()}
    if isinstance(loss, list | tuple):
        return [_per_sample(v) for v in loss]
    return _per_sample(loss)


def _per_sample(loss: Any) -> Callable[[Any, Any], Any] | None:
    """One loss as a function of `(y_true, y_pred)` giving a value per sample
    (unreduced), computed in the loss's dtype (float32 under mixed
    precision, as Keras does)."""
    if loss is None:
        return None
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        dtype, call = loss.dtype or "float32", loss.call
    elif callable(loss):
        dtype, call = "float32", loss
    else:
        return None

    def per_sample(y_true: Any, y_pred: Any) -> Any:
        y_pred = ops.cast(y_pred, dtype)
        if _is_float(y_true):
            y_true = ops.cast(y_true, dtype)
        return call(y_true, y_pred)

    return per_sample


def _per_sample_losses(model: keras.Model, y: Any, y_pred: Any) -> list[Any] | None:
    """The per-sample loss values of the compiled loss on `(y, y_pred)`, one
    tensor per output; `None` when they are not known."""
    fns = _loss_functions(model)
    if fns is None or y is None:
        return None
    pairs: list[tuple[Any, Any, Any]]
    if isinstance(fns, dict):
        if not (isinstance(y, dict) and isinstance(y_pred, dict)):
            return None
        pairs = [(f, y.get(k), y_pred.get(k)) for k, f in fns.items()]
    elif isinstance(fns, list):
        ys, preds = keras.tree.flatten(y), keras.tree.flatten(y_pred)
        if len(ys) != len(fns) or len(preds) != len(fns):
            return None
        pairs = list(zip(fns, ys, preds, strict=True))
    else:
        if not ops.is_tensor(y_pred) and not hasattr(y_pred, "shape"):
            return None
        pairs = [(fns, y, y_pred)]
    losses = [f(t, p) for f, t, p in pairs if f is not None and t is not None]
    losses = [v for v in losses if len(v.shape) >= 1]
    return losses or None


def _scales(model: keras.Model) -> bool:
    """Whether the compiled loss divides by the batch (so that the healthy
    rows' weights are scaled by `batch / healthy`); not for `"sum"`, nor
    when the loss is the model's own."""
    fns = _loss_functions(model)
    if fns is None:
        return False
    loss = model.loss
    losses = loss.values() if isinstance(loss, dict) else keras.tree.flatten(loss)
    return all(
        getattr(one, "reduction", "sum_over_batch_size") in _SCALED
        for one in losses
        if one is not None
    )


# ---------------------------------------------------------------- wrapping
def _unquarantined(model: keras.Model, name: str) -> Any:
    """`model.<name>` without a quarantine's wrapper (an earlier one's)."""
    if isinstance(patches.owner_of(model, name), Quarantine):
        return patches.original_of(model, name)
    return getattr(model, name)
