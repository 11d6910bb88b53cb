"""Keras's "WGAN-GP overriding `Model.train_step`": a critic trained
`d_steps` times per generator step, a gradient penalty computed with nested
`tf.GradientTape`s, two optimizers given to an overridden `compile`, no
`call()`. Shrunk to scikit-learn's 8x8 digits (TensorFlow, as the example).

Fault `"nan_image"`: a NaN pixel in one real image: the critic's steps on
that batch are rejected, the generator's (which never sees real images) are
not, and `explain()` names `bad_data`. (A critic rate far too high does not
go non-finite here: a Wasserstein critic is linear in its last layer, and
its loss grows to 1e23 while staying finite; NaNGuard's early warning names
`learning_rate_too_high` at a rate of 1e5, not at 1e3.)
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers, ops
from sklearn.datasets import load_digits

from examples._run import Run, callbacks, guard, optimizer

BACKENDS = ("tensorflow",)
FAULTS = {"nan_image": "bad_data"}
NOISE = 8


def networks() -> tuple[keras.Model, keras.Model]:
    critic = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            layers.Conv2D(16, 3, strides=2, padding="same"),
            layers.LeakyReLU(0.2),
            layers.Flatten(),
            layers.Dense(1),
        ],
        name="critic",
    )
    generator = keras.Sequential(
        [
            keras.Input((NOISE,)),
            layers.Dense(4 * 4 * 16),
            layers.LeakyReLU(0.2),
            layers.Reshape((4, 4, 16)),
            layers.Conv2DTranspose(1, 3, strides=2, padding="same", activation="tanh"),
        ],
        name="generator",
    )
    return critic, generator


class WGAN(keras.Model):
    def __init__(
        self,
        discriminator,
        generator,
        latent_dim,
        discriminator_extra_steps=3,
        gp_weight=10.0,
    ):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_steps = discriminator_extra_steps
        self.gp_weight = gp_weight

    def compile(self, d_optimizer, g_optimizer, d_loss_fn, g_loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.d_loss_fn = d_loss_fn
        self.g_loss_fn = g_loss_fn

    def gradient_penalty(self, batch_size, real_images, fake_images):
        import tensorflow as tf

        alpha = tf.random.uniform([batch_size, 1, 1, 1], 0.0, 1.0)
        interpolated = real_images + alpha * (fake_images - real_images)
        with tf.GradientTape() as gp_tape:
            gp_tape.watch(interpolated)
            pred = self.discriminator(interpolated, training=True)
        grads = gp_tape.gradient(pred, [interpolated])[0]
        norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1, 2, 3]))
        return tf.reduce_mean((norm - 1.0) ** 2)

    def train_step(self, real_images):
        import tensorflow as tf

        batch_size = tf.shape(real_images)[0]
        for _ in range(self.d_steps):
            random_latent_vectors = tf.random.normal(
                shape=(batch_size, self.latent_dim)
            )
            with tf.GradientTape() as tape:
                fake_images = self.generator(random_latent_vectors, training=True)
                fake_logits = self.discriminator(fake_images, training=True)
                real_logits = self.discriminator(real_images, training=True)
                d_cost = self.d_loss_fn(real_img=real_logits, fake_img=fake_logits)
                gp = self.gradient_penalty(batch_size, real_images, fake_images)
                d_loss = d_cost + gp * self.gp_weight
            d_gradient = tape.gradient(d_loss, self.discriminator.trainable_variables)
            self.d_optimizer.apply_gradients(
                zip(d_gradient, self.discriminator.trainable_variables)
            )
        random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
        with tf.GradientTape() as tape:
            generated_images = self.generator(random_latent_vectors, training=True)
            gen_img_logits = self.discriminator(generated_images, training=True)
            g_loss = self.g_loss_fn(gen_img_logits)
        gen_gradient = tape.gradient(g_loss, self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(
            zip(gen_gradient, self.generator.trainable_variables)
        )
        return {"d_loss": d_loss, "g_loss": g_loss}


def discriminator_loss(real_img, fake_img):
    return ops.mean(fake_img) - ops.mean(real_img)


def generator_loss(fake_img):
    return -ops.mean(fake_img)


def train(mode: str, fault: str | None = None, seed: int = 0) -> Run:
    images = (
        (load_digits().data[:384] / 8.0 - 1.0).reshape(-1, 8, 8, 1).astype("float32")
    )
    if fault == "nan_image":
        images[100, 4, 4, 0] = np.nan
    keras.utils.set_random_seed(seed)
    import tensorflow as tf

    tf.random.set_seed(seed)
    wgan = WGAN(*networks(), latent_dim=NOISE)
    d_opt = optimizer(mode, keras.optimizers.Adam(2e-4, beta_1=0.5, beta_2=0.9))
    g_opt = optimizer(mode, keras.optimizers.Adam(2e-4, beta_1=0.5, beta_2=0.9))
    nan_guard = guard(mode)
    wgan.compile(d_opt, g_opt, discriminator_loss, generator_loss)
    history = wgan.fit(
        images,
        batch_size=32,
        epochs=2,
        verbose=0,
        shuffle=False,
        callbacks=callbacks(nan_guard),
    )

    def check() -> float:
        clean = images[~np.isnan(images).any(axis=(1, 2, 3))][:64]
        return float(ops.convert_to_numpy(ops.mean(wgan.discriminator(clean))))

    return Run(wgan, history.history["d_loss"], nan_guard, [d_opt, g_opt], check)
