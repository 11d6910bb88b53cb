"""Graded handling (`SafeOptimizer(clip="adaptive")`), on every backend:
the ZClip threshold, the per-layer thresholds and the update bound step by
step against a NumPy reference, rejections that leave the statistics alone,
moment resets, saving, `fit` with NaNGuard, and the argument checks."""

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from keras_nanguard.safe_optimizer import adaptive_clip as rules
from tests.helpers import BACKEND, all_finite, assert_bit_identical, numpy


class Reference:
    """The rules of `adaptive_clip`, in float64 NumPy, for one SGD run."""

    def __init__(self, weights: list[np.ndarray], lr: float, ratio: float | None):
        self.w = [w.astype("float64") for w in weights]
        self.lr, self.ratio = lr, ratio
        self.seen = self.mean = self.var = 0.0
        self.ema = [0.0] * len(weights)
        self.threshold = np.inf
        self.clipped = self.bounded = 0
        self.threshold = np.inf

    def step(self, grads: list[np.ndarray]) -> None:
        norms = np.array([np.linalg.norm(g) for g in grads])
        norm = float(np.sqrt((norms**2).sum()))
        warm = self.seen < rules.WARMUP_STEPS
        std = np.sqrt(self.var)
        z = (norm - self.mean) / (std + rules.EPSILON)
        adaptive = np.inf
        if not warm and z > rules.Z_THRESHOLD:
            adaptive = self.mean + rules.Z_THRESHOLD * std / (z / rules.Z_THRESHOLD)
        factor = min(1.0, adaptive / norm)
        clipped_norms, factors = [], []
        for k, n in enumerate(norms * factor):
            limit = (
                np.inf if warm or self.ema[k] <= 0 else rules.LAYER_FACTOR * self.ema[k]
            )
            layer = min(1.0, limit / n) if n > 0 else 1.0
            factors.append(factor * layer)
            clipped_norms.append(n * layer)
        self.clipped += any(f < 1 for f in factors)
        bounded = False
        for k, (w, g) in enumerate(zip(self.w, grads, strict=True)):
            delta = -self.lr * factors[k] * g
            if self.ratio is not None:
                floor = rules.WEIGHT_FLOOR if w.ndim >= 2 else rules.VECTOR_FLOOR
                limit = self.ratio * max(np.sqrt(np.mean(w**2)), floor)
                rms = np.sqrt(np.mean(delta**2))
                if rms > limit:
                    delta *= limit / rms
                    bounded = True
            self.w[k] = w + delta
        self.bounded += bounded
        taken = min(norm, adaptive)
        if warm:
            count = self.seen + 1
            new_mean = self.mean + (taken - self.mean) / count
            self.var += ((taken - self.mean) * (taken - new_mean) - self.var) / count
            self.mean = new_mean
        else:
            self.mean = rules.ALPHA * self.mean + (1 - rules.ALPHA) * taken
            self.var = (
                rules.ALPHA * self.var + (1 - rules.ALPHA) * (taken - self.mean) ** 2
            )
        self.seen = min(self.seen + 1, rules.WARMUP_STEPS)
        # What the next step is judged against.
        warm_now = self.seen >= rules.WARMUP_STEPS
        self.threshold = (
            self.mean + rules.Z_THRESHOLD * np.sqrt(self.var) if warm_now else np.inf
        )
        self.ema = [
            c if e <= 0 else rules.LAYER_BETA * e + (1 - rules.LAYER_BETA) * c
            for e, c in zip(self.ema, clipped_norms, strict=True)
        ]


def _gradients(step: int) -> list[np.ndarray]:
    """Norms that vary through the warm-up, a burst of the kernel alone at
    step 30 (under the global z-score), a burst of everything at step 36."""
    rng = np.random.default_rng(step)
    kernel = rng.standard_normal((3, 2)) * (1.0 + (step % 3))
    bias = rng.standard_normal(2) * 0.5
    if step == 30:
        kernel, bias = kernel * 1.6, bias * 0.1
    if step == 36:
        kernel, bias = kernel * 20, bias * 20
    return [kernel.astype("float32"), bias.astype("float32")]


def _weights():
    kernel = keras.Variable(np.full((3, 2), 0.5, "float32"), name="kernel")
    bias = keras.Variable(np.zeros(2, "float32"), name="bias")
    return [kernel, bias]


@pytest.mark.parametrize("ratio", [None, 0.01])
def test_thresholds_and_bound_follow_the_documented_rules_step_by_step(ratio):
    variables = _weights()
    opt = ng.SafeOptimizer(
        keras.optimizers.SGD(0.05), clip="adaptive", max_update_ratio=ratio
    )
    opt.build(variables)
    ref = Reference(numpy(variables), 0.05, ratio)
    for step in range(40):
        grads = _gradients(step)
        opt.apply([keras.ops.convert_to_tensor(g) for g in grads], variables)
        ref.step(grads)
        c = opt.counters()
        # Each step: the statistics, the thresholds, the weights.
        seen, mean, var = numpy([opt._clip_state.norm_stats])[0]
        assert seen == ref.seen, step
        np.testing.assert_allclose([mean, var], [ref.mean, ref.var], rtol=2e-5)
        if np.isinf(ref.threshold):
            assert np.isinf(c["clip_threshold"]), step
        else:
            np.testing.assert_allclose(c["clip_threshold"], ref.threshold, rtol=2e-5)
        assert float(opt.clip_threshold) == c["clip_threshold"]
        for w, expected in zip(numpy(variables), ref.w, strict=True):
            np.testing.assert_allclose(w, expected, rtol=2e-5, atol=1e-7)
        assert (c["clipped_steps"], c["bounded_update_steps"]) == (
            ref.clipped,
            ref.bounded,
        ), step
        if step == 24:  # warm-up: nothing clipped
            assert c["clipped_steps"] == 0
    # The kernel's burst at step 30 was caught by its own threshold alone,
    # the burst of everything at 36 by the global one.
    assert c["clipped_steps"] >= 2 and c["skipped_steps"] == 0
    thresholds = opt.clip_thresholds()
    assert list(thresholds) == ["global", "kernel", "bias"]
    np.testing.assert_allclose(
        [thresholds["kernel"], thresholds["bias"]],
        [rules.LAYER_FACTOR * e for e in ref.ema],
        rtol=2e-5,
    )
    if ratio is not None:
        assert c["bounded_update_steps"] > 0


def test_the_bound_anneals_with_the_learning_rate_schedule():
    # A rate of 1 for 4 steps (Keras: step <= 3), then 0.1: the bound, 1% of the kernel's RMS a
    # step, becomes 0.1% of it (a decay keeps its meaning under the bound).
    kernel = keras.Variable(np.full((4, 4), 2.0, "float32"))
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([3], [1.0, 0.1])
    opt = ng.SafeOptimizer(keras.optimizers.SGD(schedule), clip="adaptive")
    opt.build([kernel])
    grad = keras.ops.ones((4, 4))
    moved = []
    for _ in range(6):
        before = numpy([kernel])[0]
        opt.apply([grad], [kernel])
        after = numpy([kernel])[0]
        moved.append(
            float(np.sqrt(np.mean((after - before) ** 2) / np.mean(before**2)))
        )
    # (a 0.2% move of a float32 weight of 2 is read to about 1e-4)
    np.testing.assert_allclose(moved, [0.01] * 4 + [0.001] * 2, rtol=2e-4)
    assert int(opt.bounded_update_steps) == 6


def test_a_layer_burst_is_clipped_where_the_global_norm_sees_none():
    variables = _weights()
    opt = ng.SafeOptimizer(
        keras.optimizers.SGD(0.05), clip="adaptive", max_update_ratio=None
    )
    opt.build(variables)
    for step in range(30):
        opt.apply([keras.ops.convert_to_tensor(g) for g in _gradients(step)], variables)
    before = opt.counters()["clipped_steps"]
    kernel_before, bias_before = numpy(variables)
    grads = _gradients(30)  # the kernel's burst
    ema = numpy([opt._clip_state.layer_norms])[0]
    threshold = opt.counters()["clip_threshold"]  # no global outlier
    opt.apply([keras.ops.convert_to_tensor(g) for g in grads], variables)
    assert opt.counters()["clipped_steps"] == before + 1
    assert np.linalg.norm(np.concatenate([g.ravel() for g in grads])) < threshold
    kernel, bias = numpy(variables)
    # The kernel moved by its gradient clipped to 1.05 x its EMA; the bias,
    # under its own threshold, by its whole gradient.
    moved = np.linalg.norm(kernel - kernel_before) / 0.05
    assert np.linalg.norm(grads[0]) > rules.LAYER_FACTOR * ema[0]
    np.testing.assert_allclose(moved, rules.LAYER_FACTOR * ema[0], rtol=1e-5)
    np.testing.assert_allclose(bias - bias_before, -0.05 * grads[1], rtol=1e-5)


def test_under_the_thresholds_the_steps_are_bit_for_bit_those_without_clip():
    def run(clip):
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.Dense(1),
            ]
        )
        opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-4), clip=clip)
        model.compile(optimizer=opt, loss="mse")
        rng = np.random.default_rng(0)
        x = rng.standard_normal((8 * 20, 4)).astype("float32")
        model.fit(x, x.sum(1, keepdims=True), batch_size=8, shuffle=False, verbose=0)
        return model, opt

    plain, _ = run(None)
    graded, opt = run("adaptive")
    c = opt.counters()
    assert (c["clipped_steps"], c["bounded_update_steps"]) == (0, 0)
    assert_bit_identical(numpy(plain.weights), numpy(graded.weights), "weights")


def test_a_rejected_step_leaves_weights_moments_and_statistics_as_they_were():
    variables = _weights()
    opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-2), clip="adaptive")
    opt.build(variables)
    for step in range(28):
        opt.apply([keras.ops.convert_to_tensor(g) for g in _gradients(step)], variables)
    state = numpy(variables) + numpy(opt.inner_optimizer.variables)
    stats = numpy([opt._clip_state.norm_stats, opt._clip_state.layer_norms])
    bad = _gradients(28)
    bad[1][0] = np.nan
    opt.apply([keras.ops.convert_to_tensor(g) for g in bad], variables)
    assert_bit_identical(state, numpy(variables) + numpy(opt.inner_optimizer.variables))
    assert_bit_identical(
        stats, numpy([opt._clip_state.norm_stats, opt._clip_state.layer_norms])
    )
    c = opt.counters()
    assert (c["skipped_steps"], c["nonfinite_gradient_steps"]) == (1, 1)


def test_moments_reset_after_every_reset_moments_rejections_in_a_row():
    variables = _weights()
    opt = ng.SafeOptimizer(
        keras.optimizers.Adam(1e-2), clip="adaptive", reset_moments=2
    )
    opt.build(variables)
    for step in range(3):
        opt.apply([keras.ops.convert_to_tensor(g) for g in _gradients(step)], variables)
    inner = opt.inner_optimizer
    moments = [
        v
        for v in inner.variables
        if v is not inner.iterations and v is not inner.learning_rate
    ]
    weights = numpy(variables)
    nan = [np.full(g.shape, np.nan, "float32") for g in _gradients(0)]
    expected_resets = []
    for _ in range(5):
        opt.apply([keras.ops.convert_to_tensor(g) for g in nan], variables)
        expected_resets.append(opt.counters()["moment_resets"])
        if opt.counters()["consecutive_skips"] == 1:
            assert all(np.abs(m).max() > 0 for m in numpy(moments))
    assert expected_resets == [0, 1, 1, 2, 2]
    assert all(not np.any(m) for m in numpy(moments))
    assert int(inner.iterations) == 3 and int(opt.moment_resets) == 2
    assert_bit_identical(weights, numpy(variables), "weights")
    opt.apply([keras.ops.convert_to_tensor(g) for g in _gradients(9)], variables)
    assert opt.counters()["consecutive_skips"] == 0 and int(inner.iterations) == 4


def _digits_model(optimizer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x[:512] / 16).astype("float32"), y[:512].astype("int32")


def test_fit_with_nan_guard_logs_the_thresholds_and_survives_a_bad_batch():
    x, y = _digits()
    x[100, 3] = np.nan  # batch 3
    opt = ng.SafeOptimizer(keras.optimizers.AdamW(0.3), clipnorm=1.0, clip="adaptive")
    model = _digits_model(opt)
    guard = ng.NaNGuard()
    clean = _digits_model(
        ng.SafeOptimizer(keras.optimizers.AdamW(0.3), clip="adaptive")
    )
    quiet = ng.NaNGuard()
    clean_history = clean.fit(
        x[:96], y[:96], batch_size=32, verbose=0, callbacks=[quiet]
    )
    assert quiet.incidents == []  # no threshold yet: logged as 0, not inf
    assert clean_history.history["nanguard_clip_threshold"] == [0.0]
    history = model.fit(
        x, y, batch_size=32, epochs=3, shuffle=False, verbose=0, callbacks=[guard]
    )
    for key in (
        "nanguard_clip_threshold",
        "nanguard_clipped_steps",
        "nanguard_bounded_updates",
    ):
        assert key in history.history
    c = opt.counters()
    assert c["skipped_steps"] == 3  # the bad batch, once an epoch
    assert c["bounded_update_steps"] > 0
    assert history.history["nanguard_bounded_updates"][-1] == c["bounded_update_steps"]
    assert all_finite(model.weights)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_a_keras_file_keeps_the_graded_handling_and_trains_on_alike(tmp_path):
    x, y = _digits()
    opt = ng.SafeOptimizer(
        keras.optimizers.AdamW(0.1),
        clip="adaptive",
        reset_moments=3,
        max_update_ratio=0.02,
    )
    model = _digits_model(opt)
    model.fit(x, y, batch_size=64, epochs=4, shuffle=False, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")  # no custom_objects
    again = loaded.optimizer
    assert isinstance(again, ng.SafeOptimizer)
    assert (again.clip, again.reset_moments, again.max_update_ratio) == (
        "adaptive",
        3,
        0.02,
    )
    assert again.counters() == opt.counters()
    # The same thresholds (the names are paths, which loading may shorten).
    assert list(again.clip_thresholds().values()) == list(
        opt.clip_thresholds().values()
    )
    assert again.get_config() == opt.get_config()
    assert_bit_identical(numpy(opt.variables), numpy(again.variables), "optimizer")
    # Training resumed from the file matches uninterrupted training.
    model.fit(x, y, batch_size=64, verbose=0, shuffle=False)
    loaded.fit(x, y, batch_size=64, verbose=0, shuffle=False)
    assert_bit_identical(numpy(model.weights), numpy(loaded.weights), "resumed weights")
    assert again.counters() == opt.counters()


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's stateless loop")
def test_the_jax_stateless_loop_reads_its_counters_from_the_returned_values():
    import jax

    x, y = _digits()
    opt = ng.SafeOptimizer(keras.optimizers.AdamW(0.3), clip="adaptive")
    model = _digits_model(opt)
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss_of(tv, ntv, xb, yb):
        out, ntv = model.stateless_call(tv, ntv, xb, training=True)
        return loss_fn(yb, out), ntv

    @jax.jit
    def step(tv, ntv, ov, xb, yb):
        (_, new_ntv), grads = jax.value_and_grad(loss_of, has_aux=True)(tv, ntv, xb, yb)
        tv, ov = opt.stateless_apply(ov, grads, tv)
        return tv, opt.stateless_commit(ov, ntv, new_ntv), ov

    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    ov = [v.value for v in opt.variables]
    for i in range(0, 512, 32):
        tv, ntv, ov = step(tv, ntv, ov, x[i : i + 32], y[i : i + 32])
    c = opt.counters(ov)
    assert (
        c["bounded_update_steps"] == 16 and opt.counters()["bounded_update_steps"] == 0
    )
    assert set(opt.clip_thresholds(ov)) >= {"global"}


@pytest.mark.backend_free
@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"clip": "zclip"}, ValueError, "`clip` must be one of ('adaptive',)"),
        ({"clip": 1.0}, TypeError, "`clip` must be one of"),
        ({"max_update_ratio": 0.05}, ValueError, "`max_update_ratio` is part of"),
        ({"clip": "adaptive", "max_update_ratio": "x"}, TypeError, "max_update_ratio"),
        ({"reset_moments": 3}, ValueError, "`reset_moments` is part of"),
        ({"clip": "adaptive", "max_update_ratio": 0}, ValueError, "max_update_ratio"),
        ({"clip": "adaptive", "reset_moments": 0}, ValueError, "reset_moments"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, named):
    with pytest.raises(error, match="Received") as raised:
        ng.SafeOptimizer(keras.optimizers.Adam(), **kwargs)
    assert named in str(raised.value)


@pytest.mark.backend_free
def test_what_the_graded_handling_cannot_serve_is_refused():
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4"):
        ng.SafeOptimizer(
            keras.optimizers.Adam(gradient_accumulation_steps=4), clip="adaptive"
        )
    with pytest.raises(ValueError, match="use_ema=True"):
        ng.SafeOptimizer(
            keras.optimizers.Adam(use_ema=True), clip="adaptive", reset_moments=2
        )
    opt = ng.SafeOptimizer(keras.optimizers.Adam(), clip="adaptive")
    with pytest.raises(AttributeError, match="`clip` is set when"):
        opt.clip = None
    opt.max_update_ratio = 0.05  # a plain setting: read by the next step
    assert opt.max_update_ratio == 0.05 and opt.clip == "adaptive"
    with pytest.raises(ValueError, match="max_update_ratio=-1"):
        opt.max_update_ratio = -1  # checked as the constructor checks it
    assert opt.max_update_ratio == 0.05
    with pytest.raises(AttributeError, match=r"only with `clip=.adaptive.`"):
        _ = ng.SafeOptimizer(keras.optimizers.Adam()).bounded_update_steps


def test_a_new_max_update_ratio_reaches_steps_compiled_already():
    x, y = _digits()
    opt = ng.SafeOptimizer(keras.optimizers.AdamW(0.3), clip="adaptive")
    model = _digits_model(opt)
    model.fit(x[:128], y[:128], batch_size=32, verbose=0)
    assert int(opt.bounded_update_steps) == 4
    opt.max_update_ratio = 100.0  # no bound any more, in the same compiled step
    model.fit(x[:128], y[:128], batch_size=32, verbose=0)
    assert int(opt.bounded_update_steps) == 4
    opt.max_update_ratio = 1e-4
    model.fit(x[:128], y[:128], batch_size=32, verbose=0)
    assert int(opt.bounded_update_steps) == 8
    with pytest.raises(AttributeError, match="cannot become None"):
        opt.max_update_ratio = None
