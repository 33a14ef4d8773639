"""Each benchmark owns one section of docs/benchmarks.md, between markers."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEach section is written by the script it names; rerun it to refresh.\n"


def write_section(name: str, body: str, path: Path = RESULTS) -> None:
    """Rewrite the section ``name`` of ``path`` (docs/benchmarks.md) in place, or append it; the other
    sections stay as they are."""
    path = Path(path)
    text = path.read_text() if path.exists() else HEADER
    block = f"<!-- {name} -->\n{body.strip()}\n<!-- /{name} -->"
    pattern = re.compile(rf"<!-- {re.escape(name)} -->.*?<!-- /{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
    print(f"wrote section '{name}' of {path}")


def checkout(rev: str, root: Path) -> Path:
    """A git worktree of ``rev`` under ``root`` (made once), to build an earlier revision side by side."""
    src = Path(root) / f"src-{rev}"
    if not src.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(src), rev], check=True,
                       capture_output=True)
    return src
