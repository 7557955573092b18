"""Fixtures for the end-to-end tests."""

from pathlib import Path

import pytest


@pytest.fixture
def bad_spec(tmp_path: Path) -> Path:
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: x\noptim:\n  lrr: 0.1\n")
    return spec
