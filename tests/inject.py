"""Runs a strategy script with a fault planted, for the tests: python tests/inject.py SCRIPT ARGS...

The scripts hold no test hooks: this runner imports the script, replaces one of its functions,
and calls its main() as `python SCRIPT` would. harness.launch() goes through it when the
environment asks for one of these:

FAIL_AT=RANK:STEP:HOW  (RANK a number, or * for every rank) at the start of step STEP (when the
    checkpoint_if_due() of the step before returns): raise an exception, kill (SIGKILL), or nudge
    (move one parameter by ten times the script's tolerance in the run's precision: the check must FAIL).
FAIL_AT=RANK:STEP:HOW:save  while that rank writes the checkpoint of step STEP: kill, or oserror
    (the write fails as on a full disk).
STAGE_ALL=1  every buffer handed to MPI is a host copy, as on a GPU with an MPI that cannot read
    GPU memory: on the CPU this runs every copy back (from_mpi) and needs every staged buffer
    to be kept until its request completes.
"""
import errno
import importlib.util
import os
import signal
import sys

import mpi4py

mpi4py.rc.initialize = False
import torch  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402


def plant_failure(module, spec):
    who, step, how, *during = spec.split(":")
    step = int(step)

    def here():
        return who in ("*", str(module.MPI.COMM_WORLD.Get_rank()))

    if during == ["save"]:
        write_durably = module.write_durably

        def failing_write(path, data):
            if f"step-{step:06d}" in path and here():
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError(errno.ENOSPC, f"No space left on device (planted: FAIL_AT={spec})")
            return write_durably(path, data)
        module.write_durably = failing_write
        return

    stepped = []  # the optimizers that have taken a step, newest last
    register_optimizer_step_post_hook(lambda optimizer, *_: stepped.append(optimizer))
    checkpoint_if_due = module.checkpoint_if_due

    def failing_checkpoint(comm, args, at, make_shard, config):
        checkpoint_if_due(comm, args, at, make_shard, config)
        if at + 1 != step or not here():
            return
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how != "nudge":
            raise RuntimeError(f"planted failure (FAIL_AT={spec})")
        tolerance = module.TOLERANCE_BF16 if args.precision == "bf16" else module.TOLERANCE  # the run's own
        with torch.no_grad():
            stepped[-1].param_groups[0]["params"][0].view(-1)[0] += 10 * tolerance
    module.checkpoint_if_due = failing_checkpoint


def stage_everything(module):
    def host_copy(t, *args, **kwargs):  # what mpi_buffer gives for a GPU tensor: a copy
        return torch.empty(t.shape, dtype=t.dtype).copy_(t)
    module.mpi_buffer = host_copy
    for name in ("receive_buffer", "mpi_receive_buffer"):  # receives into a fresh host buffer
        if hasattr(module, name):
            setattr(module, name, lambda t, *args, **kwargs: torch.empty(t.shape, dtype=t.dtype))


def main():
    script, argv = sys.argv[1], sys.argv[2:]
    spec = importlib.util.spec_from_file_location("strategy", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules["strategy"] = module
    spec.loader.exec_module(module)
    if os.environ.get("FAIL_AT"):
        plant_failure(module, os.environ["FAIL_AT"])
    if os.environ.get("STAGE_ALL") == "1":
        stage_everything(module)
    sys.argv = [script, *argv]
    module.start_mpi()
    sys.excepthook = module.abort_on_exception
    sys.exit(module.main(argv))


if __name__ == "__main__":
    main()
