"""Shared fixtures. The backend comes from KERAS_BACKEND (default tensorflow).

Two devices are made available for the distribution tests, before the
backend initialises: two logical CPUs on TensorFlow, two host devices on JAX.
Single-device code (everything else) still runs on the first one.

Tests marked `backend_free` need no backend; `python -m tests` runs them under
one backend and sets NANGUARD_SKIP_BACKEND_FREE=1 for the others, where they
are skipped. A plain `pytest` run (one backend) runs them.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if os.environ["KERAS_BACKEND"] == "jax":
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=2"
    # JAX's compilation cache, empty at the start of each run: a computation
    # XLA has compiled once this run (the same model's train step in a test's
    # guarded and reference runs, in the next test, `lax.cond`'s branches in
    # eager steps) is read back instead of compiled again. The executable is
    # the one XLA made; nothing the tests assert depends on compile counts.
    # It took the JAX run's CPU time from 213 s to 90 s on test_dropin_matrix
    # and test_fit (2-core VM). A cache dir of the user's own is kept.
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        import atexit
        import shutil
        import tempfile

        _cache = tempfile.mkdtemp(prefix="nanguard-jax-cache-")
        atexit.register(shutil.rmtree, _cache, ignore_errors=True)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import gc

import keras
import pytest

BACKEND = keras.backend.backend()

if BACKEND == "tensorflow":
    import tensorflow as tf

    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        _cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )

if BACKEND == "torch":
    import torch

    # One intra-op thread: the tests' tensors are far below the size torch
    # splits across threads, so a second thread only spins (OpenMP waits
    # busily after each op), on cores the other backends' runs need. On the
    # 2-core VM: 700 fit steps (test_spikes) took 27 s of CPU instead of 61,
    # and less time too.
    torch.set_num_threads(1)


# The workers of tests/launch.py are programs run as processes, not modules
# to import (each starts its job when imported).
collect_ignore_glob = ["workers/*.py"]

SKIP_BACKEND_FREE = os.environ.get("NANGUARD_SKIP_BACKEND_FREE") == "1"


def pytest_report_header(config):
    header = f"keras {keras.__version__}, KERAS_BACKEND={BACKEND}"
    if SKIP_BACKEND_FREE:
        header += " (backend_free tests skipped: run under another backend)"
    return header


def pytest_collection_finish(session):
    # What is alive now (the backend, every test module and its imports)
    # lives as long as the run: out of the collector's sight, the
    # `gc.collect()` of each test's `clear_session` takes milliseconds, not
    # 0.25-0.7 s (measured on 2 CPU cores: JAX 0.25 s, TensorFlow 0.63 s,
    # torch 0.69 s).
    gc.collect()
    gc.freeze()


# Docstring examples that use no backend (NumPy, pure Python), marked here.
BACKEND_FREE_DOCTESTS = {
    "keras_nanguard.diagnosis.causes",
    "keras_nanguard.diagnosis.causes.hints_for",
    "keras_nanguard.errors.NonFiniteError",
    "keras_nanguard.faults.LearningRateSpike",
    "keras_nanguard.faults.PoisonedBatches",
    "keras_nanguard.faults.poison",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if isinstance(item, pytest.DoctestItem) and item.name in BACKEND_FREE_DOCTESTS:
            item.add_marker(pytest.mark.backend_free)
    if not SKIP_BACKEND_FREE:
        return
    skip = pytest.mark.skip(reason="backend_free: `python -m tests` runs it once")
    for item in items:
        if item.get_closest_marker("backend_free"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_keras():
    keras.utils.clear_session()  # collects the garbage of the tests before
    gc.freeze()  # and what outlived them: the next collection skips it
    keras.utils.set_random_seed(0)
    policy = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(policy)
