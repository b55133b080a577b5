"""The ILP solver the search runs finishes the ILPs the search makes.

``tests/fixtures/ilps/maverick_highs_abort.json.gz`` is one ILP of the Llama 4 Maverick search
(``benchmarks/plan_speed.py --maverick``), saved with pulp's ``LpProblem.to_json``: HiGHS 1.16.0
corrupted its heap on it and glibc ended the process (``free(): invalid pointer``), so
``autopar plan`` died without a message. It is solved in a child process, so that an abort fails
this test instead of ending the suite.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ILP = Path(__file__).resolve().parents[1] / "fixtures" / "ilps" / "maverick_highs_abort.json.gz"

_SOLVE = """
import gzip, json, sys, tempfile
import pulp
from autopar.search.ilp import _solver
from autopar.search.options import SearchOptions

with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
    file.write(gzip.decompress(open(sys.argv[1], "rb").read()).decode())
    file.flush()
    _, problem = pulp.LpProblem.from_json(file.name)
problem.solve(_solver(SearchOptions()))
print(pulp.LpStatus[problem.status])
"""


@pytest.mark.timeout(300)
def test_the_solver_finishes_an_ilp_that_aborted_highs_1_16() -> None:
    proc = subprocess.run([sys.executable, "-c", _SOLVE, str(ILP)], capture_output=True,
                          text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The split it stands for does not fit: the search moves on to the next candidate.
    assert proc.stdout.split()[-1] == "Infeasible", proc.stdout
