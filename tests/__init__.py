"""The test suite (`python -m tests` runs it, as the README says).

`notebooks/` goes on the path here, before any test module is imported: the
models of the user's reports (`report_models`) and the corpus of runs with
known fates (`run_corpus`) live there, with the notebooks whose story they
are, and the tests import them from there."""

import os
import sys

_NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "notebooks")
if _NOTEBOOKS not in sys.path:
    sys.path.insert(0, _NOTEBOOKS)
