"""The two models from the user's reports, for the tests.

They live in `notebooks/report_models.py`, with the notebooks whose story they
are (and which `benchmarks/bench_diagnose.py` imports too); this module puts
that folder on the path and re-exports them, so that every test, notebook and
benchmark builds the very same models under one module name.
"""

import os
import sys

_NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "notebooks")
if _NOTEBOOKS not in sys.path:
    sys.path.insert(0, _NOTEBOOKS)

from report_models import (  # noqa: E402, F401  (re-exported)
    WeightNormDense,
    actor,
    critic,
    gathered_log_prob_loss,
    policy_gradient_loss,
)
