"""The `platform/` source root must never shadow the standard library's `platform`."""

import platform
import sys
import sysconfig
from pathlib import Path

import trainstack

ROOT = Path(__file__).resolve().parents[2]


def test_platform_dir_has_no_init_py() -> None:
    assert (ROOT / "platform" / "trainstack" / "__init__.py").is_file()
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_import_platform_is_the_standard_library_module() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(platform.__file__).resolve().parent == stdlib
    assert platform.python_version() == ".".join(map(str, sys.version_info[:3]))


def test_trainstack_is_found_under_platform() -> None:
    assert Path(trainstack.__file__).resolve().parent == ROOT / "platform" / "trainstack"
