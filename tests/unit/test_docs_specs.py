"""Every YAML the docs show is one trainstack accepts.

Each fenced ```yaml block of README.md and docs/*.md, and each examples/specs/*.yaml,
goes through the loader a user would feed it to; no block is skipped. A block is, by
rules that fail when a block breaks them:

- a sweep file, when its top level has `base:`: read with `load_sweep`, which also
  checks every corner trial as a job spec. Its `base:` is relative to the sweep file,
  and the docs' sweeps live in tune/ like the repository's own, so the block is written
  to tmp_path with `base:` made absolute against tune/;
- a fragment, when its first line is `# fragment: SECTION, ...`: it must hold exactly
  those top-level sections, in that order, and they replace the demo job's
  (jobs/configs/demo.yaml), as pasting them over that spec would, before
  `config_from_dict`;
- otherwise a complete job spec for `config_from_dict` (every key has a default, so a
  spec may name only some sections).

No user file has to exist: `config_from_dict` checks only the shape of import paths
(`model.target`, `task.loss`, `data.target`) and that file sources name their files
(`data.train`); importing and opening them is pre-flight's, before Ray starts.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainstack.config import config_from_dict, load_config
from trainstack.sweep.spec import load_sweep

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EXAMPLE_SPECS = sorted((REPO / "examples" / "specs").glob("*.yaml"))
DEMO_SPEC = REPO / "jobs" / "configs" / "demo.yaml"
SWEEPS_DIR = REPO / "tune"

FENCE_OPEN = re.compile(r"```\s*ya?ml\s*", re.IGNORECASE)
FRAGMENT = re.compile(r"#\s*fragment:\s*(?P<sections>.*)")


@dataclass(frozen=True)
class YamlBlock:
    where: str
    """`path:line` of the opening fence, relative to the repository."""
    text: str

    def raw(self) -> dict[str, Any]:
        raw = yaml.safe_load(self.text)
        assert isinstance(raw, dict), f"{self.where}: top level is {type(raw).__name__}"
        return raw

    def fragment_sections(self) -> list[str] | None:
        """The sections a `# fragment: a, b` first line names; None without one."""
        first = self.text.lstrip().splitlines()[0].strip()
        marker = FRAGMENT.fullmatch(first)
        if marker is None:
            return None
        return [s.strip() for s in marker["sections"].split(",")]

    @property
    def kind(self) -> str:
        if "base" in self.raw():
            return "sweep"
        return "fragment" if self.fragment_sections() is not None else "spec"


def yaml_blocks(path: Path) -> list[YamlBlock]:
    """The fenced ```yaml (or ```yml) blocks of a Markdown file, in order."""
    where = path.relative_to(REPO)
    blocks: list[YamlBlock] = []
    start: int | None = None
    body: list[str] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if start is None:
            if FENCE_OPEN.fullmatch(line.strip()):
                start, body = number, []
        elif line.strip().startswith("```"):
            blocks.append(YamlBlock(f"{where}:{start}", textwrap.dedent("\n".join(body))))
            start = None
        else:
            body.append(line)
    if start is not None:
        raise ValueError(f"{where}:{start}: a ```yaml block is never closed")
    return blocks


BLOCKS = [block for path in DOCS for block in yaml_blocks(path)]


def load_sweep_block(block: YamlBlock, tmp_path: Path) -> None:
    raw = block.raw()
    raw["base"] = str((SWEEPS_DIR / raw["base"]).resolve())
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    load_sweep(path)


def load_fragment(block: YamlBlock) -> None:
    raw = block.raw()
    sections = block.fragment_sections()
    assert sections == list(raw), (
        f"{block.where}: '# fragment:' names {sections}, the block holds {list(raw)}"
    )
    base = yaml.safe_load(DEMO_SPEC.read_text(encoding="utf-8"))
    config_from_dict({**base, **raw})


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_every_yaml_block_in_the_docs_loads(block: YamlBlock, tmp_path: Path) -> None:
    if block.kind == "sweep":
        load_sweep_block(block, tmp_path)
    elif block.kind == "fragment":
        load_fragment(block)
    else:
        config_from_dict(block.raw())


@pytest.mark.parametrize("path", EXAMPLE_SPECS, ids=[p.name for p in EXAMPLE_SPECS])
def test_every_example_spec_loads(path: Path) -> None:
    load_config(str(path))


def test_the_docs_show_every_kind_of_block() -> None:
    """The fence parser finds blocks, so the tests above cannot pass on nothing."""
    kinds = {block.kind for block in BLOCKS}
    assert kinds == {"spec", "fragment", "sweep"}
    assert EXAMPLE_SPECS


def test_the_readme_spec_is_the_demo_job() -> None:
    """README shows jobs/configs/demo.yaml and says so: the two stay the same."""
    readme = [b.raw() for b in yaml_blocks(REPO / "README.md") if b.kind == "spec"]
    demo = yaml.safe_load(DEMO_SPEC.read_text(encoding="utf-8"))
    assert demo in readme
