import faulthandler
import os
import sys
import time

# The suite runs on the CPU whatever the machine: a GPU node would otherwise run every in-process
# test on CUDA (--device auto). GPU runs are a separate, opt-in command: python bench/run.py --gpu
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest
from mpi4py import MPI  # noqa: F401  MPI starts here: importing a strategy file leaves it to start_mpi()

TEST_TIMEOUT = 300  # seconds per test; a hung collective ends the process, and so the job


def pytest_collection_modifyitems(config, items):
    """End-to-end launches go last and run on rank 0 alone.

    Ranks waiting in a collective spin on the CPU. If rank 0 launched mpirun jobs between
    in-process tests, the other ranks would spin beside the launched job for its whole run.
    """
    from harness import world
    e2e = [item for item in items if item.get_closest_marker("e2e")]
    items[:] = [item for item in items if not item.get_closest_marker("e2e")] + e2e
    if world().Get_rank() != 0:
        skip = pytest.mark.skip(reason="end-to-end launches run on rank 0")
        for item in e2e:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """An exception on one rank ends the job at once, as in the scripts: its peers may be waiting
    in a collective it will never enter, and would sit there until TEST_TIMEOUT without a word of
    which test failed. A failed `assert agree(...)` is no such case: every rank fails it together,
    and the suite goes on."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None and not call.excinfo.errisinstance(AssertionError) \
            and not item.get_closest_marker("e2e") and MPI.COMM_WORLD.Get_size() > 1:
        rank = MPI.COMM_WORLD.Get_rank()
        print(f"\nrank {rank}: {item.nodeid} raised {call.excinfo.typename}: {call.excinfo.value}\n"
              f"{report.longreprtext}\nrank {rank}: ending the job (MPI_Abort), its peers may be waiting in a "
              f"collective", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)


def pytest_runtest_setup(item):
    faulthandler.dump_traceback_later(TEST_TIMEOUT, exit=True)


def pytest_runtest_teardown(item):
    faulthandler.cancel_dump_traceback_later()


def pytest_sessionfinish(session, exitstatus):
    """Ranks done early wait here without spinning while rank 0 runs the launches."""
    from harness import world
    request = world().Ibarrier()
    while not request.Test():
        time.sleep(0.05)
