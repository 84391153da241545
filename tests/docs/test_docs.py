"""Every Python block in README.md and docs/*.md runs, so that a block that drifts from the code fails CI.

Sybil parses the Markdown; the blocks of one file run in order in one namespace (a later block may use what an
earlier one defined), in a fresh temporary working directory (Lightning writes lightning_logs/ there). A block after
``<!-- skip: next if(gpus < 2, reason="needs 2 CUDA GPUs") -->`` (an HTML comment: a repository host does not show it)
runs only where the condition is false; ``gpus`` is this machine's CUDA device count. Other fences (bash, yaml, text)
are not run.
"""

from __future__ import annotations

import re
import unittest
from pathlib import Path

import pytest
import sybil  # the dev extra's: a missing one fails here rather than skipping the docs
import torch
from sybil.evaluators.skip import Skipper
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PARSER = sybil.Sybil(parsers=[PythonCodeBlockParser(), SkipParser()])
OPENING_FENCE = re.compile(r"^ *(`{3,}|~{3,})(.*)\n(?:.*\n)*? *\1 *$", re.MULTILINE)


def _is_block(example) -> bool:
    return not isinstance(example.region.evaluator, Skipper)


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_python_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    document = PARSER.parse(path)
    document.namespace.update(gpus=torch.cuda.device_count())
    ran, skipped = 0, 0
    for example in document:
        try:
            example.evaluate()
        except unittest.SkipTest:
            skipped += 1
            continue
        ran += _is_block(example)
    assert ran + skipped == sum(map(_is_block, PARSER.parse(path))), (ran, skipped)


def test_every_python_fence_is_collected() -> None:
    """A block fenced ```py or ```Python would not run: Python blocks are ```python, and sybil finds each one."""
    for path in DOCUMENTS:
        infos = [m.group(2).strip() for m in OPENING_FENCE.finditer(path.read_text())]
        odd = [i for i in infos if i.split(" ")[0].lower() in ("py", "python3", "pycon") or i.startswith("Python")]
        assert not odd, f"{path.name}: fence these blocks as ```python so that they run: {odd}"
        assert sum(map(_is_block, PARSER.parse(path))) == infos.count("python"), path.name


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """The heading anchors a repository host makes: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    headings = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_anchors_resolve(path: Path) -> None:
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{path.name}: link to {target}: no such file"
        if anchor:
            assert anchor in _anchors(linked), f"{path.name}: link to {target}: no such heading"
