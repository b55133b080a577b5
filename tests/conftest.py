"""Hypothesis profiles: the README's test command draws the same examples on every run.

``default`` (what ``python -m pytest -q`` and CI use) derives each test's examples from the test
itself (``derandomize``), so a run on a clean checkout passes or fails the same way every time.
``explore`` draws fresh random examples on each run and keeps failures in the local example
database: ``HYPOTHESIS_PROFILE=explore python -m pytest -q tests/unit``. It is how
a developer hunts for new counter-examples (a solver's wrong optimum was found by a random
draw); a failure it finds becomes an ``@example`` or a fixture in the test.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("default", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)

_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")
if _PROFILE not in ("default", "explore"):
    raise ValueError(f"HYPOTHESIS_PROFILE must be default or explore, not {_PROFILE!r}")
settings.load_profile(_PROFILE)
