"""NaNGuard's answers: records an incident, and acts on trouble as the
policy says (roll back, stop, raise or warn); with the learning rate
lowered after a rollback and the incident's batch replayed (`replay`).

It reads and changes the model, so it runs on the training thread only:
at `on_train_batch_begin` (which Keras always calls there), at
`on_epoch_end` and `on_train_end` (after Keras has waited for its batch-end
workers), and at `on_train_batch_end` when Keras calls that there too
(TensorFlow, or another callback that is not async-safe).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NoReturn

import keras
import numpy as np

from keras_nanguard import _rates as rates
from keras_nanguard import snapshots
from keras_nanguard._arguments import Arguments
from keras_nanguard.errors import NonFiniteError
from keras_nanguard.flight.reading import RunDiagnosis
from keras_nanguard.incidents import Incident, diagnose_batch
from keras_nanguard.nan_guard.batch_watch import Event
from keras_nanguard.nan_guard.fit_state import FitState
from keras_nanguard.nan_guard.reporting import IncidentLog
from keras_nanguard.nan_guard.snapshotting import SnapshotKeeper, Snapshotter


class Responses:
    """Records incidents in `log` and answers trouble by `settings.policy`,
    restoring `keeper`'s rollback point through `snapshotter`.

    `report` gives the guard's report (for `NonFiniteError`); `write_report`
    rewrites its report file, after each incident and each action.
    """

    def __init__(
        self,
        settings: Arguments,
        state: FitState,
        log: IncidentLog,
        keeper: SnapshotKeeper,
        snapshotter: Snapshotter,
        report: Callable[[], dict[str, Any]],
        write_report: Callable[[], None],
    ) -> None:
        self.settings, self.state, self.log = settings, state, log
        self.keeper, self.snapshotter = keeper, snapshotter
        self.report, self.write_report = report, write_report

    def record(
        self,
        ev: Event | None,
        kind: str,
        detail: str,
        variables: list[str],
        grad_norm: float | None = None,
        step: int | None = None,
    ) -> None:
        """Records an incident: a batch's (`ev`), or one found at an epoch's
        end or in a snapshot (`ev` is `None`, `batch` is -1, `step` the
        snapshot's or by default the step training is at)."""
        state, settings = self.state, self.settings
        loss = None if ev is None else ev.logs.get("loss")
        inc = Incident(
            fit=state.fit,
            epoch=state.epoch if ev is None else ev.epoch,
            step=(state.now if step is None else step) if ev is None else ev.step,
            batch=-1 if ev is None else ev.batch,
            kind=kind,
            detail=detail,
            steps=1 if ev is None or ev.batch < 0 else ev.steps,
            loss=None if loss is None else float(loss),
            grad_norm=grad_norm,
            variables=list(variables),
        )
        if settings.replay is not None and ev is not None and ev.batch >= 0:
            inc.batch_data, bad = replay_batches(
                settings.replay, settings.batch_size, ev.batch, ev.batch + ev.steps - 1
            )
            if bad is not None:  # the bad one of the execution is known
                inc.batch, inc.step, inc.steps = bad, ev.step + bad - ev.batch, 1
        self.log.add(inc, opens=ev is not None and ev.batch >= 0)
        if inc.batch_data is not None:
            snapshots.sync_from_device(state.model)
            diagnose_batch(inc, state.model)
        self.write_report()  # told once its action is known (`reporting`)

    def divergence_warning(self, found: RunDiagnosis) -> None:
        """Records the early warning `found` (never trouble); with
        `early_warning="act"` under `policy="rollback"` it lowers the
        learning rate by `lr_factor` now, before anything is non-finite."""
        stall = found.cause == "stalled"
        detail = "the run stopped learning" if stall else f"{found.cause} predicted"
        if found.onset_step is not None:
            detail += f" (onset at optimizer step {found.onset_step})"
        detail += ": " + " ".join(found.evidence)
        self.record(
            None, "stall_warning" if stall else "divergence_warning", detail, []
        )
        inc = self.log.last
        inc.diagnosis = found
        inc.action = "recorded"
        # A lower rate does not restart a stalled run.
        early = self.settings.early_warning
        if stall or early != "act" or self.settings.policy != "rollback":
            return
        optimizer = self.state.model.optimizer
        lowered = lower_learning_rates(
            {"optimizer": optimizer}, self.settings.lr_factor
        )
        if lowered:
            inc.learning_rate = next(iter(lowered.values()))
            inc.action = "lowered the" + lowered_words(lowered).removeprefix(",")
        else:
            inc.action = "recorded" + not_lowered(optimizer)

    def trouble(self) -> None:
        """Acts on the newest incident, which is trouble."""
        inc, policy = self.log.last, self.settings.policy
        if policy == "warn":
            inc.action = "warned"  # warned once, by `reporting`
            return
        self.keeper.drop_pending()  # not yet proven by a healthy batch
        point = self.keeper.point
        if point is None:  # see `Snapshotter.start`
            self._raise_without_rollback_point(inc)
        self.snapshotter.restore()
        self.state.resumed_at = self.state.now
        where = f"restored the snapshot of epoch {point.epoch}, step {point.step}"
        if policy == "raise":
            inc.action = where + ", raised NonFiniteError"
            self.write_report()
            raise NonFiniteError(f"NaNGuard: {inc}", report=self.report())
        if policy == "rollback" and self.keeper.may_roll_back(self.settings.patience):
            self._roll_back(inc, point, where)
        else:
            self._stop(inc, where)

    def _raise_without_rollback_point(self, inc: Incident) -> NoReturn:
        inc.action = "raised NonFiniteError: no good state to restore"
        self.write_report()
        raise NonFiniteError(
            f"NaNGuard: {inc} There is no good state to go back to: the "
            "model was built by `fit`, so NaNGuard could take its first "
            "snapshot only after the first step, and no healthy step has "
            "proven that state since (a first step can be finite and still "
            "ruinous). Build the model before `fit` (`keras.Input` or "
            "`model.build(input_shape)`) so that the state training starts "
            "from is the rollback point.",
            report=self.report(),
        )

    def _roll_back(self, inc: Incident, point: snapshots.Snapshot, where: str) -> None:
        """Goes on from the restored rollback point, with the learning rate
        lowered by `lr_factor` and the next `skip_batches` batches to undo."""
        settings, state = self.settings, self.state
        self.keeper.rolled_back()
        inc.action = "rolled back: " + where
        optimizers = trained_by(state.model)
        lowered = lower_learning_rates(optimizers, settings.lr_factor)
        if lowered:
            inc.learning_rate = next(iter(lowered.values()))
            inc.action += lowered_words(lowered)
            self.snapshotter.save(point)  # the rate to go on with
        elif settings.lr_factor < 1:  # a schedule
            inc.action += not_lowered(next(iter(optimizers.values())))
        skip = settings.skip_batches
        until = state.now + skip
        state.discard_until = until if skip else None
        self.reset_metrics(state.now, until, restored=True)
        if skip:
            inc.action += f", discarding the next {skip} batches"

    def _stop(self, inc: Incident, where: str) -> None:
        state = self.state
        state.model.stop_training = True
        state.stopping = True  # the batch in flight is undone at the epoch end
        self.reset_metrics(state.now, math.inf, restored=True)
        inc.action = where + ", stopped training"
        if self.settings.policy == "rollback":
            rollbacks = self.keeper.rollbacks_since
            inc.action += f" after {rollbacks} rollbacks without recovery"

    def reset_metrics(
        self, step: int, leave_out_until: float | None = None, restored: bool = False
    ) -> None:
        """Starts Keras's running means afresh before `step`; the batch-end
        side leaves the batches before `leave_out_until` out of the figures
        (by default those a restore undid; see `BatchWatch.metrics_reset`)
        and, if the snapshot was `restored`, counts rejections in a row
        afresh from `step`: the restore resets the streak."""
        if restored and leave_out_until is None:
            leave_out_until = step
        state = self.state
        snapshots.sync_from_device(state.model)
        state.model.reset_metrics()
        with state.lock:
            state.watch.metrics_reset(step, leave_out_until, restored)


# NaNGuard and the learning rate: lowering it at a rollback, and saying so
# when it cannot.
#
# A rate held in a variable is multiplied by `lr_factor`. A schedule (or a
# callable) is left as it is: the optimizer computes the rate from it at every
# step, on TensorFlow in a traced function that captured it, so no public API
# lowers it in place. NaNGuard says so, in the incident's action and in a
# warning when training begins.


def lower_learning_rate(optimizer: Any, factor: float) -> tuple[float, float] | None:
    """Multiplies a variable learning rate by `factor`; returns the rate
    before and after, or `None` if nothing changed (`factor` 1, a schedule).
    `optimizer` owns one rate (see `_rates.rate_owners`)."""
    lr = optimizer.learning_rate
    if factor == 1 or not isinstance(lr, keras.Variable):
        return None
    old = float(keras.ops.convert_to_numpy(lr))
    lr.assign(old * factor)
    return old, float(keras.ops.convert_to_numpy(lr))


def trained_by(model: keras.Model) -> dict[str, Any]:
    """The optimizers that train `model`, by the attribute holding them: the
    built ones of `snapshots.model_optimizers` (a GAN's `d_optimizer` and
    `g_optimizer`, not the default `compile()` left unused), or
    `model.optimizer` when none is built yet."""
    held = snapshots.model_optimizers(model)
    built = {name: opt for name, opt in held.items() if opt.built}
    if built:
        return built
    return {"optimizer": model.optimizer} if model.optimizer is not None else {}


def lower_learning_rates(
    optimizers: dict[str, Any], factor: float
) -> dict[str, tuple[float, float]]:
    """`lower_learning_rate` for each rate the optimizers train with (each
    sub-optimizer's of a MultiOptimizer): the rates it changed, by
    `_rates.label` (`optimizer`, `optimizer/sgd`)."""
    found = {
        rates.label(name, sub): lower_learning_rate(owner, factor)
        for name, opt in optimizers.items()
        for sub, owner in rates.rate_owners(opt).items()
    }
    return {name: lr for name, lr in found.items() if lr is not None}


def lowered_words(lowered: dict[str, tuple[float, float]]) -> str:
    """What an incident's action says of the rates `lower_learning_rates` changed."""
    if list(lowered) == ["optimizer"]:
        old, new = lowered["optimizer"]
        return f", learning rate {old:.3g} -> {new:.3g}"
    each = ", ".join(f"{k} {a:.3g} -> {b:.3g}" for k, (a, b) in lowered.items())
    return f", learning rates {each}"


def schedule_name(optimizer: Any) -> str | None:
    """The class name of the optimizer's learning-rate schedule, as its
    public config names it (of a MultiOptimizer, each sub-optimizer's that
    has one, by name); `None` when every rate is a variable."""
    if optimizer is None:
        return None
    names = []
    for sub, owner in rates.rate_owners(optimizer).items():
        if isinstance(owner.learning_rate, keras.Variable):
            continue
        try:
            config = owner.get_config().get("learning_rate")
        except Exception:  # a callable Keras cannot serialise
            config = None
        name = "a callable"
        if isinstance(config, dict) and config.get("class_name"):
            name = str(config["class_name"])
        names.append(f"{sub}: {name}" if sub else name)
    return ", ".join(names) or None


def not_lowered(optimizer: Any) -> str:
    """The words an incident's action ends with when `lower` could not."""
    return (
        ", the learning rate was not lowered: it is a schedule "
        f"({schedule_name(optimizer)})"
    )


def schedule_warning(optimizer: Any, factor: float) -> str | None:
    """The warning for `lr_factor` < 1 with a schedule, else `None`."""
    name = None if factor == 1 else schedule_name(optimizer)
    if name is None:
        return None
    return (
        f"NaNGuard: `lr_factor={factor:g}` cannot lower the learning rate: the "
        f"optimizer's is a schedule ({name}), which a rollback leaves as it is. "
        "Lower the schedule's rates yourself, or pass `lr_factor=1.0` to say "
        "a rollback should not lower the rate."
    )


# The batches of an incident, read back from the data `fit` was given.


def check_replay(name: str, data: Any) -> Any:
    """`data`, given as the argument `name`, if `batches` can read it: `None`,
    a `keras.utils.PyDataset`, `(x, y)` arrays of one length, or `x` alone
    (sliceable, with a length)."""
    if data is None or isinstance(data, keras.utils.PyDataset):
        return data
    pair = isinstance(data, tuple | list)
    message = (
        f"`{name}` must be `(x, y)` arrays, `x` alone, a keras.utils.PyDataset "
        f"or None. Received: {name}={data!r:.200}"
    )
    if pair and len(data) != 2:
        raise ValueError(message)
    if not all(map(_sliceable, data if pair else [data])):
        raise TypeError(message)
    if pair and len(data[0]) != len(data[1]):
        raise ValueError(
            f"`{name}` must be `(x, y)` arrays of the same length. Received: "
            f"len(x)={len(data[0])}, len(y)={len(data[1])}"
        )
    return data


def _sliceable(value: Any) -> bool:
    return (
        hasattr(value, "__len__")
        and hasattr(value, "__getitem__")
        and not isinstance(value, str | bytes | dict)
    )


def replay_batches(
    data: Any, batch_size: int, first: int, last: int
) -> tuple[Any, int | None]:
    """The replay data of batches `first` to `last` of an epoch (one execution
    with `steps_per_execution > 1`), and the index of the bad one when it is
    knowable.

    When exactly one of the batches holds a NaN or inf, only that batch is
    returned, with its index; otherwise all of them, concatenated, and
    `None`. `(None, None)` when the data has no such batch.
    """
    items = []
    for i in range(first, last + 1):
        item = _batch(data, batch_size, i)
        if item is None:
            break
        items.append(item)
    if not items:
        return None, None
    bad = [i for i, item in enumerate(items) if not _finite(item)]
    if len(bad) == 1:
        return items[bad[0]], first + bad[0]
    if len(items) == 1:
        return items[0], None
    return keras.tree.map_structure(lambda *a: np.concatenate(a), *items), None


def _batch(data: Any, batch_size: int, index: int) -> Any:
    if isinstance(data, keras.utils.PyDataset):
        return data[index] if index < len(data) else None
    x, y = data if isinstance(data, tuple | list) else (data, None)
    lo = index * batch_size
    if lo >= len(x):
        return None
    sl = slice(lo, lo + batch_size)
    return (x[sl],) if y is None else (x[sl], y[sl])


def _finite(item: Any) -> bool:
    for value in keras.tree.flatten(item):
        array = np.asarray(value)
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            return False
    return True


def replay_positions(
    data: Any, batch_size: int, rows: list[tuple[int, int]]
) -> list[int | None]:
    """The indices in `data` (read in order, as `batches` does) of the rows
    `(batch, row)`; `None` without data or past its end. A PyDataset's
    batches are taken to be as long as its first one, but for the last."""
    if data is None:
        return [None] * len(rows)
    if isinstance(data, keras.utils.PyDataset):
        count = len(data)
        size = _rows(data[0]) if count else 0
        last = _rows(data[count - 1]) if count else 0
        return [
            batch * size + row
            if batch < count and row < (last if batch == count - 1 else size)
            else None
            for batch, row in rows
        ]
    x = data[0] if isinstance(data, tuple | list) else data
    out: list[int | None] = []
    for batch, row in rows:
        index = batch * batch_size + row
        out.append(index if row < batch_size and index < len(x) else None)
    return out


def _rows(item: Any) -> int:
    """The rows of a batch: the length of its first array."""
    return len(keras.tree.flatten(item)[0])
