"""Checkpoints and failures, end to end, the same scenarios for every strategy script.

A job is killed (SIGKILL) or fails on one rank; resuming must give exactly the result of a job
that never stopped, and a damaged or mismatched checkpoint must be refused with one line.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch

from harness import assert_refused, clean_env, last_json, launch

# Each script with small, quick arguments: (flags, world size, does it shard its checkpoint?)
SCRIPTS = {
    "data_parallel.py": (["--batch-size", "24"], 4, False),
    "tensor_parallel.py": (["--hidden", "16", "--heads", "4", "--seq-len", "16", "--batch-size", "4",
                            "--sample-chars", "8"], 4, True),
    "pipeline_parallel.py": (["--hidden", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "8",
                              "--micro-batches", "4"], 4, True),
    "model_parallel.py": (["--hidden", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4"], 4, True),
}
SHARDED = [script for script, (_, _, sharded) in SCRIPTS.items() if sharded]
STEPS, EVERY = 12, 4  # checkpoints after steps 4, 8 and 12


def run(script, save, *extra, env=None, np=None):
    flags, world, _ = SCRIPTS[script]
    return launch(script, np or world, *flags, "--steps", STEPS, "--save-every", EVERY,
                  "--save", save, "--no-check", "--json", *extra, env=env)


def latest(save):
    return sorted(p for p in Path(save).iterdir() if p.name.startswith("step-"))[-1]


def state(save):
    """Every tensor of every file of the latest checkpoint, by file and key."""
    path = latest(save)
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
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("fail_at", ["1:6:kill", "0:8:kill:save"])  # mid-run; while writing step 8
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
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_checkpoint_is_refused(script, finished, damage):
    save = finished(script)
    shard = sorted(latest(save).glob("*.pt"))[-1]
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[:len(data) // 3]
    shard.write_bytes(bytes(data))
    assert_refused(run(script, save, "--resume", "--steps", STEPS + EVERY), "is damaged")


@pytest.mark.e2e
@pytest.mark.parametrize("script", SCRIPTS)
def test_checkpoint_of_another_strategy_is_refused(script, finished):
    save = finished(script)
    manifest = latest(save) / "manifest.json"
    content = json.loads(manifest.read_text())
    content["strategy"] = "some_other_strategy"
    manifest.write_text(json.dumps(content))
    assert_refused(run(script, save, "--resume", "--steps", STEPS + EVERY), "was written by some_other_strategy")


@pytest.mark.e2e
@pytest.mark.parametrize("script", SCRIPTS)
def test_resuming_a_finished_run_is_refused(script, finished):
    assert_refused(run(script, finished(script), "--resume"), "leaves nothing to train")


@pytest.mark.e2e
@pytest.mark.parametrize("script", SHARDED)
def test_checkpoint_of_another_model_is_refused(script, finished):
    """A shard fits only the model that wrote it: here one block more."""
    assert_refused(run(script, finished(script), "--resume", "--steps", STEPS + EVERY, "--layers", 5), "holds a model")


@pytest.mark.e2e
@pytest.mark.parametrize("script", SCRIPTS)
def test_resume_without_a_checkpoint_is_refused(script, tmp_path):
    assert_refused(run(script, tmp_path, "--resume"), "no complete checkpoint")


@pytest.mark.e2e
@pytest.mark.parametrize("script", SCRIPTS)
def test_another_world_size(script, finished):
    """Sharded checkpoints need the world size that wrote them; a replicated one loads anywhere."""
    _, world, sharded = SCRIPTS[script]
    save = finished(script)
    result = run(script, save, "--resume", "--steps", STEPS + EVERY, np=world // 2)
    if sharded:
        assert_refused(result, f"written by {world} ranks")
    else:
        assert result.returncode == 0, result.stderr
        assert f"resumed from {save} at step {STEPS} (written by {world} ranks)" in result.stdout


@pytest.mark.e2e
@pytest.mark.parametrize("script", SCRIPTS)
def test_an_exception_on_one_rank_ends_the_job(script, tmp_path):
    flags, world, _ = SCRIPTS[script]
    result = launch(script, world, *flags, "--steps", 10_000, "--no-check", timeout=60,
                    env=clean_env(FAIL_AT=f"{world - 1}:3:raise"))
    assert result.returncode != 0
    assert f"rank {world - 1}:" in result.stderr and "injected failure" in result.stderr
