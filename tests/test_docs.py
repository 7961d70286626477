"""Every code block in the README and the docs that is a complete program (a
Python block with imports) runs under mpiexec, and where the block after it shows
output (a ``text`` block), every rank prints exactly that.

A ``<!-- ranks: N -->`` comment before a program sets how many ranks run it
(default 2)."""

import re
import tempfile
from pathlib import Path

import pytest
from mpirun import rank_outputs

ROOT = Path(__file__).parent.parent
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- ranks: (\d+) -->\n)?```(\w*)\n(.*?)```", re.S)


def programs():
    found = []
    for path in SOURCES:
        blocks = list(BLOCK.finditer(path.read_text()))
        for i, block in enumerate(blocks):
            ranks, language, body = block.groups()
            if language != "python" or not re.search(r"^(import|from) ", body, re.M):
                continue
            after = blocks[i + 1] if i + 1 < len(blocks) else None
            shown = after.group(3) if after is not None and after.group(2) == "text" else None
            line = path.read_text()[: block.start()].count("\n") + 1
            found.append(pytest.param(body, int(ranks or 2), shown, id=f"{path.name}:{line}"))
    return found


@pytest.mark.parametrize("source,ranks,shown", programs())
def test_program_runs_and_prints_what_is_shown(source, ranks, shown):
    with tempfile.TemporaryDirectory() as folder:
        program = Path(folder) / "program.py"
        program.write_text(source)
        outputs = rank_outputs(ranks, str(program))
    if shown is not None:
        for rank, output in enumerate(outputs):
            assert output == shown, rank


def test_the_docs_have_programs():
    assert len(programs()) >= 2
