"""Keras's "Text classification with Transformer": token and position
embeddings, a Transformer block (MultiHeadAttention, feed-forward, residual
LayerNormalization, Dropout), global average pooling, softmax; Adam, `fit`.
The task: does token 1 occur more often than token 2 in the sequence.

Fault `"nan_embedding_input"` cannot exist for integer tokens, so the fault
is a NaN sample weight: the batch is rejected and explained as `bad_data`.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers, ops

from examples._run import Run, callbacks, guard, optimizer

BACKENDS = ("tensorflow", "jax", "torch")
FAULTS = {"nan_weight": "bad_data"}
VOCAB, LENGTH = 20, 16


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=False):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output, training=training)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        return self.token_emb(x) + self.pos_emb(positions)


def data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, (n, LENGTH)).astype("int32")
    y = ((x == 1).sum(axis=1) > (x == 2).sum(axis=1)).astype("int32")
    return x, y


def train(mode: str, fault: str | None = None, seed: int = 0) -> Run:
    x, y = data(512, seed)
    x_test, y_test = data(128, seed + 1)
    weights = np.ones(len(x), "float32")
    if fault == "nan_weight":
        weights[100] = np.nan
    keras.utils.set_random_seed(seed)
    inputs = layers.Input(shape=(LENGTH,))
    h = TokenAndPositionEmbedding(LENGTH, VOCAB, 16)(inputs)
    h = TransformerBlock(16, 2, 16)(h)
    h = layers.GlobalAveragePooling1D()(h)
    h = layers.Dropout(0.1)(h)
    outputs = layers.Dense(2, activation="softmax")(h)
    model = keras.Model(inputs=inputs, outputs=outputs)
    opt, nan_guard = optimizer(mode, keras.optimizers.Adam(3e-3)), guard(mode)
    model.compile(opt, "sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(
        x,
        y,
        sample_weight=weights,
        batch_size=32,
        epochs=3,
        verbose=0,
        shuffle=False,
        callbacks=callbacks(nan_guard),
    )
    return Run(
        model,
        history.history["loss"],
        nan_guard,
        [opt],
        lambda: float(model.evaluate(x_test, y_test, verbose=0)[0]),
    )
