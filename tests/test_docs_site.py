"""The docs site (mkdocs.yml over docs/) builds with `mkdocs build --strict`: a page left out of the nav, a nav entry
or a link to a file that is not there, or a link to a missing anchor is a warning, and a warning fails the build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_docs_site_builds_without_a_warning(tmp_path: Path) -> None:
    done = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    warnings = [line for line in done.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert done.returncode == 0 and not warnings, done.stderr
    home = (tmp_path / "site" / "index.html").read_text()
    assert "What to run next" in home, "the home page is README.md, included by docs/index.md"
    for page in sorted((ROOT / "docs").rglob("*.md")):
        if page.name != "index.md":
            built = tmp_path / "site" / page.relative_to(ROOT / "docs").with_suffix("") / "index.html"
            assert built.is_file(), f"{page.relative_to(ROOT)} was not built"


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The strict build is a check only if it can fail: the site's own settings over a page with a link to a page that
    does not exist."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# zoo\n\nSee [the manual](no-such-page.md).\n")
    settings = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    settings.update(docs_dir=str(docs), nav=[{"Home": "index.md"}])
    config = tmp_path / "mkdocs.yml"
    config.write_text(yaml.safe_dump(settings))
    done = _build(config, tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stderr
