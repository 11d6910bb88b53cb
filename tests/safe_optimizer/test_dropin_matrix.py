"""The drop-in matrix: a rejected step changes nothing, in any model.

Every model kind carries BatchNormalization, whose moving statistics the
forward pass updates before the optimizer decides anything. Training with
poisoned batches (NaN and inf, in inputs and in targets, each between clean
ones) must leave every model variable (trainable, non-trainable, torch
buffers), the inner optimizer's state and `iterations` bit-identical to
training on the same data with those batches removed, in `model.fit` (with
`opt.attach(model)` or with `NaNGuard`, which attaches for you) and in custom
loops (`opt.transaction(model)` on TensorFlow and torch, `stateless_commit`
on JAX).

Both runs of every comparison use the same setup and start from the same
weights: Dense kernels come from seeded initializers, torch modules from
`torch.manual_seed`, so models built during `fit` start alike too.
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_nanguard as ng
from tests.helpers import BACKEND, all_finite, assert_bit_identical, numpy

BATCH = 8
N_BATCHES = 9
EPOCHS = 2
# 0-based batch of every epoch -> (what is poisoned, value). Batch 0 is
# poisoned too: the first step of `fit` (where unbuilt models are built) is
# rejected, and no two poisoned batches are adjacent, also across epochs.
POISON = {0: ("x", "nan"), 2: ("y", "inf"), 5: ("x", "inf"), 7: ("y", "nan")}
CLEAN = [b for b in range(N_BATCHES) if b not in POISON]
SKIPPED = EPOCHS * len(POISON)  # 8
ACCEPTED = EPOCHS * len(CLEAN)  # 10

only_torch = pytest.mark.skipif(BACKEND != "torch", reason="torch backend only")
only_tf = pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow only")
only_jax = pytest.mark.skipif(BACKEND != "jax", reason="JAX only")


# ------------------------------------------------------------------ data
def _data():
    """Clean inputs and targets, and the same with POISON written in."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N_BATCHES * BATCH, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32") + 1.0).astype("float32")
    x_bad, y_bad = x.copy(), y.copy()
    for batch, (where, value) in POISON.items():
        row = batch * BATCH + 3
        if where == "x":
            x_bad = ng.faults.poison(x_bad, rows=[row], value=value, columns=1)
        else:
            y_bad = ng.faults.poison(y_bad, rows=[row], value=value)
    assert x_bad.dtype == y_bad.dtype == np.float32
    return x, y, x_bad, y_bad


def _without_poisoned_batches(x, y):
    keep = np.concatenate([np.arange(b * BATCH, (b + 1) * BATCH) for b in CLEAN])
    return x[keep], y[keep]


def _batches(x, y):
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]


# ---------------------------------------------------------------- models
def _dense(units, seed, **kwargs):
    return keras.layers.Dense(
        units,
        kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
        **kwargs,
    )


class SubclassedModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = _dense(8, 1)
        self.norm = keras.layers.BatchNormalization()
        self.head = _dense(1, 2)

    def call(self, inputs, training=None):
        return self.head(self.norm(self.hidden(inputs), training=training))


def _torch_module():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        torch.nn.BatchNorm1d(8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 1),
    )


def _build(kind):
    """A fresh tiny model (4 -> Dense 8 -> BN -> Dense 1) of the given kind."""
    if kind == "sequential_input":
        return keras.Sequential(
            [
                keras.Input((4,)),
                _dense(8, 1),
                keras.layers.BatchNormalization(),
                _dense(1, 2),
            ]
        )
    if kind == "sequential_no_input":  # built during fit
        return keras.Sequential(
            [
                _dense(8, 1),
                keras.layers.BatchNormalization(),
                _dense(1, 2),
            ]
        )
    if kind == "functional":
        inputs = keras.Input((4,))
        h = _dense(8, 1)(inputs)
        h = keras.layers.BatchNormalization()(h)
        return keras.Model(inputs, _dense(1, 2)(h))
    if kind == "subclassed":  # built during fit
        return SubclassedModel()
    if kind == "nested":  # a Sequential and a functional model inside one
        block = keras.Sequential(
            [
                keras.Input((4,)),
                _dense(8, 1),
                keras.layers.BatchNormalization(),
            ],
            name="block",
        )
        inner_in = keras.Input((8,))
        inner_out = _dense(1, 2)(keras.layers.BatchNormalization()(inner_in))
        head = keras.Model(inner_in, inner_out, name="head")
        inputs = keras.Input((4,))
        return keras.Model(inputs, head(block(inputs)))
    if kind == "torch_module":
        inputs = keras.Input((4,))
        outputs = keras.layers.TorchModuleWrapper(
            _torch_module(), output_shape=(None, 1)
        )(inputs)
        return keras.Model(inputs, outputs)
    raise ValueError(kind)


KINDS = [
    "sequential_input",
    "sequential_no_input",
    "functional",
    "subclassed",
    "nested",
    pytest.param("torch_module", marks=only_torch),
]


def _layers(model):
    """Every layer, nested models walked into (public `layers` only)."""
    for layer in model.layers:
        yield layer
        if hasattr(layer, "layers"):
            yield from _layers(layer)


def _torch_buffers(model):
    """The state_dict of every TorchModuleWrapper's module: parameters and
    buffers (BatchNorm1d running stats, num_batches_tracked)."""
    out = []
    for layer in _layers(model):
        if isinstance(layer, keras.layers.TorchModuleWrapper):
            for tensor in layer.module.state_dict().values():
                out.append(tensor.detach().cpu().numpy().copy())
    return out


def _model_state(model):
    """All model variables (trainable and not) plus torch modules' state."""
    return numpy(model.variables) + _torch_buffers(model)


def _moving_means(model):
    """BatchNormalization moving means, Keras's and torch's."""
    out = numpy(v for v in model.non_trainable_variables if "moving_mean" in v.path)
    for layer in _layers(model):
        if isinstance(layer, keras.layers.TorchModuleWrapper):
            for name, t in layer.module.state_dict().items():
                if name.endswith("running_mean"):
                    out.append(t.detach().cpu().numpy().copy())
    return out


def _optimizer():
    return ng.SafeOptimizer(keras.optimizers.Adam(1e-2))


def _fit(kind, how, x, y):
    """Builds, compiles and fits a fresh model of `kind`, guarded by `how`:
    "attach" (SafeOptimizer alone, `opt.attach(model)` after `compile`),
    "attach_before_compile", "nanguard" (SafeOptimizer and NaNGuard, no
    attach), "attach_and_nanguard" (both) or "none" (SafeOptimizer alone)."""
    model = _build(kind)
    opt = _optimizer()
    if how == "attach_before_compile":
        opt.attach(model)
    model.compile(optimizer=opt, loss="mse")
    callbacks = []
    if how in ("attach", "attach_and_nanguard"):
        opt.attach(model)
    if how in ("nanguard", "attach_and_nanguard"):
        callbacks.append(ng.NaNGuard(verbose=0))
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    return model, opt, history, callbacks


def _assert_same_training(poisoned, clean, what):
    (model, opt), (ref, ref_opt) = poisoned, clean
    assert_bit_identical(_model_state(ref), _model_state(model), f"{what}: model")
    assert_bit_identical(
        numpy(ref_opt.inner_optimizer.variables),
        numpy(opt.inner_optimizer.variables),
        f"{what}: optimizer",
    )


# ------------------------------------------------------------ the matrix
@pytest.mark.parametrize("kind", KINDS)
def test_clean_training_is_reproducible(kind):
    """The reference half of every comparison below is deterministic: two
    runs on the clean data give bit-identical state (so a difference below
    can only come from a poisoned batch)."""
    x, y, _, _ = _data()
    x, y = _without_poisoned_batches(x, y)
    runs = [_fit(kind, "none", x, y)[:2] for _ in range(2)]
    _assert_same_training(runs[0], runs[1], kind)
    assert int(runs[0][1].iterations) == ACCEPTED
    means = _moving_means(runs[0][0])
    assert means and all(np.any(m != 0) for m in means), "BN statistics moved"


@pytest.mark.parametrize("how", ["attach", "nanguard"])
@pytest.mark.parametrize("kind", KINDS)
def test_poisoned_batches_change_nothing(kind, how):
    x, y, x_bad, y_bad = _data()
    model, opt, history, callbacks = _fit(kind, how, x_bad, y_bad)
    ref, ref_opt, _, _ = _fit(kind, how, *_without_poisoned_batches(x, y))

    if how == "nanguard":  # every rejection recorded, nothing to roll back
        (guard,) = callbacks
        assert guard.rollbacks == 0, guard.summary()
        assert [i.kind for i in guard.incidents] == ["rejected_step"] * SKIPPED
        assert np.isfinite(history.history["loss"]).all()
    assert int(opt.skipped_steps) == SKIPPED
    assert int(opt.iterations) == ACCEPTED == int(ref_opt.iterations)
    assert int(ref_opt.skipped_steps) == 0
    _assert_same_training((model, opt), (ref, ref_opt), f"{kind}/{how}")
    assert all_finite(model.variables)
    means = _moving_means(model)
    assert means and all(np.any(m != 0) for m in means), "BN statistics moved"
    prediction = model.predict(x, batch_size=BATCH, verbose=0)
    assert np.isfinite(prediction).all()


@pytest.mark.parametrize("kind", ["sequential_no_input", "subclassed", "nested"])
def test_attach_before_compile_and_before_the_model_is_built(kind):
    x, y, x_bad, y_bad = _data()
    model, opt, _, _ = _fit(kind, "attach_before_compile", x_bad, y_bad)
    ref, ref_opt, _, _ = _fit(
        kind, "attach_before_compile", *_without_poisoned_batches(x, y)
    )
    assert (int(opt.skipped_steps), int(opt.iterations)) == (SKIPPED, ACCEPTED)
    _assert_same_training((model, opt), (ref, ref_opt), kind)


@pytest.mark.parametrize(
    "kind", ["functional", pytest.param("torch_module", marks=only_torch)]
)
def test_explicit_attach_and_nanguard_together(kind):
    """An explicit attach and NaNGuard's own one together work as either alone."""
    x, y, x_bad, y_bad = _data()
    model, opt, _, (guard,) = _fit(kind, "attach_and_nanguard", x_bad, y_bad)
    ref, ref_opt, _, _ = _fit(
        kind, "attach_and_nanguard", *_without_poisoned_batches(x, y)
    )
    assert guard.rollbacks == 0, guard.summary()
    assert (int(opt.skipped_steps), int(opt.iterations)) == (SKIPPED, ACCEPTED)
    _assert_same_training((model, opt), (ref, ref_opt), kind)


@pytest.mark.parametrize(
    "kind", ["functional", pytest.param("torch_module", marks=only_torch)]
)
def test_train_on_batch_with_attach(kind):
    x, y, x_bad, y_bad = _data()
    runs = []
    for data in [(x_bad, y_bad), _without_poisoned_batches(x, y)]:
        model = _build(kind)
        opt = _optimizer()
        model.compile(optimizer=opt, loss="mse")
        opt.attach(model)
        for xb, yb in _batches(*data):
            model.train_on_batch(xb, yb)
        runs.append((model, opt))
    (model, opt), (ref, ref_opt) = runs
    assert (int(opt.skipped_steps), int(opt.iterations)) == (len(POISON), len(CLEAN))
    _assert_same_training((model, opt), (ref, ref_opt), kind)
    assert np.isfinite(model.predict(x, verbose=0)).all()


@pytest.mark.parametrize(
    "kind", ["functional", pytest.param("torch_module", marks=only_torch)]
)
def test_without_attach_a_rejected_step_still_poisons_batch_norm(kind):
    """Why `attach` exists: SafeOptimizer alone guards what it updates, not
    the statistics the forward pass has already written."""
    x, y, _, _ = _data()
    x_bad = ng.faults.poison(x[:BATCH], rows=[3], value="nan", columns=1)
    model = _build(kind)
    opt = _optimizer()
    model.compile(optimizer=opt, loss="mse")
    trainable = numpy(model.trainable_variables)
    model.fit(x_bad, y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)

    assert (int(opt.skipped_steps), int(opt.iterations)) == (1, 0)
    assert_bit_identical(trainable, numpy(model.trainable_variables), "weights")
    (mean,) = _moving_means(model)
    assert np.isnan(mean).all()
    assert np.isnan(model.predict(x, verbose=0)).all()


# ---------------------------------------------------------- custom loops
def _loss(y, pred):
    return ops.mean(ops.square(ops.convert_to_tensor(y) - pred))


def _tape_step(model, opt):
    import tensorflow as tf

    def step(xb, yb):
        with opt.transaction(model):
            with tf.GradientTape() as tape:
                loss = _loss(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)

    return step


@only_tf
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
def test_gradient_tape_loop_with_transaction(compiled):
    import tensorflow as tf

    x, y, x_bad, y_bad = _data()
    runs = []
    for data in [(x_bad, y_bad), _without_poisoned_batches(x, y)]:
        model = _build("nested")
        opt = _optimizer()
        step = _tape_step(model, opt)
        step = tf.function(step) if compiled else step
        for _ in range(EPOCHS):
            for xb, yb in _batches(*data):
                step(tf.constant(xb), tf.constant(yb))
        runs.append((model, opt))
    (model, opt), (ref, ref_opt) = runs
    assert (int(opt.skipped_steps), int(opt.iterations)) == (SKIPPED, ACCEPTED)
    _assert_same_training((model, opt), (ref, ref_opt), "tape")
    assert np.isfinite(model.predict(x, verbose=0)).all()


@only_torch
@pytest.mark.parametrize("kind", ["nested", "torch_module"])
def test_torch_loop_with_transaction(kind):
    import torch

    x, y, x_bad, y_bad = _data()
    runs = []
    for data in [(x_bad, y_bad), _without_poisoned_batches(x, y)]:
        model = _build(kind)
        opt = _optimizer()
        for _ in range(EPOCHS):
            for xb, yb in _batches(*data):
                with opt.transaction(model):
                    loss = _loss(yb, model(ops.convert_to_tensor(xb), training=True))
                    model.zero_grad()
                    loss.backward()
                    weights = model.trainable_weights
                    with torch.no_grad():
                        opt.apply([w.value.grad for w in weights], weights)
        runs.append((model, opt))
    (model, opt), (ref, ref_opt) = runs
    assert (int(opt.skipped_steps), int(opt.iterations)) == (SKIPPED, ACCEPTED)
    _assert_same_training((model, opt), (ref, ref_opt), kind)
    assert np.isfinite(model.predict(x, verbose=0)).all()


@only_torch
def test_a_torch_module_added_between_fits_is_rolled_back_too():
    # A buffers-only module (no Keras variable) made before the first fit
    # and added after it: the attached step must see its buffers.
    import torch

    norm = keras.layers.TorchModuleWrapper(
        torch.nn.BatchNorm1d(4, affine=False), output_shape=(None, 4)
    )
    model = keras.Sequential([keras.Input((4,)), _dense(4, 1)])
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt, loss="mse")
    opt.attach(model)
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    model.fit(x, x, batch_size=8, verbose=0)
    model.add(norm)
    x_bad = x.copy()
    x_bad[0, 0] = np.nan  # NaN in the forward pass: NaN batch statistics
    model.fit(x_bad, x, batch_size=8, verbose=0)
    assert int(opt.skipped_steps) == 1
    assert norm.module.running_mean.tolist() == [0.0] * 4
    assert norm.module.running_var.tolist() == [1.0] * 4
    assert int(norm.module.num_batches_tracked) == 0


@only_jax
def test_jax_stateless_loop_with_commit_and_counters():
    import jax

    x, y, x_bad, y_bad = _data()
    model = _build("nested")
    opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-2), max_consecutive_skips=2)
    opt.build(model.trainable_variables)

    def loss_and_updates(trainable, non_trainable, xb, yb):
        pred, non_trainable = model.stateless_call(
            trainable, non_trainable, xb, training=True
        )
        return _loss(yb, pred), non_trainable

    grad_fn = jax.value_and_grad(loss_and_updates, has_aux=True)

    @jax.jit
    def train_step(state, xb, yb):
        trainable, non_trainable, opt_vars = state
        (_, new_non_trainable), grads = grad_fn(trainable, non_trainable, xb, yb)
        trainable, opt_vars = opt.stateless_apply(opt_vars, grads, trainable)
        non_trainable = opt.stateless_commit(opt_vars, non_trainable, new_non_trainable)
        return trainable, non_trainable, opt_vars

    start = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in opt.variables],
    )

    def train(data, state=start, epochs=EPOCHS):
        for _ in range(epochs):
            for xb, yb in _batches(*data):
                state = train_step(state, xb, yb)
        return state

    poisoned = train((x_bad, y_bad))
    clean = train(_without_poisoned_batches(x, y))

    inner = {id(v) for v in opt.inner_optimizer.variables}
    iterations = [id(v) for v in opt.variables].index(id(opt.iterations))

    def comparable(state):
        trainable, non_trainable, opt_vars = state
        kept = [
            v
            for v, var in zip(opt_vars, opt.variables, strict=True)
            if id(var) in inner
        ]
        return numpy(trainable) + numpy(non_trainable) + numpy(kept)

    assert_bit_identical(comparable(clean), comparable(poisoned), "stateless")
    opt_vars = poisoned[2]
    assert int(opt_vars[iterations]) == ACCEPTED
    c = opt.counters(opt_vars)
    assert (c["skipped_steps"], c["consecutive_skips"]) == (SKIPPED, 0)
    assert c["nonfinite_gradient_steps"] == SKIPPED
    assert opt.counters()["skipped_steps"] == 0  # the Python side is untouched
    assert "was not finite" in opt.describe_last_rejection(opt_vars)
    opt.check_halted(opt_vars)  # the last step was good: no halt

    # Two rejected steps in a row reach max_consecutive_skips=2.
    state = train_step(poisoned, x_bad[:BATCH], y_bad[:BATCH])
    opt.check_halted(state[2])
    state = train_step(state, x_bad[:BATCH], y_bad[:BATCH])
    assert opt.counters(state[2])["consecutive_skips"] == 2
    with pytest.raises(ng.NonFiniteError, match="max_consecutive_skips=2"):
        opt.check_halted(state[2])
    assert_bit_identical(comparable(poisoned), comparable(state), "halted")

    # The guide's last step: write the state back, then predict.
    trainable, non_trainable, opt_vars = poisoned
    for var, value in zip(model.trainable_variables, trainable, strict=True):
        var.assign(value)
    for var, value in zip(model.non_trainable_variables, non_trainable, strict=True):
        var.assign(value)
    for var, value in zip(opt.variables, opt_vars, strict=True):
        var.assign(value)
    assert int(opt.skipped_steps) == SKIPPED
    assert np.isfinite(model.predict(x, verbose=0)).all()


# -------------------------------------------------------------- dropout
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_rejected_steps_do_not_advance_dropouts_random_stream(seeded):
    """Dropout draws from Keras's seed state, which the transaction puts
    back: training with poisoned batches equals training without them. One
    exception, documented: on torch an unseeded `Dropout` draws from torch's
    global generator, which lives on the host; putting it back would need the
    decision on the host every step, so there its masks move on."""

    def fit(x, y):
        keras.utils.set_random_seed(3)  # unseeded layers draw their seed here
        model = keras.Sequential(
            [
                keras.Input((4,)),
                _dense(8, 1, activation="relu"),
                keras.layers.Dropout(0.3, seed=7 if seeded else None),
                _dense(1, 2),
            ]
        )
        opt = _optimizer()
        model.compile(optimizer=opt, loss="mse")
        opt.attach(model)
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        return model, opt

    x, y, x_bad, y_bad = _data()
    model, opt = fit(x_bad, y_bad)
    ref, ref_opt = fit(*_without_poisoned_batches(x, y))
    assert int(opt.skipped_steps) == SKIPPED
    if BACKEND == "torch" and not seeded:
        assert numpy(model.trainable_variables)[0].tobytes() != (
            numpy(ref.trainable_variables)[0].tobytes()
        )
    else:
        _assert_same_training((model, opt), (ref, ref_opt), "dropout")
