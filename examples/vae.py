"""Keras's "Variational AutoEncoder": an encoder and a decoder (functional
models), a `Sampling` layer, and a `VAE` model with its own `train_step`
and no `call()`; Adam, `fit`. Shrunk to scikit-learn's 8x8 digits. The
train step is written for the backend in use, as Keras's guides write it:
`tf.GradientTape` on TensorFlow, `loss.backward()` on PyTorch.

Fault `"rate"`: Adam at 1.0 instead of 1e-3: the first step drives
`z_log_var` so high that `exp` overflows at the next; NaNGuard rolls back
to the state before it, with a lower rate, and training goes on;
`explain()` names `learning_rate_too_high`.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers, ops
from sklearn.datasets import load_digits

from examples._run import Run, callbacks, guard, optimizer

BACKENDS = (
    "tensorflow",
)  # plain Keras cannot build a model with no call() before a torch or JAX fit
FAULTS = {"rate": "learning_rate_too_high"}
LATENT = 2


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch, dim = ops.shape(z_mean)[0], ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def encoder_decoder() -> tuple[keras.Model, keras.Model]:
    encoder_inputs = keras.Input(shape=(8, 8, 1))
    x = layers.Conv2D(8, 3, activation="relu", strides=2, padding="same")(
        encoder_inputs
    )
    x = layers.Flatten()(x)
    x = layers.Dense(16, activation="relu")(x)
    z_mean = layers.Dense(LATENT, name="z_mean")(x)
    z_log_var = layers.Dense(LATENT, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")
    latent_inputs = keras.Input(shape=(LATENT,))
    x = layers.Dense(4 * 4 * 8, activation="relu")(latent_inputs)
    x = layers.Reshape((4, 4, 8))(x)
    x = layers.Conv2DTranspose(8, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = layers.Conv2DTranspose(
        1, 3, activation="sigmoid", padding="same"
    )(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")
    return encoder, decoder


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(
            name="reconstruction_loss"
        )
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [
            self.total_loss_tracker,
            self.reconstruction_loss_tracker,
            self.kl_loss_tracker,
        ]

    def losses_of(self, data):
        z_mean, z_log_var, z = self.encoder(data)
        reconstruction = self.decoder(z)
        reconstruction_loss = ops.mean(
            ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2))
        )
        kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
        kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
        return reconstruction_loss + kl_loss, reconstruction_loss, kl_loss

    def train_step(self, data):
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                total_loss, reconstruction_loss, kl_loss = self.losses_of(data)
            grads = tape.gradient(total_loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        else:  # torch
            import torch

            self.zero_grad()
            total_loss, reconstruction_loss, kl_loss = self.losses_of(data)
            total_loss.backward()
            grads = [v.value.grad for v in self.trainable_weights]
            with torch.no_grad():
                self.optimizer.apply(grads, self.trainable_weights)
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }


def data() -> np.ndarray:
    return (load_digits().data / 16.0).reshape(-1, 8, 8, 1).astype("float32")


def train(mode: str, fault: str | None = None, seed: int = 0) -> Run:
    images = data()
    train_images, test_images = images[:512], images[512:640]
    keras.utils.set_random_seed(seed)
    vae = VAE(*encoder_decoder())
    rate = 3.0 if fault == "rate" else 1e-3
    opt, nan_guard = optimizer(mode, keras.optimizers.Adam(rate)), guard(mode)
    vae.compile(optimizer=opt)
    history = vae.fit(
        train_images,
        epochs=3,
        batch_size=32,
        verbose=0,
        shuffle=False,
        callbacks=callbacks(nan_guard),
    )

    def check() -> float:
        return float(ops.convert_to_numpy(vae.losses_of(test_images)[0]))

    return Run(vae, history.history["loss"], nan_guard, [opt], check)
