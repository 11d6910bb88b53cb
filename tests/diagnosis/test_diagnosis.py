"""diagnose(): a corpus of broken models, one or more per cause code, and
healthy models that must not raise a false alarm. On every backend."""

import json

import keras
import numpy as np
import pytest
from keras import ops

import keras_nanguard as ng
from keras_nanguard.diagnosis import CAUSES, STAGES
from tests import models
from tests.helpers import assert_bit_identical, numpy


def _mlp(activation="relu", out=1, init="glorot_uniform"):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation, kernel_initializer=init, name="hidden1"),
            keras.layers.Dense(8, activation, kernel_initializer=init, name="hidden2"),
            keras.layers.Dense(out, name="out"),
        ]
    )


def _xy(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 4)).astype("float32"), rng.standard_normal(
        (n, 1)
    ).astype("float32")


def _saturated_actor():
    """The actor after a too-high learning rate: the softmax has saturated,
    one action's probability is exactly 0."""
    actor = models.actor()
    w = np.zeros((32, 2), "float32")
    w[:, 0], w[:, 1] = 1e3, -1e3
    actor.get_layer("policy").kernel.assign(w)
    x = np.random.default_rng(0).random((4, 36, 64, 3)).astype("float32")
    return actor, x


class _Norm(keras.layers.Layer):
    def call(self, x):
        return ops.sqrt(ops.sum(ops.square(x), axis=-1, keepdims=True))


# ------------------------------------------------------------------ corpus
# Case name -> the (stage, layer, cause) diagnose must report for it.
EXPECTED = {}


def _expects(stage, layer, cause):
    """Records what `diagnose` must find in the case it decorates."""

    def record(case):
        EXPECTED[case.__name__[5:]] = (stage, layer, cause)
        return case

    return record


@_expects("input", None, "nonfinite_input")
def case_input():
    x, y = _xy()
    x[3, 2] = np.nan
    return _mlp(), x, y, {"loss": "mse"}


@_expects("target", None, "nonfinite_target")
def case_target():
    x, y = _xy()
    y[5, 0] = np.inf
    return _mlp(), x, y, {"loss": "mse"}


@_expects("weights", "hidden2", "nonfinite_weights")
def case_weights():
    model = _mlp()
    model.get_layer("hidden2").kernel.assign(np.full((8, 8), np.nan, "float32"))
    x, y = _xy()
    return model, x, y, {"loss": "mse"}


@_expects("forward", "hidden1", "activation_overflow")
def case_activation_overflow():
    model = _mlp()
    model.get_layer("hidden1").kernel.assign(np.full((4, 8), 1e37, "float32"))
    x, y = _xy()
    x = np.abs(x) + 10  # 4 * 10 * 1e37 > 3.4e38
    return model, x, y, {"loss": "mse"}


@_expects("forward", "wn4", "activation_overflow")
def case_critic_relu():
    """The user's critic with ReLU after its weights grew: activations blow up."""
    critic = models.critic("relu", g_init=1e10)
    x = np.abs(np.random.default_rng(0).standard_normal((16, 8))).astype("float32")
    y = np.zeros((16, 1), "float32")
    return critic, x, y, {}


@_expects("forward", "wn2", "invalid_arithmetic")
def case_critic_zero_norm():
    """The critic with a weight column that reached 0: 0 * g / 0 in forward."""
    critic = models.critic("relu")
    v = numpy([critic.get_layer("wn2").V])[0]
    v[:, 3] = 0.0
    critic.get_layer("wn2").V.assign(v)
    x = np.random.default_rng(0).standard_normal((16, 8)).astype("float32")
    return critic, x, np.zeros((16, 1), "float32"), {}


@_expects("loss", "policy", "log_of_zero")
def case_actor_log_of_zero():
    actor, x = _saturated_actor()
    y = np.tile(
        np.array([[0.0, 1.5]], "float32"), (4, 1)
    )  # took action 1, advantage 1.5
    return actor, x, y, {"loss": models.policy_gradient_loss}


@_expects("backward", "policy", "log_of_zero")
def case_actor_gathered_log():
    actor, x = _saturated_actor()
    actions = np.zeros((4,), "int32")  # took the likely action: loss finite
    return actor, x, actions, {"loss": models.gathered_log_prob_loss}


@_expects("loss", "out", "loss_overflow")
def case_loss_overflow():
    x, y = _xy()
    return _mlp(), x, y * 1e20, {"loss": "mse"}


@_expects("backward", "proj", "nonfinite_gradient")
def case_nonfinite_gradient():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(4, kernel_initializer="zeros", name="proj"),
            _Norm(name="norm"),
            keras.layers.Dense(1, name="head"),
        ]
    )
    x, y = _xy()
    return model, x, y, {"loss": "mse"}


@_expects("backward", "linear", "exploding_gradient")
def case_exploding_gradient():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="linear")])
    x, y = _xy()
    return model, x * 1e5, y, {"loss": "mse"}


@_expects("update", "hidden1", "update_overflow")
def case_update_overflow():
    x, y = _xy()
    # Gradients of order 10-100 (finite, not exploding): lr * g > 3.4e38.
    return _mlp(), x * 30, y, {"loss": "mse", "optimizer": keras.optimizers.SGD(1e38)}


CORPUS = {
    name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")
}


def test_corpus_covers_every_cause():
    # What each case must be diagnosed as, read without building its model
    # (test_broken_models_are_diagnosed builds each and checks it).
    assert set(EXPECTED) == set(CORPUS)
    covered = {cause for _, _, cause in EXPECTED.values()}
    assert covered == set(CAUSES)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_broken_models_are_diagnosed(name):
    model, x, y, kwargs = CORPUS[name]()
    stage, layer, cause = EXPECTED[name]
    before = numpy(model.weights)
    report = ng.diagnose(model, x, y, **kwargs)
    assert (report.stage, report.layer, report.causes[0]) == (stage, layer, cause), str(
        report
    )
    assert report.stage in STAGES and all(c in CAUSES for c in report.causes)
    assert report.hints and report.detail
    assert_bit_identical(before, numpy(model.weights), "weights after diagnose")
    assert f"at the {stage} stage" in str(report)


# ---------------------------------------------------------- healthy models
def healthy_mlp():
    x, y = _xy()
    return _mlp(init="he_normal"), x, y, {"loss": "mse"}


def healthy_cnn():
    actor = models.actor()
    x = np.random.default_rng(0).random((4, 36, 64, 3)).astype("float32")
    y = keras.utils.to_categorical([0, 1, 1, 0], 2)
    return actor, x, y, {"loss": "categorical_crossentropy"}


def healthy_functional_two_inputs():
    a, b = keras.Input((4,), name="a"), keras.Input((3,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(5, "tanh")(a), b])
    model = keras.Model([a, b], keras.layers.Dense(2)(h))
    rng = np.random.default_rng(0)
    x = [
        rng.standard_normal((8, 4)).astype("float32"),
        rng.standard_normal((8, 3)).astype("float32"),
    ]
    return model, x, rng.standard_normal((8, 2)).astype("float32"), {"loss": "mse"}


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.a = keras.layers.Dense(6, activation="relu")
        self.b = keras.layers.Dense(1)

    def call(self, x):
        return self.b(self.a(x))


def healthy_subclassed():
    x, y = _xy()
    return _Subclassed(), x, y, {"loss": "mse"}


def healthy_nested():
    inner = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(6, "relu"),
            keras.layers.BatchNormalization(),
        ],
        name="inner",
    )
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inner(inputs)))
    x, y = _xy()
    return model, x, y, {"loss": "mse"}


def healthy_lstm():
    model = keras.Sequential(
        [keras.Input((5, 3)), keras.layers.LSTM(4), keras.layers.Dense(1)]
    )
    rng = np.random.default_rng(0)
    return (
        model,
        rng.standard_normal((6, 5, 3)).astype("float32"),
        rng.standard_normal((6, 1)).astype("float32"),
        {"loss": "mse"},
    )


def healthy_critic_tanh():
    critic = models.critic("tanh")
    rng = np.random.default_rng(0)
    return (
        critic,
        rng.standard_normal((16, 8)).astype("float32"),
        rng.standard_normal((16, 1)).astype("float32"),
        {},
    )


def healthy_stable_actor():
    actor = models.actor(head=ng.StableSoftmax(log_probs=True, name="policy_logp"))
    actor.pop() if False else None
    x = np.random.default_rng(0).random((4, 36, 64, 3)).astype("float32")
    return (
        actor,
        x,
        np.array([0, 1, 1, 0]),
        {
            "loss": lambda a, logp: (
                -ops.mean(
                    ops.take_along_axis(
                        logp, ops.expand_dims(ops.cast(a, "int32"), -1), axis=-1
                    )
                )
            ),
            "optimizer": keras.optimizers.RMSprop(1e-3),
        },
    )


HEALTHY = {
    name[8:]: fn
    for name, fn in sorted(globals().items())
    if name.startswith("healthy_")
}


@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_healthy_models_raise_no_false_alarm(name):
    model, x, y, kwargs = HEALTHY[name]()
    report = ng.diagnose(model, x, y, **kwargs)
    assert report.healthy, str(report)
    assert report.causes == [] and np.isfinite(report.loss)
    assert report.layers and all(not s.nonfinite for s in report.layers)
    assert str(report).startswith("Diagnosis: healthy")


# ------------------------------------------------------------------ report
def test_report_text_and_json_for_the_two_user_cases():
    model, x, y, kwargs = case_actor_log_of_zero()
    actor = ng.diagnose(model, x, y, **kwargs)
    text = str(actor)
    assert "loss stage in layer 'policy'" in text
    assert "log_of_zero" in text and "StableSoftmax(log_probs=True)" in text
    stats = {s.name: s for s in actor.layers}
    assert stats["policy"].saturated_fraction == 1.0
    model, x, y, kwargs = case_critic_relu()
    critic = ng.diagnose(model, x, y, **kwargs)
    assert "forward stage in layer 'wn4'" in str(critic)
    assert "He initialisation" in str(critic)
    data = json.loads(json.dumps(critic.to_dict()))
    again = ng.Diagnosis.from_dict(data)
    assert (again.stage, again.layer, again.causes) == (
        critic.stage,
        critic.layer,
        critic.causes,
    )
    assert [s.name for s in again.layers] == [s.name for s in critic.layers]


def test_optimizer_state_is_left_untouched():
    x, y = _xy()
    model = _mlp()
    opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, verbose=0)
    before = numpy(opt.variables)
    report = ng.diagnose(model, x, y, optimizer=opt)
    assert report.healthy
    assert_bit_identical(before, numpy(opt.variables), "optimizer state")


def test_every_variable_is_left_untouched_seed_state_included():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(4),
            keras.layers.Dropout(0.5),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1),
        ]
    )
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    before = numpy(model.variables)
    assert len(before) > len(model.weights)  # the seed state is not a weight
    assert ng.diagnose(model, x, y, loss="mse").healthy
    assert_bit_identical(before, numpy(model.variables), "variables")


def test_needs_a_loss():
    x, y = _xy()
    with pytest.raises(ValueError, match="`loss` is needed"):
        ng.diagnose(_mlp(), x, y)
    with pytest.raises(TypeError, match="Received: loss=3"):
        ng.diagnose(_mlp(), x, y, loss=3)


def test_a_rejected_step_does_not_make_a_healthy_model_look_broken():
    # After a rejected step, SafeOptimizer's `last_grad_norm` and
    # `rejected_grad_norm` are NaN by design: reports, not state.
    x, y = _xy()
    model = _mlp()
    opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=opt, loss="mse")
    model.fit(ng.faults.poison(x, rows=[0]), y, batch_size=16, verbose=0)
    assert int(opt.skipped_steps) == 1
    assert np.isnan(float(opt.rejected_grad_norm))
    report = ng.diagnose(model, x, y, optimizer=opt)
    assert report.healthy, str(report)
    assert report.causes == []


def test_optimizer_by_name_or_a_clear_error():
    x, y = _xy()
    assert ng.diagnose(_mlp(), x, y, loss="mse", optimizer="adam").healthy
    with pytest.raises(TypeError, match=r"`optimizer` must be.*Received: optimizer=3"):
        ng.diagnose(_mlp(), x, y, loss="mse", optimizer=3)
