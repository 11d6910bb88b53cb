"""Keras's "GAN overriding `Model.train_step`" (and DCGAN): a discriminator
and a generator, a `GAN` model with no `call()` that overrides `compile` to
take two optimizers (calling `super().compile()` with none) and
`train_step` to train each in turn. Shrunk to scikit-learn's 8x8 digits.
The train step is written for the backend in use, as Keras's guides write
it: `tf.GradientTape` on TensorFlow, `loss.backward()` on PyTorch.

NaNGuard finds the two SafeOptimizers the model holds (`d_optimizer`,
`g_optimizer`): it watches their counters and flight records, snapshots and
restores both optimizers' state, and lowers both rates at a rollback.

Fault `"nan_image"`: a NaN pixel in one real image: the discriminator's step
on that batch is rejected (the generator's, which never sees real images,
is not) and `explain()` names `bad_data`.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers, ops
from sklearn.datasets import load_digits

from examples._run import Run, callbacks, guard, optimizer

BACKENDS = ("tensorflow",)  # the torch form: plain Keras cannot build it
FAULTS = {"nan_image": "bad_data"}
LATENT = 8


def networks() -> tuple[keras.Model, keras.Model]:
    discriminator = keras.Sequential(
        [
            keras.Input(shape=(8, 8, 1)),
            layers.Conv2D(16, 3, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.GlobalMaxPooling2D(),
            layers.Dense(1),
        ],
        name="discriminator",
    )
    generator = keras.Sequential(
        [
            keras.Input(shape=(LATENT,)),
            layers.Dense(4 * 4 * 16),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Reshape((4, 4, 16)),
            layers.Conv2DTranspose(16, 4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(1, 3, padding="same", activation="sigmoid"),
        ],
        name="generator",
    )
    return discriminator, generator


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, real_images):
        import tensorflow as tf

        batch_size = ops.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        generated_images = self.generator(random_latent_vectors)
        combined_images = ops.concatenate([generated_images, real_images], axis=0)
        labels = ops.concatenate(
            [ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0
        )
        labels += 0.05 * keras.random.uniform(
            ops.shape(labels), seed=self.seed_generator
        )
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(
            zip(grads, self.discriminator.trainable_weights)
        )
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        misleading_labels = ops.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {
            "d_loss": self.d_loss_tracker.result(),
            "g_loss": self.g_loss_tracker.result(),
        }


def train(mode: str, fault: str | None = None, seed: int = 0) -> Run:
    images = (load_digits().data[:512] / 16.0).reshape(-1, 8, 8, 1).astype("float32")
    if fault == "nan_image":
        images[100, 4, 4, 0] = np.nan
    keras.utils.set_random_seed(seed)
    gan = GAN(*networks(), latent_dim=LATENT)
    d_opt = optimizer(mode, keras.optimizers.Adam(3e-4))
    g_opt = optimizer(mode, keras.optimizers.Adam(3e-4))
    nan_guard = guard(mode)
    gan.compile(d_opt, g_opt, keras.losses.BinaryCrossentropy(from_logits=True))
    history = gan.fit(
        images,
        epochs=2,
        batch_size=32,
        verbose=0,
        shuffle=False,
        callbacks=callbacks(nan_guard),
    )

    def check() -> float:
        clean = images[~np.isnan(images).any(axis=(1, 2, 3))][:64]
        labels = np.zeros((len(clean), 1), "float32")
        return float(
            ops.convert_to_numpy(gan.loss_fn(labels, gan.discriminator(clean)))
        )

    return Run(gan, history.history["d_loss"], nan_guard, [d_opt, g_opt], check)
