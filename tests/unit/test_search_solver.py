"""The ILP solver, as the search runs it, solves the ILPs the search makes, and right.

Two ILPs of the search, saved with pulp's ``LpProblem.to_json`` (``tests/fixtures/ilps/``):

- ``maverick_highs_abort``: one of the Llama 4 Maverick search (``benchmarks/plan_speed.py
  --maverick``). At HiGHS's default feasibility tolerance, HiGHS 1.16.0 corrupted its heap on
  it and glibc ended the process (``free(): invalid pointer``): ``autopar plan`` died without a
  message. It is solved in a child process, so that an abort fails this test instead of ending
  the suite.
- ``relaxation_wrong_optimum``: a per-rank relaxation of a hypothesis-drawn cost table
  (test_search_ilp_pattern.py). At the default tolerance, HiGHS 1.11-1.15 called 17.939 optimal;
  CBC, HiGHS 1.16.0 and the tolerance the search sets give 17.589, and the search's optimality
  proof rests on it (a relaxation above the true optimum is no bound).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ILPS = Path(__file__).resolve().parents[1] / "fixtures" / "ilps"

_SOLVE = """
import gzip, sys, tempfile
import pulp
from autopar.search.ilp import _solver
from autopar.search.options import SearchOptions

with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
    file.write(gzip.decompress(open(sys.argv[1], "rb").read()).decode())
    file.flush()
    _, problem = pulp.LpProblem.from_json(file.name)
problem.solve(_solver(SearchOptions(time_limit_s=60.0, mip_gap=0.0)))
print(pulp.LpStatus[problem.status], pulp.value(problem.objective))
"""


def _solve(name: str) -> tuple[str, float | None]:
    proc = subprocess.run([sys.executable, "-c", _SOLVE, str(ILPS / f"{name}.json.gz")],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    status, value = proc.stdout.split()[-2:]
    return status, None if value == "None" else float(value)


@pytest.mark.timeout(300)
def test_the_solver_finishes_an_ilp_that_aborted_highs() -> None:
    # The split it stands for does not fit: the search moves on to the next candidate.
    assert _solve("maverick_highs_abort")[0] == "Infeasible"


@pytest.mark.timeout(300)
def test_the_solver_finds_the_optimum_cbc_finds() -> None:
    status, value = _solve("relaxation_wrong_optimum")
    assert status == "Optimal"
    assert value == pytest.approx(17.589, rel=1e-6)  # CBC's optimum
