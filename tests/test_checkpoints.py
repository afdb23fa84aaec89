"""Checkpoints and failures, end to end, the same scenarios for every strategy script.

A job is killed (SIGKILL) or fails on one rank; resuming must give exactly the result of a job
that never stopped, and a damaged or mismatched checkpoint must be refused with one line.
"""
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from harness import assert_refused, clean_env, last_json, launch, ranks_of, start

STOPPED = 75  # the exit status of a run stopped by a signal: the files' STOPPED, not 0, 1 or 2

# Each script with small, quick arguments: (flags, world size, does it shard its checkpoint?)
SCRIPTS = {
    "data_parallel.py": (["--batch-size", "24"], 4, False),
    "tensor_parallel.py": (["--hidden", "16", "--heads", "4", "--seq-len", "16", "--batch-size", "4",
                            "--sample-chars", "8"], 4, True),
    "pipeline_parallel.py": (["--hidden", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "8",
                              "--micro-batches", "4"], 4, True),
    "model_parallel.py": (["--hidden", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4"], 4, True),
}
# The scenarios below run on the classic four; the files beyond them have checkpoint tests of their
# own, and two of them join the scenarios here (a checkpoint that cannot be written; SIGTERM).
CLASSIC = list(SCRIPTS)
SCRIPTS.update({
    "sharded_data_parallel.py": (["--hidden", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "8",
                                  "--zero-stage", "3"], 4, False),
    "hybrid_parallel.py": (["--hidden", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "8",
                            "--tp", "2", "--pp", "2", "--micro-batches", "2"], 4, True),
    "context_parallel.py": (["--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "16",
                             "--batch-size", "4"], 2, False),
    "expert_parallel.py": (["--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "16",
                            "--batch-size", "12"], 2, True),
})
SHARDED = [script for script in CLASSIC if SCRIPTS[script][2]]
# A scenario decided wholly in the shared machinery (the manifest, the hashes, the atomic rename,
# the error hook: word for word alike in every file, as tests/test_machinery.py asserts) runs on
# two of the four, a different pair each time, so that every file meets several of them; the
# scenarios that read or write each file's own shards run on all four (a job killed mid-run and
# resumed, another model, another world size). A launch costs 5 to 10 s here: every one counts.
STEPS, EVERY = 12, 4  # checkpoints after steps 4, 8 and 12


def run(script, save, *extra, env=None, np=None):
    """At a constant rate: a resume here runs on past the first run's --steps, and the GPT files' default
    cosine is a function of --steps (a job that resumes with the same --steps continues it exactly)."""
    flags, world, _ = SCRIPTS[script]
    return launch(script, np or world, *flags, "--lr-schedule", "constant", "--steps", STEPS,
                  "--save-every", EVERY, "--save", save, "--no-check", "--json", *extra, env=env)


def latest(save):
    return sorted(p for p in Path(save).iterdir() if p.name.startswith("step-"))[-1]


def state(save, step=None):
    """Every tensor of every file of the latest checkpoint (or of step's), by file and key."""
    path = latest(save) if step is None else Path(save) / f"step-{step:06d}"
    return {f.name: torch.load(f, weights_only=True) for f in sorted(path.glob("*.pt"))}


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One run per script that is never stopped: the result every resumed run must equal."""
    runs = {}

    def get(script):
        if script not in runs:
            save = tmp_path_factory.mktemp(script.replace(".py", ""))
            runs[script] = (last_json(run(script, save)), state(save), save)
        return runs[script]
    return get


@pytest.fixture
def finished(uninterrupted, tmp_path):
    """A copy of the checkpoints of a finished uninterrupted run, to damage or resume."""
    def get(script):
        copy = tmp_path / "copy"
        shutil.copytree(uninterrupted(script)[2], copy)
        return copy
    return get


@pytest.mark.e2e
@pytest.mark.parametrize("fail_at, script", [("1:6:kill", script) for script in CLASSIC]  # mid-run
                         + [("0:8:kill:save", "data_parallel.py"), ("0:8:kill:save", "model_parallel.py")])  # writing step 8
def test_killed_job_resumes_to_exactly_the_same_result(script, fail_at, tmp_path, uninterrupted):
    whole, whole_state, _ = uninterrupted(script)
    killed = run(script, tmp_path, env=clean_env(FAIL_AT=fail_at))
    assert killed.returncode != 0
    assert latest(tmp_path).name == "step-000004"  # the checkpoint being written never completed
    assert (tmp_path / ".tmp-step-000008").exists() == fail_at.endswith(":save")
    resumed = last_json(run(script, tmp_path, "--resume"))
    assert resumed["losses"] == whole["losses"]  # bit for bit on CPU
    assert same(state(tmp_path), whole_state)


@pytest.mark.e2e
@pytest.mark.parametrize("script", ["data_parallel.py", "model_parallel.py", "hybrid_parallel.py"])
def test_a_checkpoint_that_cannot_be_written_ends_the_job_with_one_line(script, tmp_path, uninterrupted):
    """A full disk while rank 0 (which writes in every file) writes step 8: one line naming the step, exit 1 on every rank,
    step 4 whole; --resume then continues from step 4 to the uninterrupted result."""
    whole, whole_state, _ = uninterrupted(script)
    failed = run(script, tmp_path, env=clean_env(FAIL_AT="0:8:oserror:save"))
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr
    assert len(errors) == 1 and "checkpoint of step 8 could not be written" in errors[0], failed.stderr
    assert "No space left on device" in errors[0] and "step-000004" in errors[0]
    assert [p.name for p in tmp_path.iterdir() if "step" in p.name] == ["step-000004"]
    resumed = last_json(run(script, tmp_path, "--resume"))
    assert resumed["losses"] == whole["losses"] and same(state(tmp_path), whole_state)


@pytest.mark.e2e
def test_data_parallel_resumes_under_every_flag_that_changes_the_computation(tmp_path):
    """Killed at step 6 and resumed, with --check: the check replays all 12 steps in one process,
    so a learning-rate schedule that restarted, or accumulation state lost, would FAIL it.
    (Per-rank BatchNorm across a resume: the world-size test below, without --sync-bn.)"""
    flags = ["--warmup-steps", "6", "--scale-lr", "--accum-steps", "2", "--sync-bn"]
    # 48: 6 samples per rank and micro-step, so that the run also passes with --sync-bn dropped: with
    # 3 (batch 24) per-rank BatchNorm amplifies rounding to 4.5e-5 over 12 steps (data_parallel.py).
    base = ["--batch-size", "48", "--steps", STEPS, "--save-every", EVERY, "--save", tmp_path, "--json", *flags]
    killed = launch("data_parallel.py", 4, *base, "--no-check", env=clean_env(FAIL_AT="1:6:kill"))
    assert killed.returncode != 0 and latest(tmp_path).name == "step-000004"
    resumed = last_json(launch("data_parallel.py", 4, *base, "--resume"))
    assert resumed["check_max_abs_diff"] <= 2e-5


@pytest.mark.e2e
@pytest.mark.parametrize("sync_bn", [[], ["--sync-bn"]])
def test_data_parallel_resumed_at_another_world_size_passes_its_check(sync_bn, tmp_path):
    """4 ranks for 4 steps, then 2 ranks for 4 more: the check replays what really happened
    (the manifest's world sizes), so per-rank BatchNorm does not make a false FAIL."""
    base = ["--batch-size", "24", "--save", tmp_path, "--json", *sync_bn]
    assert launch("data_parallel.py", 4, *base, "--steps", 4, "--no-check").returncode == 0
    resumed = last_json(launch("data_parallel.py", 2, *base, "--steps", 8, "--resume"))
    assert resumed["world_size"] == 2 and len(resumed["losses"]) == 8
    assert resumed["check_max_abs_diff"] <= 2e-5


def damage_shard(checkpoint, how):
    shard = max(checkpoint.glob("*.pt"), key=lambda p: int(p.stem.split("-")[1]))  # the last rank's
    data = bytearray(shard.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[:len(data) // 3]
    shard.write_bytes(bytes(data))


@pytest.mark.e2e
@pytest.mark.parametrize("damage, script", [("flip", "data_parallel.py"), ("flip", "pipeline_parallel.py"),
                                           ("truncate", "tensor_parallel.py"), ("truncate", "model_parallel.py")])
def test_damaged_checkpoints_are_refused_when_none_is_whole(script, finished, damage):
    save = finished(script)
    for checkpoint in (p for p in save.iterdir() if p.name.startswith("step-")):  # steps 8 and 12
        damage_shard(checkpoint, damage)
    line = assert_refused(run(script, save, "--resume", "--steps", STEPS + EVERY), "no whole checkpoint")
    assert "step-000012 is damaged" in line and "step-000008 is damaged" in line


@pytest.mark.e2e
@pytest.mark.parametrize("script, damage", [("data_parallel.py", "flip"), ("sharded_data_parallel.py", "truncate"),
                                           ("hybrid_parallel.py", "truncate"), ("tensor_parallel.py", "flip")])
def test_a_damaged_latest_checkpoint_gives_way_to_the_one_before_on_every_rank(script, damage, finished, uninterrupted):
    """The last rank's file of step 12 damaged: --resume says so, every rank trains on from step 8
    (none from its own whole file of step 12: a state joined from two checkpoints trains on from
    no state any run produced), and steps 9 to 12 come out as the uninterrupted run's, bit for bit:
    the losses and the checkpoint of step 12."""
    save = finished(script)
    damage_shard(save / "step-000012", damage)
    result = run(script, save, "--resume", "--steps", STEPS + EVERY)
    said = [line for line in result.stdout.splitlines() if line.startswith("--resume: ")]
    assert len(said) == 1 and "step-000012 is damaged" in said[0], result.stdout + result.stderr
    assert said[0].endswith("step-000008, the newest whole checkpoint"), said
    whole, whole_state, _ = uninterrupted(script)
    assert last_json(result)["losses"][:STEPS] == whole["losses"] and same(state(save, STEPS), whole_state)


@pytest.mark.e2e
@pytest.mark.parametrize("script", ["tensor_parallel.py", "pipeline_parallel.py"])
def test_checkpoint_of_another_strategy_is_refused(script, finished):
    save = finished(script)
    manifest = latest(save) / "manifest.json"
    content = json.loads(manifest.read_text())
    content["strategy"] = "some_other_strategy"
    manifest.write_text(json.dumps(content))
    assert_refused(run(script, save, "--resume", "--steps", STEPS + EVERY), "was written by some_other_strategy")


@pytest.mark.e2e
@pytest.mark.parametrize("script", ["data_parallel.py", "model_parallel.py"])
def test_resuming_a_finished_run_is_refused(script, finished):
    assert_refused(run(script, finished(script), "--resume"), "leaves nothing to train")


@pytest.mark.e2e
@pytest.mark.parametrize("script", SHARDED)
def test_checkpoint_of_another_model_is_refused(script, finished):
    """A shard fits only the model that wrote it: here one block more."""
    assert_refused(run(script, finished(script), "--resume", "--steps", STEPS + EVERY, "--layers", 5), "holds a model")


@pytest.mark.e2e
@pytest.mark.parametrize("script", ["data_parallel.py", "pipeline_parallel.py"])
def test_resume_on_a_folder_without_a_checkpoint_starts_from_step_0(script, tmp_path, uninterrupted):
    """One batch script serves the first submission and every requeue: --resume on an empty folder."""
    result = run(script, tmp_path, "--resume")
    assert f"--resume: no checkpoint in {tmp_path} yet: starting from step 0" in result.stdout
    assert last_json(result)["losses"] == uninterrupted(script)[0]["losses"]


@pytest.mark.e2e
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_sigterm_to_every_rank_saves_at_a_step_boundary_and_the_resumed_run_ends_as_the_whole(
        script, tmp_path, uninterrupted):
    """A batch system's time limit: SIGTERM to every rank mid-run. The ranks agree at the next
    step boundary, save, say so in one line and exit well within Slurm's 30 s, with STOPPED:
    neither 0 (a finished run, never requeued) nor an error's; --resume then reaches the
    uninterrupted run's losses and state bit for bit."""
    whole, whole_state, _ = uninterrupted(script)
    flags, world, _ = SCRIPTS[script]
    job = start(script, world, *flags, "--lr-schedule", "constant", "--steps", STEPS, "--save-every", EVERY,
                "--save", tmp_path, "--no-check", "--json", "--log-every", 1)
    try:
        for line in job.stdout:  # wait until training runs
            if line.startswith("step 2/"):
                break
        ranks = ranks_of(job, script)
        assert len(ranks) == world, ranks
        signalled = time.monotonic()
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
        out, err = job.communicate(timeout=60)
        took = time.monotonic() - signalled
    finally:
        job.kill()
    stop = [line for line in out.splitlines() if line.startswith("stopped by a signal after step")]
    assert job.returncode == STOPPED and len(stop) == 1 and took < 30, (job.returncode, took, out, err)
    step = int(stop[0].split("after step ")[1].split()[0])
    assert 2 <= step < STEPS and latest(tmp_path).name == f"step-{step:06d}", stop
    resumed = last_json(run(script, tmp_path, "--resume"))
    assert resumed["losses"] == whole["losses"] and same(state(tmp_path), whole_state)


@pytest.mark.e2e
@pytest.mark.parametrize("script", CLASSIC)
def test_another_world_size(script, finished):
    """A checkpoint resumes at another world size, sharded or not (each file's own tests compare the
    continued run with an uninterrupted one on the new grid)."""
    _, world, _ = SCRIPTS[script]
    save = finished(script)
    result = run(script, save, "--resume", "--steps", STEPS + EVERY, np=world // 2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resumed from {save} at step {STEPS} (written by {world} ranks)" in result.stdout


@pytest.mark.e2e
@pytest.mark.parametrize("script", ["tensor_parallel.py", "model_parallel.py"])
def test_an_exception_on_one_rank_ends_the_job(script, tmp_path):
    flags, world, _ = SCRIPTS[script]
    result = launch(script, world, *flags, "--steps", 10_000, "--no-check", timeout=60,
                    env=clean_env(FAIL_AT=f"{world - 1}:3:raise"))
    assert result.returncode != 0
    assert f"rank {world - 1}:" in result.stderr and "planted failure" in result.stderr
