"""The two models from the user's reports live with the tutorials (they are
the story the notebooks tell); the tests use the very same code."""

import os
import sys

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "notebooks")
)

from tutorial import (
    WeightNormDense,
    actor,
    critic,
    gathered_log_prob_loss,
    policy_gradient_loss,
)

__all__ = [
    "WeightNormDense",
    "actor",
    "critic",
    "gathered_log_prob_loss",
    "policy_gradient_loss",
]
