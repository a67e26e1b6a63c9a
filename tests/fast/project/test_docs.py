"""The user's pages: the README stays short, every docs page is reachable from its index,
every relative link resolves, and no page points outside the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", ROOT / "SECURITY.md", ROOT / "bench" / "results" / "README.md",
         *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "eddyrl").rglob("README.md")),
         *sorted((ROOT / "examples").rglob("README.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_readme_is_at_most_12_kb():
    assert len((ROOT / "README.md").read_bytes()) <= 12 * 1024


def test_every_docs_page_is_in_the_readme_index():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f"(docs/{p.name})" not in readme]
    assert not missing, f"docs pages missing from the README's index: {missing}"


def test_relative_links_resolve_and_stay_inside_the_repository():
    broken = []
    for page in PAGES:
        text = page.read_text()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists() or ROOT not in path.parents and path != ROOT:
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
        if re.search(r"\.\./shared|/work/", text):
            broken.append(f"{page.relative_to(ROOT)} names a path outside the repository")
    assert not broken, "\n".join(broken)
