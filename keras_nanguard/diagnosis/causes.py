"""The causes `diagnose()` names, and what to do about each, in words.

`CAUSES` is the fixed vocabulary of cause codes (`Diagnosis.causes` holds
codes from it, most likely first) with what each means; `HINTS` holds, for
each code, the sentences that say what to change. `hints_for` puts a
report's hints together; `overflow_hints` adds advice specific to the layers
an overflow went through (unbounded activations, Glorot initialisation with
ReLU, weights that have grown).

Example:

>>> from keras_nanguard.diagnosis import causes
>>> causes.CAUSES["log_of_zero"]
'a probability that is exactly 0 reaches a log'
>>> causes.hints_for(["loss_overflow"])[0][:29]
'Normalise targets and returns'
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import keras
import numpy as np

from keras_nanguard._host_device import host_view

#: The cause vocabulary: code -> what it means.
CAUSES: dict[str, str] = {
    "nonfinite_input": "the inputs already hold NaN or inf",
    "nonfinite_target": "the targets already hold NaN or inf",
    "nonfinite_weights": "the weights or the optimizer state are already NaN or inf",
    "activation_overflow": "finite inputs, but a layer's output overflows to inf",
    "invalid_arithmetic": "an operation turned finite or infinite values into NaN "
    "(inf - inf, 0 * inf, 0 / 0, a softmax over an all -inf row)",
    "log_of_zero": "a probability that is exactly 0 reaches a log",
    "loss_overflow": "the predictions are finite but the loss is not: too large "
    "targets or predictions",
    "nonfinite_gradient": "forward pass and loss are finite, a gradient is not "
    "(a division by a norm that is 0, sqrt at 0, 0 * inf in backward)",
    "exploding_gradient": "the gradients are finite but their global norm is huge",
    "update_overflow": "the gradients are finite, but the optimizer's update would "
    "make weights or optimizer state non-finite",
}

#: What to change, for each cause code, in words.
HINTS: dict[str, list[str]] = {
    "nonfinite_input": [
        "Clean or filter the data before training (np.isfinite on each batch).",
        "SafeOptimizer rejects the steps such batches would poison; NaNGuard "
        "records them.",
    ],
    "nonfinite_target": [
        "Check how targets (rewards, returns, labels) are computed: a division "
        "by zero or a log of 0 upstream is typical.",
    ],
    "nonfinite_weights": [
        "The state is already broken: restore a good checkpoint (NaNGuard keeps "
        "one) and find the step that broke it (NaNGuard's incidents).",
    ],
    "activation_overflow": [
        "Lower the learning rate, and clip gradients "
        "(SafeOptimizer(optimizer, clipnorm=1.0)).",
        "Normalise activations (BatchNormalization or LayerNormalization).",
    ],
    "invalid_arithmetic": [
        "Guard divisions and norms: keras_nanguard.ops.safe_div and safe_norm "
        "(zero instead of 0/0).",
        "For a masked softmax use keras_nanguard.StableSoftmax (a fully masked "
        "row gives zeros, not NaN).",
    ],
    "log_of_zero": [
        "Compute log-probabilities in log space: StableSoftmax(log_probs=True), "
        "or keras_nanguard.ops.policy_log_prob(logits, actions) for log pi(a|s) "
        "and the entropy, instead of log(softmax(...)).",
        "keras_nanguard.ops.safe_log as a last resort; a smaller learning rate "
        "or an entropy bonus keeps the policy from saturating.",
    ],
    "loss_overflow": [
        "Normalise targets and returns (e.g. (G - mean) / std), or use a Huber "
        "loss instead of the squared error.",
    ],
    "nonfinite_gradient": [
        "Look for sqrt, norm or division by a quantity that reaches 0: "
        "keras_nanguard.ops.safe_sqrt, safe_norm and safe_div have finite "
        "gradients at 0.",
    ],
    "exploding_gradient": [
        "Clip gradients (SafeOptimizer(optimizer, clipnorm=1.0)) and lower the "
        "learning rate.",
        "Normalise inputs and targets.",
    ],
    "update_overflow": [
        "Lower the learning rate. SafeOptimizer rejects such updates and can back "
        "the learning rate off (lr_backoff=0.5).",
    ],
}


_UNBOUNDED = ("relu", "elu", "selu", "leaky_relu", "gelu", "softplus", "exponential")


def hints_for(causes: Iterable[str], extra: Sequence[str] = ()) -> list[str]:
    """The hints for `causes` (codes from `CAUSES`), after `extra` ones.

    Each sentence appears once, in the order of the causes.

    Args:
        causes: cause codes, most likely first.
        extra: hints that go first (e.g. from `overflow_hints`).

    Returns:
        A list of sentences.

    Example:

    >>> from keras_nanguard.diagnosis.causes import hints_for
    >>> len(hints_for(["log_of_zero", "nonfinite_gradient"]))
    3
    """
    hints = list(extra)
    for cause in causes:
        hints += [h for h in HINTS[cause] if h not in hints]
    return hints


def overflow_hints(layers: Sequence[keras.layers.Layer]) -> list[str]:
    """Hints for an overflow reached through `layers` (in forward order).

    Names the layers with an unbounded activation (and those of them with
    Glorot initialisation), and says so when a weight on the way has grown
    past 1e3.

    Args:
        layers: the layers the values went through, up to the one whose
            output overflowed.

    Returns:
        A list of sentences, possibly empty.

    Example:

    >>> import keras
    >>> from keras_nanguard.diagnosis.causes import overflow_hints
    >>> dense = keras.layers.Dense(4, activation="relu", name="hidden")
    >>> dense.build((None, 3))
    >>> hints = overflow_hints([dense])
    >>> "'hidden' (relu)" in hints[0], "(these use Glorot: hidden)" in hints[0]
    (True, True)
    """
    hints = []
    unbounded = [
        (lay.name, getattr(lay.activation, "__name__", ""))
        for lay in layers
        if getattr(getattr(lay, "activation", None), "__name__", "") in _UNBOUNDED
    ]
    if unbounded:
        names = ", ".join(f"'{n}' ({a})" for n, a in unbounded)
        glorot = [
            lay.name
            for lay in layers
            if "Glorot" in type(getattr(lay, "kernel_initializer", None)).__name__
        ]
        hints.append(
            f"Unbounded activations let the values grow layer after layer: {names}. "
            "Use He initialisation (kernel_initializer='he_normal') with ReLU/ELU"
            + (f" (these use Glorot: {', '.join(glorot)})" if glorot else "")
            + ", smaller weight scales (e.g. a smaller g and b in weight-normalised "
            "layers), or a bounded activation (tanh) where values must stay small."
        )
    weights = [
        float(np.max(np.abs(host_view(w)), initial=0.0))
        for lay in layers
        for w in lay.weights
    ]
    if weights and max(weights) > 1e3:
        hints.append(
            f"The largest weight on the way is {max(weights):.3g}: the weights "
            "have grown; a smaller learning rate or weight decay keeps them in range."
        )
    return hints
