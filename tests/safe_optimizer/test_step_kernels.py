"""The fixed cost of a SafeOptimizer step, counted exactly: on JAX the host
callbacks and the kernels (XLA fusions) of one compiled train step, on torch
the graphs and graph breaks Dynamo makes of a `jit_compile=True` step, on
TensorFlow the XLA program of a `jit_compile=True` step, the same at every
step (the recorder's step counter read as a compile-time constant made each
step compile again, about 1 s on a small model). (A host
callback under a `cond` in every JAX step, even one that never fired, made a
small model's step 3x slower, and no timing saw it.)"""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from tests.helpers import BACKEND

jax_only = pytest.mark.skipif(BACKEND != "jax", reason="XLA's compiled text")
torch_only = pytest.mark.skipif(BACKEND != "torch", reason="Dynamo's graphs")
tensorflow_only = pytest.mark.skipif(
    BACKEND != "tensorflow", reason="TensorFlow's XLA clusters"
)

# A host call from a compiled step: `io_callback`, `pure_callback`,
# `jax.debug.print`/`callback` (each is a custom call into Python).
# Under sharding JAX names it `xla_ffi_partitioned_python_*_callback`.
HOST_CALL = re.compile(r'custom_call_target="xla_(?:ffi_)?(?:partitioned_)?python')


def _compiled_text(function, *args) -> str:
    import jax

    return jax.jit(function).lower(*args).compile().as_text()


X, Y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")


def _fitted(optimizer, callbacks=(), jit_compile="auto") -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer, "mse", jit_compile=jit_compile)
    # Builds everything (and attaches the SafeOptimizer, with NaNGuard).
    model.fit(X, Y, batch_size=8, verbose=0, callbacks=list(callbacks))
    return model


def _train_step_text(optimizer, callbacks=()) -> str:
    """One compiled train step: Keras's, or with NaNGuard among `callbacks`
    the step the SafeOptimizer attached to the model."""
    model = _fitted(optimizer, callbacks)
    x, y = X, Y
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    return _compiled_text(model.train_step, state, (x, y))


def _fusions(text: str) -> int:
    # Every computation's, the branches of a `cond` (the recorder's probe)
    # and loop bodies included.
    return len(re.findall(r" fusion\(", text))


@jax_only
def test_the_host_call_counter_sees_a_callback_under_a_cond():
    # The counter below can fail: the form the flight recorder's alarm had.
    import jax
    from jax.experimental import io_callback

    def step(flag, value):
        jax.lax.cond(
            flag, lambda: io_callback(lambda v: None, None, value), lambda: None
        )
        return value + 1

    text = _compiled_text(step, np.bool_(False), np.int32(1))
    assert len(HOST_CALL.findall(text)) == 1


@jax_only
@pytest.mark.parametrize("recorder", [False, True])
def test_a_safe_step_calls_no_host_function(recorder):
    safe = ng.SafeOptimizer(keras.optimizers.Adam(1e-3), flight_recorder=recorder)
    assert HOST_CALL.findall(_train_step_text(safe)) == []
    # Attached by NaNGuard, whose early warning (on by default) reads the
    # alarm by polling.
    safe = ng.SafeOptimizer(keras.optimizers.Adam(1e-3), flight_recorder=recorder)
    assert HOST_CALL.findall(_train_step_text(safe, [ng.NaNGuard(verbose=0)])) == []


@jax_only
def test_the_kernels_a_safe_step_adds_are_pinned():
    # Exact at the pinned JAX of the `ci` extra; a change of the step that
    # adds kernels must say so here and rerun `bench_examples.py --kernels`.
    import jax

    if jax.__version__ != "0.10.2":
        pytest.skip(f"counts pinned for jax 0.10.2, not {jax.__version__}")
    plain = _fusions(_train_step_text(keras.optimizers.Adam(1e-3)))
    clipnorm = _fusions(
        _train_step_text(keras.optimizers.Adam(1e-3, global_clipnorm=1.0))
    )
    safe = _fusions(_train_step_text(ng.SafeOptimizer(keras.optimizers.Adam(1e-3))))
    bare = _fusions(
        _train_step_text(
            ng.SafeOptimizer(keras.optimizers.Adam(1e-3), flight_recorder=False)
        )
    )
    # The transaction adds 36 to clipnorm's step; the flight recorder 26,
    # 7 of them in its probe's branch (a `cond`).
    assert (plain, clipnorm, bare, safe) == (24, 26, 62, 88)


def _dynamo(optimizer, callbacks=()) -> tuple[int, list[str]]:
    """The graphs Dynamo makes of a `jit_compile=True` train step, and why
    it broke them (the first line of each reason)."""
    import torch

    model = _fitted(optimizer, callbacks, jit_compile=False)  # explain compiles
    torch._dynamo.reset()
    found = torch._dynamo.explain(model.train_step)((torch.tensor(X), torch.tensor(Y)))
    return found.graph_count, [b.reason.splitlines()[0] for b in found.break_reasons]


@torch_only
@pytest.mark.slow  # torch.compile: ~30 s of Dynamo
def test_a_compiled_torch_step_breaks_only_where_keras_s_does():
    # Keras's torch step breaks its graph once, at `loss.backward()`. A host
    # read (`.item()`, a Python branch on a tensor) would break it again
    # with its own reason: the guarded steps add none. Exact at the pinned
    # torch of the `ci` extra.
    import torch

    if torch.__version__.split("+")[0] != "2.13.0":
        pytest.skip(f"counts pinned for torch 2.13.0, not {torch.__version__}")
    backward = ["Unsupported Tensor.backward() call"]
    assert _dynamo(keras.optimizers.Adam(1e-3)) == (2, backward)
    assert _dynamo(keras.optimizers.Adam(1e-3, global_clipnorm=1.0)) == (2, backward)
    assert _dynamo(ng.SafeOptimizer(keras.optimizers.Adam(1e-3))) == (2, backward)
    # Attached by NaNGuard: Keras's step runs inside the model's
    # transaction, and Dynamo resumes after the break in each frame that
    # encloses it: more graphs, the same one reason.
    attached = _dynamo(
        ng.SafeOptimizer(keras.optimizers.Adam(1e-3)), [ng.NaNGuard(verbose=0)]
    )
    assert attached == (5, backward)


@tensorflow_only
@pytest.mark.parametrize("recorder", [False, True])
def test_an_xla_step_is_the_same_program_at_every_step(recorder):
    # The GradientTape loop of Keras's guide, in `tf.function(jit_compile=
    # True)` (what `fit` compiles on a GPU, jit_compile="auto"). XLA takes
    # a variable that an op needs as a constant into the program, by value:
    # a program that differs from one step to the next is compiled again.
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)]
    )
    opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-3), flight_recorder=recorder)
    opt.build(model.trainable_variables)

    @tf.function(jit_compile=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((model(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        return loss

    x, y = tf.constant(X), tf.constant(Y)
    programs = []
    for _ in range(3):
        programs.append(step.experimental_get_compiler_ir(x, y)(stage="hlo"))
        step(x, y)
    assert int(opt.iterations) == 3
    assert programs[0] == programs[1] == programs[2]
