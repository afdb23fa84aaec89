"""The suite's own harness: one failing rank ends the test job instead of hanging it."""
import shutil
import subprocess
import sys
import time

import pytest

from harness import ROOT, clean_env


@pytest.mark.e2e
def test_an_in_process_test_that_raises_on_one_rank_ends_the_test_job_at_once_naming_it(tmp_path):
    """Rank 1 raises while rank 0 waits in a barrier: without the hook, rank 0 would wait there
    until the suite's TEST_TIMEOUT (300 s) and print no word of the failing test."""
    for name in ("conftest.py", "harness.py"):
        shutil.copy(ROOT / "tests" / name, tmp_path / name)
    (tmp_path / "test_one_rank_raises.py").write_text(
        "import pytest\nfrom harness import world\n\n\n@pytest.mark.mpi\ndef test_rank_1_raises():\n"
        "    if world().Get_rank() == 1:\n        raise KeyError('planted')\n    world().Barrier()\n")
    start = time.monotonic()
    result = subprocess.run(["mpirun", "-np", "2", sys.executable, "-m", "pytest", "--with-mpi", "-p",
                             "no:cacheprovider", "test_one_rank_raises.py"], cwd=tmp_path, env=clean_env(),
                            capture_output=True, text=True, timeout=120)
    took, output = time.monotonic() - start, result.stdout + result.stderr
    assert result.returncode != 0 and took < 60, (took, output)
    assert "rank 1: test_one_rank_raises.py::test_rank_1_raises raised KeyError: 'planted'" in output, output
