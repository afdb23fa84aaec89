"""Every rejected input in the README's table, run as written: exit 2, one `error:` line."""
import re
import shlex

import pytest
import torch

from harness import ROOT, assert_refused, launch


def table_rows():
    """(example command or None, message) for each row of the README's table of rejected inputs."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## When things go wrong")[1].split("\n## ")[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[2].startswith("`error:"):
            command = cells[1].strip("`") if cells[1].startswith("`mpirun") else None
            rows.append((command, cells[2].strip("`")))
    return rows


ROWS = table_rows()


def test_the_table_is_there():
    assert len(ROWS) >= 10


@pytest.mark.parametrize("command, message", [r for r in ROWS if r[0] is None])
def test_rows_without_a_command_are_covered_by_the_checkpoint_tests(command, message):
    """These need a checkpoint on disk first; test_checkpoints.py makes one and refuses it."""
    source = (ROOT / "tests" / "test_checkpoints.py").read_text()
    checked = re.findall(r'^\s*assert_refused\(.*,\s*f?"([^"]+)"\)$', source, re.M)
    patterns = [re.escape(p).replace(r"\{", "{").replace(r"\}", "}") for p in checked]
    patterns = [re.sub(r"\{[^}]*\}", ".+", p) for p in patterns]  # f-string fields match anything
    assert any(re.search(p, message) for p in patterns), (message, checked)


@pytest.mark.e2e
@pytest.mark.parametrize("command, message", [r for r in ROWS if r[0] is not None])
def test_each_rejected_input_exits_2_with_its_message(command, message):
    if "--device cuda" in command and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    mpirun, np_flag, np, python, script, *args = shlex.split(command)
    assert (mpirun, np_flag, python) == ("mpirun", "-np", "python")
    parts = message.split("...")
    line = assert_refused(launch(script, int(np), *args, timeout=60), parts[0].rstrip())
    assert line.startswith(parts[0].rstrip()) and line.rstrip().endswith(parts[-1].strip())
