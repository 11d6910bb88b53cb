"""Collection for the whole tree (`testpaths` holds `tests` and the package,
whose docstrings run as doctests). Each backend's module of
`keras_nanguard/_backend/` imports its framework and has no doctest: only
the chosen backend's is collected, so that the test command runs with one
backend installed (`pip install -e '.[test]'`, or torch and `test-tools`).
"""

import os

_BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")
collect_ignore = [
    f"keras_nanguard/_backend/{name}.py"
    for name in ("tensorflow", "jax", "torch")
    if name != _BACKEND
]
