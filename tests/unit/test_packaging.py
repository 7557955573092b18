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


def test_the_command_line_starts_without_torch_or_ray() -> None:
    """`trainstack --help`, a bad spec's one-line error and `trainstack plan` answer in a
    fraction of a second: the CLI imports torch and Ray only in the commands that train."""
    import subprocess

    probe = "import sys, trainstack.cli; print(sorted({'torch', 'ray'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_a_worker_imports_no_dtensor_or_distributed_checkpoint_until_a_layout_needs_them() -> None:
    """Every Ray worker imports the training loop; DTensor and torch.distributed.checkpoint
    would add most of a second each to every one of them (and to each driver), though
    only sharded layouts use them, and import them where they do."""
    import subprocess

    heavy = ("torch.distributed.tensor", "torch.distributed.checkpoint")
    probe = (
        "import sys, trainstack.runtime.launcher, trainstack.runtime.loop; "
        f"print(sorted(set({heavy!r}) & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
