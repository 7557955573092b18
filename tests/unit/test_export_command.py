"""`trainstack export` on something that is not a checkpoint: one line, exit 2, nothing written."""

from pathlib import Path

import pytest

from trainstack.cli import main


@pytest.mark.parametrize("what", ["directory", "file", "missing"])
def test_export_of_a_non_checkpoint_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    source = tmp_path / "not-a-checkpoint"
    if what == "directory":
        (source / "checkpoint_00000010").mkdir(parents=True)  # named like one, but empty
        (source / "notes.txt").write_text("no manifest here\n")
    elif what == "file":
        source.write_text("not a checkpoint\n")
    out = tmp_path / "model.pt"
    assert main(["export", str(source), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert line.startswith(f"trainstack: error: {source}: ") and "checkpoint" in line
    assert "Traceback" not in captured.out
    assert not out.exists()
