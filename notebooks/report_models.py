"""The two models from the user's reports, scaled down where CPU time demands.

They live with the notebooks, whose story they are: `tutorial.py` re-exports
them (`tutorial.actor()`, ...). The tests that check diagnose and SafeOptimizer
on them (through `tests/models.py`) and `benchmarks/bench_diagnose.py` import
this module too, so each builds the very same models; it imports nothing but
Keras, so importing it sets no backend and loads no notebook data.

- The actor (Keras): image observation in [0, 1]; Conv2D 16/32/64 3x3 ReLU each
  followed by 2x2 max-pooling; Flatten; Dense 64 ReLU, 32 ReLU, 2 softmax;
  RMSprop(1e-3). The report uses 288x512x3 images; tests use 36x64x3 (the
  benchmarks use the full size).
- The critic (TF1 style): weight-normalised dense layers
  `y = (x @ V) * g / sqrt(sum(V**2, axis=0)) + b`, V Glorot, g = 1, b = 0.1;
  `cell_size` units -> 32 -> 32 -> 32 (linear) -> 1; value loss
  `mean((discounted_r - v)**2)` plus L1 0.005 on all weights;
  RMSprop(lr 1e-4, rho 0.99, momentum 0, epsilon 1e-6), each gradient clipped
  to norm 5.
"""

import keras
from keras import ops

__all__ = [
    "WeightNormDense",
    "actor",
    "critic",
    "gathered_log_prob_loss",
    "policy_gradient_loss",
]


@keras.saving.register_keras_serializable(package="keras_nanguard_tutorial")
class WeightNormDense(keras.layers.Layer):
    """`(x @ V) * g / sqrt(sum(V**2, axis=0)) + b`, as in the user's critic."""

    def __init__(
        self, units, activation=None, g_init=1.0, b_init=0.1, l1=0.005, **kwargs
    ):
        super().__init__(**kwargs)
        self.units = units
        self.activation = keras.activations.get(activation)
        self.g_init, self.b_init, self.l1 = g_init, b_init, l1

    def build(self, input_shape):
        reg = keras.regularizers.L1(self.l1) if self.l1 else None
        self.V = self.add_weight(
            shape=(input_shape[-1], self.units),
            name="V",
            initializer="glorot_uniform",
            regularizer=reg,
        )
        self.g = self.add_weight(
            shape=(self.units,),
            name="g",
            regularizer=reg,
            initializer=keras.initializers.Constant(self.g_init),
        )
        self.b = self.add_weight(
            shape=(self.units,),
            name="b",
            regularizer=reg,
            initializer=keras.initializers.Constant(self.b_init),
        )

    def call(self, x):
        norm = ops.sqrt(ops.sum(ops.square(self.V), axis=0))
        return self.activation(ops.matmul(x, self.V) * self.g / norm + self.b)

    def get_config(self):
        config = super().get_config()
        config.update(
            units=self.units,
            activation=keras.activations.serialize(self.activation),
            g_init=self.g_init,
            b_init=self.b_init,
            l1=self.l1,
        )
        return config


def critic(activation="tanh", state_dim=8, cell_size=64, g_init=1.0):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((state_dim,)),
            WeightNormDense(cell_size, activation, g_init, name="wn1"),
            WeightNormDense(32, activation, g_init, name="wn2"),
            WeightNormDense(32, activation, g_init, name="wn3"),
            WeightNormDense(32, None, g_init, name="wn4"),
            WeightNormDense(1, None, name="value"),
        ],
        name="critic",
    )
    model.compile(
        optimizer=keras.optimizers.RMSprop(
            1e-4, rho=0.99, momentum=0.0, epsilon=1e-6, clipnorm=5.0
        ),
        loss="mse",
    )
    return model


def actor(image=(36, 64, 3), head=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input(image),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv2"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu", name="conv3"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu", name="dense64"),
            keras.layers.Dense(32, activation="relu", name="dense32"),
            head or keras.layers.Dense(2, activation="softmax", name="policy"),
        ],
        name="actor",
    )
    model.compile(optimizer=keras.optimizers.RMSprop(1e-3))
    return model


def policy_gradient_loss(y_true, probs):
    """The user's loss: -log(prob of the taken action) * advantage, with
    `y_true` = one-hot(action) * advantage."""
    return -ops.sum(y_true * ops.log(probs), axis=-1)


def gathered_log_prob_loss(actions, probs):
    """log(probs) of the whole matrix, then the taken action gathered: the
    loss stays finite when another action's probability is 0, its gradient
    does not."""
    logp = ops.log(probs)
    taken = ops.take_along_axis(
        logp, ops.expand_dims(ops.cast(actions, "int32"), -1), axis=-1
    )
    return -ops.mean(taken)
