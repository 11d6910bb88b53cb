"""Memory traffic of one optimizer step, counted exactly (no timing).

Optimizer steps are memory-bound on accelerators, so the bytes a step moves
are its cost there. Two exact proxies, measurable on a CPU:

- JAX: XLA's own cost analysis of one jitted `stateless_apply`
  (`jax.jit(f).lower(...).compile().cost_analysis()["bytes accessed"]`).
- torch: the bytes read and written by every aten op of one `apply`, counted
  with a `TorchDispatchMode` (inputs and outputs of each op; views and
  metadata ops count nothing), and the host reads (`aten._local_scalar_dense`:
  a Python branch on a device value, a device sync on a GPU).

For RMSprop and Adam: the inner optimizer with `global_clipnorm=1.0`, the
same inside `SafeOptimizer(clipnorm=1.0)`, with `spike_factor=10` where
available, and on JAX the exact transaction written by hand in `jax.numpy`
(norm, RMSprop update, check of the new values, `where`) for scale.
Figures are bytes per parameter on a 10-layer dense model of ~9M
parameters (the model only shapes the variables; no forward pass runs).

Usage:
    KERAS_BACKEND=jax python benchmarks/bench_step_traffic.py
    KERAS_BACKEND=torch python benchmarks/bench_step_traffic.py
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
from _torch_traffic import traffic  # this folder is on sys.path

import keras_nanguard as ng

BACKEND = keras.backend.backend()


def _model(width: int):
    return keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width) for _ in range(9)]
        + [keras.layers.Dense(10)]
    )


def _configs(name: str) -> dict:
    make = {
        "rmsprop": lambda **k: keras.optimizers.RMSprop(1e-3, **k),
        "adam": lambda **k: keras.optimizers.Adam(1e-3, **k),
    }[name]
    configs = {
        "global_clipnorm": lambda: make(global_clipnorm=1.0),
        "safe": lambda: ng.SafeOptimizer(make(), clipnorm=1.0),
    }
    if "spike_factor" in ng.SafeOptimizer.__init__.__code__.co_varnames:
        configs["safe_spike"] = lambda: ng.SafeOptimizer(
            make(), clipnorm=1.0, spike_factor=10.0
        )
    return configs


def _grads(model):
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal(v.shape).astype("float32") * 1e-3
        for v in model.trainable_variables
    ]


def jax_bytes(model, optimizer) -> float:
    import jax

    tv = model.trainable_variables
    optimizer.build(tv)
    grads = [jax.numpy.asarray(g) for g in _grads(model)]

    def step(opt_values, grads, tv_values):
        return optimizer.stateless_apply(opt_values, grads, tv_values)

    compiled = (
        jax.jit(step)
        .lower([v.value for v in optimizer.variables], grads, [v.value for v in tv])
        .compile()
    )
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # older JAX: one dict per computation
        analysis = analysis[0]
    return float(analysis["bytes accessed"])


def jax_reference_bytes(model) -> float:
    """The exact RMSprop transaction by hand: norm, clip, update, check, where."""
    import jax
    import jax.numpy as jnp

    tv = [v.value for v in model.trainable_variables]
    vs = [jnp.zeros_like(w) for w in tv]
    grads = [jnp.asarray(g) for g in _grads(model)]

    def step(ws, vs, gs):
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in gs))
        factor = jnp.minimum(1.0, 1.0 / norm)
        new_v = [
            0.9 * v + 0.1 * jnp.square(g * factor) for v, g in zip(vs, gs, strict=True)
        ]
        new_w = [
            w - 1e-3 * g * factor / (jnp.sqrt(v) + 1e-7)
            for w, g, v in zip(ws, gs, new_v, strict=True)
        ]
        ok = jnp.isfinite(norm) & jnp.all(
            jnp.stack([jnp.isfinite(jnp.sum(x)) for x in new_w + new_v])
        )

        def keep(new, old):
            return [jnp.where(ok, n, o) for n, o in zip(new, old, strict=True)]

        return keep(new_w, ws), keep(new_v, vs)

    analysis = jax.jit(step).lower(tv, vs, grads).compile().cost_analysis()
    if isinstance(analysis, list):
        analysis = analysis[0]
    return float(analysis["bytes accessed"])


def torch_traffic(model, optimizer) -> tuple[float, int]:
    import torch

    tv = model.trainable_variables
    grads = [torch.as_tensor(g) for g in _grads(model)]
    optimizer.apply(grads, tv)  # build and warm up: buffers are made once

    return traffic(lambda: optimizer.apply(grads, tv))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1000)
    parser.add_argument("--optimizers", default="rmsprop,adam")
    args = parser.parse_args()
    n_params = _model(args.width).count_params()
    print(f"backend {BACKEND}, {n_params / 1e6:.2f}M parameters, bytes per parameter")
    rows = []
    for name in args.optimizers.split(","):
        base = None
        for config, make in _configs(name).items():
            keras.utils.clear_session()
            model = _model(args.width)
            if BACKEND == "jax":
                value, reads = jax_bytes(model, make()) / n_params, "-"
            elif BACKEND == "torch":
                total, reads = torch_traffic(model, make())
                value = total / n_params
            else:
                raise SystemExit("KERAS_BACKEND must be jax or torch")
            base = value if base is None else base
            rows.append((name, config, value, value / base, reads))
        if BACKEND == "jax" and name == "rmsprop":
            keras.utils.clear_session()
            value = jax_reference_bytes(_model(args.width)) / n_params
            rows.append((name, "hand-written jnp", value, value / base, "-"))
    print(
        "| optimizer | configuration | bytes/param | ratio to global_clipnorm | host reads |"
    )
    print("|---|---|---|---|---|")
    for name, config, value, ratio, reads in rows:
        print(f"| {name} | {config} | {value:.2f} | {ratio:.3f} | {reads} |")


if __name__ == "__main__":
    main()
