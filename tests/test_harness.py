"""The suite's own harness: one failing rank ends the test job instead of hanging it."""
import shutil
import subprocess
import sys
import time

import pytest

from harness import ROOT, belongs_to_a_rank, clean_env


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


@pytest.mark.parametrize("name, removed", [
    ("OMPI_MCA_orte_hnp_uri", True), ("OMPI_MCA_orte_local_daemon_uri", True), ("OMPI_MCA_orte_num_nodes", True),
    ("OMPI_MCA_orte_app_num", True), ("OMPI_MCA_orte_precondition_transports", True),
    ("OMPI_MCA_orte_top_session_dir", True), ("OMPI_COMM_WORLD_RANK", True), ("PMI_FD", True), ("PMIX_RANK", True),
    ("OMPI_MCA_orte_tmpdir_base", False), ("OMPI_MCA_orte_keep_fqdn_hostnames", False), ("OMPI_MCA_btl", False),
    ("PMIX_MCA_gds", False), ("OMPI_ALLOW_RUN_AS_ROOT", False), ("HYDRA_LAUNCHER", False)])
def test_a_launch_drops_what_the_enclosing_job_gave_its_ranks_and_keeps_the_users_settings(name, removed):
    assert belongs_to_a_rank(name) is removed
