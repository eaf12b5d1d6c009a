"""The front door: README stays short and every link in it and in docs/ leads somewhere real."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines() if re.match(r"#{1,6} ", line)}


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move depth into docs/"
    setup = "\n".join(lines)
    assert "make demo" in setup and "make test" in setup
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_resolve(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{doc.name}: broken links: {broken}"


def test_every_job_has_a_command_and_a_guide():
    readme = (ROOT / "README.md").read_text()
    for command in ("make distill", "make train-eagle", "make pool", "decode eval", "decode generate",
                    "decode serve", "toolkit export"):
        assert command in readme, f"README lacks the command {command!r}"
    for guide in ("docs/training.md", "docs/evaluation.md", "docs/serving.md", "docs/exporting.md",
                  "docs/performance.md"):
        assert f"]({guide}" in readme, f"README does not link {guide}"


def test_eval_help_lists_every_peer(capsys):
    from decode.commands.cli import main
    from decode.evaluation.peers import peer_names
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    missing = [name for name in peer_names() if name not in text.replace("- ", "-")]
    assert not missing, f"decode eval --help omits peers {missing}"
