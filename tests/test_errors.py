"""Every rejected input in docs/errors.md's table and the README's common rows, run as written: exit 2,
one `error:` line."""
import ast
import shlex

import pytest

from harness import ROOT, assert_refused, launch


def table_rows():
    """(example command, or the test file that runs the row, and its message) for each row of the
    tables of rejected inputs: docs/errors.md's, every one, and the README's common ones (each once)."""
    readme = (ROOT / "README.md").read_text().split("## Checkpoints and errors")[1].split("\n## ")[0]
    rows = []
    for line in ((ROOT / "docs" / "errors.md").read_text() + "\n" + readme).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[2].startswith("`error:"):
            command = cells[1].strip("`") if cells[1].startswith("`mpirun") else cells[1]
            if (command, cells[2].strip("`")) not in rows:
                rows.append((command, cells[2].strip("`")))
    return rows


def test_the_readmes_common_rows_are_in_the_full_table():
    full = (ROOT / "docs" / "errors.md").read_text()
    readme = (ROOT / "README.md").read_text().split("## Checkpoints and errors")[1].split("\n## ")[0]
    common = [line for line in readme.splitlines() if line.startswith("| ") and "`error:" in line]
    assert common and all(line in full for line in common)


ROWS = table_rows()
RUN_BY = {"(checkpoint tests)": "test_checkpoints.py", "(machinery tests)": "test_machinery.py"}


def test_the_table_is_there():
    assert len(ROWS) >= 10


@pytest.mark.parametrize("where, message", [r for r in ROWS if not r[0].startswith("mpirun")])
def test_rows_without_a_command_name_the_tests_that_run_them(where, message):
    """These need a checkpoint on disk, a node-local folder or another MPI library: the test file
    the row names refuses the input and checks a distinctive part of the message."""
    source = (ROOT / "tests" / RUN_BY[where]).read_text()
    literals = [node.value for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) >= 10]
    assert any(part in message for part in literals), (message, where)


@pytest.mark.e2e
@pytest.mark.parametrize("command, message", [r for r in ROWS if r[0].startswith("mpirun")])
def test_each_rejected_input_exits_2_with_its_message(command, message):
    """Within the harness's launch timeout: on 2 cores under a load average of 29, four ranks took
    56 s to start torch and refuse (60 s was too tight); a hang still fails."""
    mpirun, np_flag, np, python, script, *args = shlex.split(command)
    assert (mpirun, np_flag, python) == ("mpirun", "-np", "python")
    parts = message.split("...")
    line = assert_refused(launch(script, int(np), *args), parts[0].rstrip())
    assert line.startswith(parts[0].rstrip()) and line.rstrip().endswith(parts[-1].strip())


PRESENT = [s for s in ("data_parallel.py", "tensor_parallel.py", "pipeline_parallel.py", "model_parallel.py",
                       "sharded_data_parallel.py", "hybrid_parallel.py", "context_parallel.py",
                       "expert_parallel.py") if (ROOT / s).exists()]


UNWRITABLE = [("--save", "/proc/nope", "cannot write /proc/nope"),
              ("--save", "README.md", "cannot write README.md: a file, not a folder"),
              ("--trace", "/nonexistent/dir/t.json", "cannot write /nonexistent/dir/t.json")]


@pytest.mark.e2e
@pytest.mark.parametrize("script, flag, path, words", [  # data_parallel.py's rows: docs/errors.md's
    (script, *UNWRITABLE[i % len(UNWRITABLE)]) for i, script in enumerate(s for s in PRESENT if s != "data_parallel.py")])
def test_a_path_that_cannot_be_written_is_refused_before_training(script, flag, path, words):
    """Every file, before it builds anything: one line, exit 2, no step printed. The paths are
    checked by the shared machinery, alike in every file: each file meets one of them in turn."""
    assert_refused(launch(script, 2, flag, path, "--steps", 100_000), words)
