"""torch: the hot paths never read a device value back to the host.

A host read (`aten._local_scalar_dense`: a Python branch on a tensor) is a
device sync on a GPU. Counted exactly with a `TorchDispatchMode`.
"""

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from tests.helpers import BACKEND
from tests.models import linear_stack as _model

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="torch dispatch only")


def _host_reads(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "_local_scalar_dense":
                Count.reads += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.reads


@pytest.mark.parametrize("clip", [None, "adaptive"])
@pytest.mark.parametrize("clipnorm", [None, 1.0])
@pytest.mark.parametrize("fault", [None, "nan"])
def test_safe_optimizer_step_reads_nothing_back(clipnorm, fault, clip):
    import torch

    model = _model()
    reset = 2 if clip else None  # the moment reset's select too
    opt = ng.SafeOptimizer(
        keras.optimizers.Adam(0.1), clipnorm=clipnorm, clip=clip, reset_moments=reset
    )
    tv = model.trainable_variables
    grads = [torch.ones(tuple(v.shape)) for v in tv]
    opt.apply(grads, tv)  # build, warm up
    if fault:
        grads = ng.faults.corrupt_gradients(grads, fault, 0)
    assert _host_reads(lambda: opt.apply(grads, tv)) == 0
    assert int(opt.skipped_steps) == (1 if fault else 0)


def test_whole_model_transaction_reads_nothing_back():
    import torch

    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.BatchNormalization(), keras.layers.Dense(2)]
    )
    # Adam: Keras's own torch SGD reads its learning rate back (`alpha=`).
    opt = ng.SafeOptimizer(keras.optimizers.Adam(0.1))
    x = torch.ones((4, 3))

    def step():
        with opt.transaction(model):
            model(x, training=True)
            grads = [
                torch.full(tuple(v.shape), np.nan) for v in model.trainable_variables
            ]
            opt.apply(grads, model.trainable_variables)

    step()
    assert _host_reads(step) == 0
    assert int(opt.skipped_steps) == 2


@pytest.mark.parametrize("log_probs", [False, True])
def test_stable_softmax_reads_nothing_back(log_probs):
    import torch

    layer = ng.StableSoftmax(log_probs=log_probs)
    logits = torch.tensor([[1.0, 2.0], [float("inf"), 0.0], [-float("inf")] * 2])
    assert _host_reads(lambda: layer(logits)) == 0
