"""Keras's "Text generation with a miniature GPT": token and position
embeddings, a Transformer block with causal self-attention, a Dense layer to
the vocabulary; Adam, sparse categorical cross-entropy from logits, `fit`.
Character level, on the text of a module of Python's standard library (on
every machine), contexts of 32 characters.

Fault `"nan_weight"`: a NaN sample weight in one row (token data cannot be
NaN): the batch is rejected and `explain()` names `bad_data`.
"""

from __future__ import annotations

import inspect
import textwrap

import keras
import numpy as np
from keras import layers, ops

from examples._run import Run, callbacks, guard, optimizer

BACKENDS = ("tensorflow", "jax", "torch")
FAULTS = {"nan_weight": "bad_data"}
CONTEXT, WIDTH, HEADS = 32, 32, 2


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads, embed_dim)
        self.ffn = keras.Sequential(
            [layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        # The example builds the causal mask with `ops.tile` of a traced
        # shape, which JAX 0.7 and later refuse; MultiHeadAttention's own:
        attention_output = self.att(inputs, inputs, use_causal_mask=True)
        attention_output = self.dropout1(attention_output)
        out1 = self.layernorm1(inputs + attention_output)
        ffn_output = self.dropout2(self.ffn(out1))
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(0, maxlen, 1)
        return self.token_emb(x) + self.pos_emb(positions)


def data(rows: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Character contexts and their next characters, from `textwrap`'s source."""
    text = inspect.getsource(textwrap)
    chars = sorted(set(text))
    codes = np.array([chars.index(c) for c in text], "int32")
    starts = np.arange(rows) * 7 % (len(codes) - CONTEXT - 1)
    x = np.stack([codes[s : s + CONTEXT] for s in starts])
    y = np.stack([codes[s + 1 : s + CONTEXT + 1] for s in starts])
    return x, y, len(chars)


def train(mode: str, fault: str | None = None, seed: int = 0) -> Run:
    x, y, vocab = data(640)
    x_train, y_train, x_test, y_test = x[:512], y[:512], x[512:], y[512:]
    weights = np.ones(len(x_train), "float32")
    if fault == "nan_weight":
        weights[100] = np.nan
    keras.utils.set_random_seed(seed)
    inputs = layers.Input(shape=(CONTEXT,), dtype="int32")
    h = TokenAndPositionEmbedding(CONTEXT, vocab, WIDTH)(inputs)
    h = TransformerBlock(WIDTH, HEADS, WIDTH)(h)
    outputs = layers.Dense(vocab)(h)
    model = keras.Model(inputs=inputs, outputs=outputs)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt, nan_guard = optimizer(mode, keras.optimizers.Adam(3e-3)), guard(mode)
    model.compile(opt, loss=loss)
    history = model.fit(
        x_train,
        y_train,
        sample_weight=weights,
        batch_size=32,
        epochs=2,
        verbose=0,
        shuffle=False,
        callbacks=callbacks(nan_guard),
    )
    return Run(
        model,
        history.history["loss"],
        nan_guard,
        [opt],
        lambda: float(model.evaluate(x_test, y_test, verbose=0)),
    )
