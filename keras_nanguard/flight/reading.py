"""Why a run diverged, from its flight record: `diagnose_run` and `warning`.

Each cause of `RUN_CAUSES` has a decisive signal, an *onset* threshold (where
the signal has begun to drift) and a *warning* threshold (where the run is
predicted to fail). `diagnose_run` names the cause of a run that went wrong (a
rejected step), or whose trajectory predicts it will; `warning` is the same
reading made during training, on what has been recorded so far, before any
step went wrong. Both are pure functions of the record: they never touch the
model or the optimizer.

The thresholds, and why (healthy runs of the corpus in brackets):

- update-to-weight ratio (largest over the layers, at probes): onset 0.05,
  warning when 2 of the last 3 probes are above 0.05 and the loss has gone
  up to 10 times its lowest [healthy: <= 0.03; early training of small
  models at a high workable rate reaches 0.2, its loss falling]; after a
  failure, the cause when one of the last 2 probes was above 0.05 with the
  loss climbing, or one was 0.5 or more (a step that moved the weights by
  half their norm: Adam's first step at a rate 1000x too high);
- the optimizer's smallest denominator `sqrt(v) + epsilon`: onset 1e-9 (named
  the cause only when the first bad step is a non-finite update),
  warning 1e-12 [healthy: >= epsilon, 1e-7 for Keras's Adam];
- the smallest probability of a softmax output: onset 1e-10, warning 1e-14
  (float32's `exp` underflows to exactly 0 near 1e-45) [healthy: >= 1e-8],
  unless the loss is converging (positive, its level a tenth of its first
  or less, as medians of probes): a confident classifier's smallest
  probability is that small too;
- the largest input magnitude: unnormalised at 50 and above (a warning
  with a gradient norm of 100 or more, or a high update ratio);
- the output's magnitude over the input's at the first probe: 100 and above
  is a net that amplifies its input layer by layer [healthy: <= 10];
- a recurrent kernel's gradient norm: the largest block's, and 4 times its
  median so far;
- the gradient norm of the last steps at 1000 times its median: an explosion
  under way, whatever the cause [healthy loss spike: 15x].
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from keras_nanguard.flight.record import FlightRecord
from keras_nanguard.flight.recorder import (
    PROB_WARN,
    RATIO_ONSET,
    STATE_WARN,
    Reason,
)

#: The run-level causes `diagnose_run` names: cause -> what it means.
RUN_CAUSES: dict[str, str] = {
    "learning_rate_too_high": (
        "the updates are too large for the weights: the update-to-weight "
        "ratio climbed (a warm-up or schedule too high, a rate that does not "
        "fit the model)"
    ),
    "bad_data": (
        "a few batches with non-finite or outlying values in an otherwise healthy run"
    ),
    "input_scale": "the inputs are not normalised (values of 50 and more)",
    "activation_growth": (
        "the initialisation or the activation lets values grow layer by layer: "
        "the model's outputs are far larger than its inputs from the start"
    ),
    "policy_collapse": (
        "a softmax saturates: some probabilities reach exactly 0, and log(0) is -inf"
    ),
    "optimizer_state": (
        "an optimizer state variable drifted to an extreme: a second moment "
        "far below epsilon makes the update m / (sqrt(v) + epsilon) overflow"
    ),
    "exploding_recurrence": (
        "gradients grow through time in a recurrent layer: its recurrent "
        "kernel's gradient dominates and climbs"
    ),
    "stalled": (
        "the run stopped learning while finite: the updates vanished (a "
        "schedule decayed to zero, updates rounded away in low precision, "
        "gradients clipped to nothing): the weights no longer move"
    ),
    "unknown": "the run went wrong, and no recorded signal explains it",
    "healthy": "nothing is wrong",
}

RUN_HINTS: dict[str, list[str]] = {
    "learning_rate_too_high": [
        "Lower the learning rate (or the warm-up's peak) 3-10x; the update-to-"
        "weight ratio should stay near 1e-3.",
        "Clip gradients: SafeOptimizer(..., clipnorm=1.0).",
        "Or let SafeOptimizer back off: SafeOptimizer(..., lr_backoff=0.5).",
    ],
    "bad_data": [
        "Find the bad rows (NaNGuard(replay=...) names the batch; "
        "NaNGuard(quarantine=True) leaves them out and lists them).",
        "Validate the input pipeline: drop or impute non-finite values.",
    ],
    "input_scale": [
        "Normalise the inputs (keras.layers.Normalization, or scale pixels to [0, 1]).",
        "Until then, a much lower learning rate.",
    ],
    "activation_growth": [
        "Use an initialisation that fits the activation (He for ReLU: "
        "kernel_initializer='he_normal'), or smaller weights.",
        "Add normalisation (BatchNormalization, LayerNormalization) between layers.",
    ],
    "policy_collapse": [
        "Compute log-probabilities in log space: ng.StableSoftmax(log_probs="
        "True), or ng.ops.policy_log_prob(logits, actions), never "
        "log(softmax(x)).",
        "Add an entropy bonus to the loss, normalise the advantages, cap the "
        "logits (ng.StableSoftmax(soft_cap=30.0)).",
    ],
    "optimizer_state": [
        "Keep the optimizer's epsilon at its default (1e-7) or larger; "
        "epsilon=0 divides by sqrt(v), which decays to 0 for a parameter "
        "whose gradient stays 0.",
        "A larger beta_2 (0.999) makes the second moment decay slower.",
    ],
    "exploding_recurrence": [
        "Clip gradients (SafeOptimizer(..., clipnorm=1.0)); a gated cell "
        "(LSTM, GRU) or an orthogonal recurrent initialisation with gain < 1.",
        "Shorter sequences (truncated backpropagation through time).",
    ],
    "stalled": [
        "Check the learning rate the steps use (the record's learning_rate "
        "column): a schedule that decays to zero long before the run ends "
        "stops it.",
        "Variables in bfloat16 or float16 round small updates away: keep "
        "the weights and the optimizer in float32 "
        "(keras.mixed_precision.set_global_policy('mixed_bfloat16')).",
        "A clipnorm far below the gradients' norm scales every update to "
        "nothing: clip at about the gradients' median norm (the record's "
        "grad_norm column).",
    ],
    "unknown": [
        "Run ng.diagnose(model, x, y) on the batch that failed (NaNGuard("
        "replay=...) keeps it): it names the layer and the cause.",
    ],
    "healthy": [],
}

# (RATIO_ONSET, STATE_WARN and PROB_WARN are the device alarm's too.)
RATIO_RUINOUS = 0.5
STATE_ONSET = 1e-9
PROB_ONSET = 1e-10
INPUT_UNNORMALISED = 50.0
LARGE_GRADIENT = 100.0
AMPLIFICATION = 100.0
RECURRENT_GROWTH = 4.0
EXPLOSION = 1000.0
WORSENING = 10.0
# Stalls: a run of STALL_STEPS steps or more whose last half has every
# probe's largest update-to-weight ratio below FROZEN (the weights do not
# move), its loss not tenfold below its first level. (A loss that stays
# where it started while the weights move was tried as a second sign and
# dropped: targets that drift, and a recurrence training slowly before it
# explodes, look the same.)
STALL_STEPS = 200
FROZEN = 1e-7
# Causes that are named only when no other fits (then reported as what the
# other drove): a saturated softmax, which updates too large, unnormalised
# inputs or a growing activation bring about as well.
SYMPTOMS = ("policy_collapse",)


@dataclasses.dataclass
class RunDiagnosis:
    """Why a run diverged (or is about to), from its recorded trajectory.

    Attributes:
        cause: a `RUN_CAUSES` name.
        onset_step: the optimizer step where the decisive signal began to
            drift (None for a healthy run).
        first_bad_step: the first rejected step (None if none).
        steps_from_onset: `first_bad_step - onset_step`, as found after the
            fact (None unless both).
        warned_at_step: the last step recorded when NaNGuard's early warning
            was given (None when none was: a record read on its own, a
            guard with `early_warning=False`, a run that failed unwarned).
        lead_steps: the warning's lead, `first_bad_step - warned_at_step`
            (None unless both).
        evidence: the signal's values, in words to check against the curves.
        hints: what to change.
        signal: the column the evidence is read from.
        at_step: the last optimizer step recorded when it was made.
        confidence: `"high"`, or `"low"` when other causes fit the record
            from the same step (`candidates`, their evidence in `evidence`
            too): no one of them is picked.
        candidates: the other causes of a low-confidence diagnosis.
        consequences: what the cause drove later, in words (a softmax
            saturating under updates too large): symptoms, not causes.

    Example:

    >>> import keras_nanguard as ng
    >>> found = ng.RunDiagnosis("bad_data", onset_step=61, first_bad_step=61)
    >>> print(str(found).splitlines()[0])
    Run diagnosis: bad_data (a few batches with non-finite or outlying values in an otherwise healthy run).
    >>> found.to_dict()["cause"]
    'bad_data'
    """

    cause: str
    onset_step: int | None = None
    first_bad_step: int | None = None
    steps_from_onset: int | None = None
    evidence: list[str] = dataclasses.field(default_factory=list)
    hints: list[str] = dataclasses.field(default_factory=list)
    signal: str | None = None
    at_step: int | None = None
    warned_at_step: int | None = None
    lead_steps: int | None = None
    confidence: str = "high"
    candidates: list[str] = dataclasses.field(default_factory=list)
    consequences: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        if self.confidence == "low":
            named = " or ".join([self.cause, *self.candidates])
            lines = [
                f"Run diagnosis (low confidence): {named}; the record fits "
                "each of them from the same step, the evidence for each below."
            ]
            lines += [
                f"  {c}: {RUN_CAUSES[c]}." for c in [self.cause, *self.candidates]
            ]
        else:
            lines = [f"Run diagnosis: {self.cause} ({RUN_CAUSES[self.cause]})."]
        if self.first_bad_step is not None:
            lines.append(f"  First bad step: {self.first_bad_step}.")
        if self.onset_step is not None:
            before = _steps_before(self.steps_from_onset)
            lines.append(f"  Onset: step {self.onset_step}{before}.")
        if self.warned_at_step is not None:
            before = _steps_before(self.lead_steps)
            lines.append(f"  Warned at step {self.warned_at_step}{before}.")
        elif self.first_bad_step is not None and self.onset_step is not None:
            lines.append("  No warning was given before the first bad step.")
        lines += [f"  - {e}" for e in self.evidence]
        if self.consequences:
            lines.append("  What followed from it:")
            lines += [f"  - {c}" for c in self.consequences]
        if self.hints:
            lines.append("  What to do:")
            lines += [f"  - {h}" for h in self.hints]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def warned(self, at_step: int | None) -> RunDiagnosis:
        """This diagnosis with the early warning given at `at_step` (None:
        none was), and so its lead."""
        lead = None
        if at_step is not None and self.first_bad_step is not None:
            lead = self.first_bad_step - at_step
        return dataclasses.replace(self, warned_at_step=at_step, lead_steps=lead)


def _steps_before(steps: int | None) -> str:
    if steps is None:
        return ""
    return f", {steps} step{'' if steps == 1 else 's'} before the first bad step"


# --------------------------------------------------------------- the signals
@dataclasses.dataclass
class _Signals:
    """The record's signals, as the rules read them."""

    record: FlightRecord
    steps: np.ndarray
    probe_steps: np.ndarray
    ratio: np.ndarray  # per probe: the largest update-to-weight ratio
    ratio_block: np.ndarray  # per probe: the block it is of
    state: np.ndarray
    min_prob: np.ndarray
    entropy: np.ndarray
    inputs: np.ndarray
    outputs: np.ndarray
    grad: np.ndarray
    probe_loss: np.ndarray  # per probe: the loss (NaN where not observed)
    probe_grad: np.ndarray  # per probe: the gradient norm
    blocks: np.ndarray  # per step: the gradient norm of each block
    bad_reason: Reason | None = None  # why the first bad step was rejected

    @classmethod
    def of(cls, record: FlightRecord, bad_reason: Reason | None = None) -> _Signals:
        probes = record.probes()
        with np.errstate(all="ignore"):
            ratios = probes.block("update_norm") / probes.block("weight_norm")
        ratios = np.where(np.isfinite(ratios), ratios, -1.0)
        best = ratios.argmax(axis=1) if ratios.size else np.zeros(0, int)
        top = ratios.max(axis=1) if ratios.size else np.zeros(0)
        return cls(
            record=record,
            steps=record.column("step"),
            probe_steps=probes.column("step"),
            ratio=np.where(top < 0, np.nan, top),
            ratio_block=best,
            state=probes.column("state_min"),
            min_prob=probes.column("min_prob"),
            entropy=probes.column("entropy"),
            inputs=probes.column("input_max"),
            outputs=probes.column("output_max"),
            grad=record.column("grad_norm"),
            probe_loss=probes.column("loss"),
            probe_grad=probes.column("grad_norm"),
            blocks=record.block("grad_norm"),
            bad_reason=bad_reason,
        )


def _first(steps: np.ndarray, flags: np.ndarray) -> int | None:
    hits = np.flatnonzero(flags)
    return int(steps[hits[0]]) if len(hits) else None


def _last_stretch(steps: np.ndarray, flags: np.ndarray) -> int | None:
    """The step where the last stretch of `flags` (up to the end, or the
    last one before it) began."""
    hits = np.flatnonzero(flags)
    if not len(hits):
        return None
    gaps = np.flatnonzero(np.diff(hits) > 1)
    start = hits[gaps[-1] + 1] if len(gaps) else hits[0]
    return int(steps[start])


def _g(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.3g}"


# ----------------------------------------------------------------- the rules
# Each rule reads the signals before the first bad step and returns
# (onset_step, evidence, signal) when its cause fits, else None; `warn` says
# whether only the warning thresholds count (the run has not failed yet).
def _optimizer_state(s: _Signals, warn: bool) -> tuple | None:
    v = s.state
    if not np.isfinite(v).any():
        return None
    # After a failure: a denominator below the warning threshold, or below
    # the onset one with the update the step that failed.
    if warn or s.bad_reason is not Reason.UPDATE:
        low = v < STATE_WARN
    else:
        low = v < STATE_ONSET
    # Large updates from a tiny denominator are this cause, not the rate.
    tiny_and_large = (v < STATE_ONSET) & (np.nan_to_num(s.ratio) > RATIO_ONSET)
    if not (low.any() or (warn and tiny_and_large.any())):
        return None
    onset = _first(s.probe_steps, v < STATE_ONSET)
    first = v[np.isfinite(v)][0]
    return (
        onset,
        [
            "The optimizer's smallest second-moment denominator sqrt(v) + "
            f"epsilon fell from {_g(first)} (step {int(s.probe_steps[0])}) to "
            f"{_g(v[-1])} (step {int(s.probe_steps[-1])}): an update "
            "m / (sqrt(v) + epsilon) that large a multiplier overflows."
        ],
        "state_min",
    )


def _policy_collapse(s: _Signals, warn: bool) -> tuple | None:
    p = s.min_prob
    if not np.isfinite(p).any() or _converging(s):
        return None
    low = p < (PROB_WARN if warn else PROB_ONSET)
    if not low.any():
        return None
    onset = _first(s.probe_steps, p < PROB_ONSET)
    finite = np.isfinite(p)
    h = s.entropy[np.isfinite(s.entropy)]
    entropy = "" if not len(h) else f"; the mean entropy from {_g(h[0])} to {_g(h[-1])}"
    return (
        onset,
        [
            f"The smallest softmax probability fell from {_g(p[finite][0])} to "
            f"{_g(p[finite][-1])} (step {int(s.probe_steps[finite][-1])}){entropy}: "
            "the policy is saturating to exact 0/1."
        ],
        "min_prob",
    )


def _input_scale(s: _Signals, warn: bool) -> tuple | None:
    x = s.inputs
    big = x >= INPUT_UNNORMALISED
    if not big.any():
        return None
    if warn and not (
        _exploding(s)
        or (np.nan_to_num(s.ratio) > RATIO_ONSET).any()
        or np.nanmax(s.grad, initial=0.0) >= LARGE_GRADIENT
    ):
        return None
    onset = _first(s.probe_steps, big)
    return (
        onset,
        [
            f"The inputs reach {_g(np.nanmax(x))} in magnitude (from step "
            f"{onset}): not normalised; the gradient norm was "
            f"{_g(s.grad[0])} at step {int(s.steps[0])}."
        ],
        "input_max",
    )


def _activation_growth(s: _Signals, warn: bool) -> tuple | None:
    # A recurrent kernel holding the largest gradient: growth through time
    # (`exploding_recurrence`), not layer by layer.
    if not len(s.probe_steps) or _recurrent_block(s) is not None:
        return None
    out, inp = s.outputs[0], s.inputs[0]
    if not (math.isfinite(out) and math.isfinite(inp)):
        return None
    gain = out / max(inp, 1.0)
    if gain < AMPLIFICATION:
        return None
    return (
        int(s.probe_steps[0]),
        [
            f"At step {int(s.probe_steps[0])} the model's outputs reach "
            f"{_g(out)} for inputs of {_g(inp)}: {gain:.0f} times larger, "
            "before any training could have made them so."
        ],
        "output_max",
    )


def _recurrent_block(s: _Signals) -> int | None:
    rec = [i for i, r in enumerate(s.record.recurrent) if r]
    if not rec or not len(s.steps):
        return None
    recent = np.nan_to_num(s.blocks[-8:], nan=0.0, posinf=0.0).max(axis=0)
    top = int(recent.argmax())
    return top if top in rec else None


def _exploding_recurrence(s: _Signals, warn: bool) -> tuple | None:
    top = _recurrent_block(s)
    if top is None:
        return None
    g = s.blocks[:, top]
    median = float(np.nanmedian(g))
    others = np.delete(s.blocks[-8:], top, axis=1)
    recent = float(np.nanmax(g[-4:]))
    if warn and not (
        recent >= RECURRENT_GROWTH * median
        and recent >= 2.0 * float(np.nanmax(others, initial=0.0))
    ):
        return None
    # The onset: where its last climb above twice its median began.
    calm = np.flatnonzero(g <= 2.0 * median)
    start = calm[-1] + 1 if len(calm) else 0
    start = min(start, len(g) - 1)
    name = s.record.blocks[top]
    return (
        int(s.steps[start]),
        [
            f"The recurrent kernel '{name}' holds the largest gradient norm "
            f"({_g(recent)} in the last steps, median {_g(median)}): gradients "
            "grow through time."
        ],
        f"grad_norm/{name}",
    )


def _learning_rate(s: _Signals, warn: bool) -> tuple | None:
    r = np.nan_to_num(s.ratio, nan=0.0)
    high = r > RATIO_ONSET
    if warn:
        if not ((high[-3:].sum() >= 2 and _worsening(s)) or _exploding(s)):
            return None
    # After a failure: high up to it, and the loss climbing (early training
    # at a high but workable rate, Adam's first steps above all, has high
    # ratios too, with a falling loss: a bad batch there is not the rate).
    elif not (
        (high[-2:].any() and _worsening(s))
        or (r[-2:] >= RATIO_RUINOUS).any()
        or _exploding(s)
    ):
        return None
    onset = _last_stretch(s.probe_steps, high)
    if onset is None:
        onset = _explosion_onset(s)
    evidence = []
    if high.any():
        i = int(np.flatnonzero(high)[0])
        block = s.record.blocks[int(s.ratio_block[i])]
        since = (
            f"was {_g(r[i])} from step {int(s.probe_steps[i])}"
            if i == 0
            else f"went from {_g(r[0])} at step {int(s.probe_steps[0])} to "
            f"{_g(r[i])} at step {int(s.probe_steps[i])}"
        )
        evidence.append(
            f"The update-to-weight ratio (largest, layer '{block}') {since}, "
            f"{_g(r.max())} at its highest (healthy training keeps it near 1e-3)."
        )
    lr = s.record.column("learning_rate")
    evidence.append(
        f"The learning rate went from {_g(lr[0])} to {_g(lr[-1])}; the gradient "
        f"norm from {_g(s.grad[0])} to {_g(s.grad[-1])}."
    )
    return onset, evidence, "update_norm / weight_norm"


def _worsening(s: _Signals) -> bool:
    """Whether training has stopped making progress: the last probe's loss
    (the gradient norm's, where no loss was observed) is 10 times the
    smallest so far, or not finite. Early training at a high but workable
    rate has high update ratios too, with a falling loss."""
    loss = s.probe_loss
    values = loss if np.isfinite(loss).any() else s.probe_grad
    if len(values) < 2:
        return False
    last = values[-1]
    best = np.nanmin(values) if np.isfinite(values).any() else np.nan
    return bool(not np.isfinite(last) or last >= WORSENING * max(best, 1e-12))


def _converging(s: _Signals) -> bool:
    """Whether the observed loss is positive and its level (the median of
    the last 5 probes) a tenth of its first (of the first 3) or less: a
    confident classifier learning its task. Its smallest softmax
    probability falls below 1e-14 as it should; that is not a policy
    collapsing, and its loss (Keras clips probabilities) cannot reach
    log(0)."""
    loss = s.probe_loss[np.isfinite(s.probe_loss)]
    if len(loss) < 8 or (loss <= 0).any():
        return False
    # Medians: a batch's loss is noisy, most of all once the task is learnt
    # (one wrong row in a batch of 32 is a loss of 0.1 among 0.001s).
    early, recent = float(np.median(loss[:3])), float(np.median(loss[-5:]))
    return recent <= early / WORSENING


def _exploding(s: _Signals) -> bool:
    """Whether the gradient norm of the last steps is an explosion under way."""
    g = s.grad[np.isfinite(s.grad)]
    if len(g) < 8:
        return False
    return bool(g[-4:].max() >= EXPLOSION * np.median(g))


def _explosion_onset(s: _Signals) -> int | None:
    g = s.grad
    median = np.nanmedian(g)
    calm = np.flatnonzero(g <= 10.0 * median)
    if not len(calm):
        return int(s.steps[0]) if len(s.steps) else None
    return int(s.steps[min(calm[-1] + 1, len(g) - 1)])


RULES = (
    ("optimizer_state", _optimizer_state),
    ("policy_collapse", _policy_collapse),
    ("input_scale", _input_scale),
    ("activation_growth", _activation_growth),
    ("exploding_recurrence", _exploding_recurrence),
    ("learning_rate_too_high", _learning_rate),
)


# ------------------------------------------------------------------ entry
def first_bad_step(record: FlightRecord) -> int | None:
    """The first rejected step of the record (None if none)."""
    rejected = record.column("accepted") == 0
    return _first(record.column("step"), rejected)


def diagnose_run(record: FlightRecord) -> RunDiagnosis:
    """The run diagnosis of `record` (see the module).

    Every rule is read; the cause is the one whose signal drifted first,
    the causes that fit later are reported as what followed from it, and
    causes that fit from the same step make a low-confidence diagnosis that
    names them all.

    Example:

    >>> import keras, keras_nanguard as ng
    >>> from keras_nanguard.flight import diagnose_run
    >>> opt = ng.SafeOptimizer(keras.optimizers.SGD(0.001))
    >>> opt.build([keras.Variable([1.0])])
    >>> for g in (1.0, float("nan")):
    ...     opt.apply([keras.ops.convert_to_tensor([g])])
    >>> found = diagnose_run(opt.flight_record())
    >>> (found.cause, found.first_bad_step)
    ('bad_data', 2)
    """
    bad = first_bad_step(record)
    before = record.before(bad)
    reason = None
    if bad is not None:
        row = record.column("step") == bad
        reason = Reason(int(record.column("reason")[row][0]))
        # A non-finite update from a zero denominator, at once (epsilon=0
        # and a gradient that stays 0): the failing probe row says so.
        state = record.column("state_min")[row][0]
        if reason is Reason.UPDATE and state < STATE_ONSET:
            evidence = [
                f"Step {bad}'s update was not finite with the optimizer's "
                f"smallest denominator sqrt(v) + epsilon at {_g(float(state))}: "
                "m / (sqrt(v) + epsilon) divides by zero."
            ]
            return _diagnosis("optimizer_state", bad, bad, evidence, "state_min")
    if not len(before):
        return _diagnosis("unknown" if bad is not None else "healthy", bad, None)
    s = _Signals.of(before, reason)
    fits = []
    for order, (cause, rule) in enumerate(RULES):
        found = rule(s, bad is None)
        if found is not None:
            fits.append((cause, order, *found))
    if fits:
        return _of_fits(fits, bad)
    if bad is None:
        stall = _stalled(s)
        if stall is not None:
            return _diagnosis("stalled", None, *stall)
        return _diagnosis("healthy", None, None)
    # Trouble with no drift before it: bad data, if the steps before were calm.
    words = reason.words if reason is not None else "a rejection"
    g = s.grad[np.isfinite(s.grad)]
    calm = len(g) == 0 or g[-8:].max() < 10.0 * np.median(g)
    if calm:
        evidence = [
            f"Step {bad} was rejected for {words} with no drift before it: the "
            f"gradient norm was {_g(g[-1]) if len(g) else 'nan'} the step "
            f"before (median {_g(float(np.median(g))) if len(g) else 'nan'}), "
            "the update-to-weight ratio and the outputs steady."
        ]
        return _diagnosis("bad_data", bad, bad, evidence, "grad_norm")
    return _diagnosis(
        "unknown",
        bad,
        bad,
        [f"Step {bad} was rejected for {words}; no recorded signal explains it."],
    )


def _of_fits(fits: list[tuple], bad: int | None) -> RunDiagnosis:
    """The diagnosis of the causes that fit, `(cause, order, onset,
    evidence, signal)` each: the first to drift is the cause (a symptom
    only when nothing else fits), the later ones what followed, the ones
    from the same step candidates of a low-confidence diagnosis."""

    def when(fit: tuple) -> tuple:
        symptom = fit[0] in SYMPTOMS and len(fits) > 1
        onset = fit[2] if fit[2] is not None else math.inf
        return (symptom, onset, fit[1])

    ordered = sorted(fits, key=when)
    cause, _, onset, evidence, signal = ordered[0]
    found = _diagnosis(cause, bad, onset, evidence, signal)
    for other, _, other_onset, other_evidence, _ in ordered[1:]:
        if other not in SYMPTOMS and other_onset == onset:
            found.candidates.append(other)
            found.evidence += other_evidence
            found.hints += [h for h in RUN_HINTS[other] if h not in found.hints]
        else:
            found.consequences += other_evidence
    if found.candidates:
        found.confidence = "low"
    return found


def _stalled(s: _Signals) -> tuple | None:
    """(onset, evidence, signal) when the run has stopped learning: see
    `STALL_STEPS`. A run whose loss fell tenfold or more before it stopped
    moving has learnt its task: not a stall."""
    if not len(s.steps) or s.steps[-1] - s.steps[0] + 1 < STALL_STEPS:
        return None
    loss = s.record.column("loss")
    finite = loss[np.isfinite(loss)]
    # The loss's level at the start and over the last tenth, where a loss
    # was observed on 16 steps or more, all of it positive.
    positive = len(finite) >= 16 and bool((finite > 0).all())
    first = last = math.nan
    if positive:
        first = float(np.median(finite[:8]))
        last = float(np.median(finite[-len(finite) // 10 :]))
        if last <= first / WORSENING:
            return None  # learnt, then stopped: converged
    half = s.probe_steps >= s.steps[0] + (s.steps[-1] - s.steps[0]) / 2
    ratios = s.ratio[half]
    if half.sum() >= 4 and np.isfinite(ratios).all() and (ratios < FROZEN).all():
        moving = np.flatnonzero(np.nan_to_num(s.ratio, nan=0.0) >= FROZEN)
        since = int(s.probe_steps[moving[-1] + 1]) if len(moving) else int(s.steps[0])
        lr = s.record.column("learning_rate")
        return (
            since,
            [
                f"From step {since} the weights stopped moving: every probe's "
                f"largest update-to-weight ratio is below {FROZEN:g} (at most "
                f"{_g(float(ratios.max()))}); the learning rate went from "
                f"{_g(float(lr[0]))} to {_g(float(lr[-1]))}, the gradient norm "
                f"is {_g(float(s.grad[-1]))}."
                + (
                    f" The loss went from {_g(first)} to {_g(last)}."
                    if positive
                    else ""
                )
            ],
            "update_norm / weight_norm",
        )
    return None


def warning(record: FlightRecord) -> RunDiagnosis | None:
    """The run diagnosis when the record so far predicts trouble (no step has
    failed yet), else None."""
    if first_bad_step(record) is not None or not len(record):
        return None
    found = diagnose_run(record)
    if found.cause == "healthy":
        return None
    found.at_step = int(record.column("step")[-1])
    return found


def diagnose_warned_run(
    record: FlightRecord, given: RunDiagnosis | None
) -> RunDiagnosis:
    """`diagnose_run(record)` for a run that was warned with `given` (None: it
    was not): a run that has not failed keeps the cause it was warned of,
    from the evidence then, and what the record says since is what followed
    (the warning and the explanation never name two causes for the same
    trajectory); a run that failed is explained from the whole record, with
    the warning's step and lead."""
    found = diagnose_run(record)
    if given is None:
        return found
    if found.first_bad_step is not None:
        return found.warned(given.at_step)
    later = [] if found.cause in ("healthy", given.cause) else found.evidence
    return dataclasses.replace(
        given,
        consequences=[*given.consequences, *later],
        warned_at_step=given.at_step,
        lead_steps=None,
    )


def _diagnosis(
    cause: str,
    bad: int | None,
    onset: int | None,
    evidence: list[str] | None = None,
    signal: str | None = None,
) -> RunDiagnosis:
    steps = None if bad is None or onset is None else bad - onset
    return RunDiagnosis(
        cause,
        onset,
        bad,
        steps,
        list(evidence or []),
        list(RUN_HINTS[cause]),
        signal,
    )
