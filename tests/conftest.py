"""Shared fixtures. The backend comes from KERAS_BACKEND (default tensorflow)."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import pytest

BACKEND = keras.backend.backend()


def pytest_report_header(config):
    return f"keras {keras.__version__}, KERAS_BACKEND={BACKEND}"


@pytest.fixture(autouse=True)
def _fresh_keras():
    keras.utils.clear_session()
    keras.utils.set_random_seed(0)
    policy = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(policy)
