"""Search by meaning in a real browser (Debian's chromium driven by Playwright) against `zoo serve`: a description
typed in the search box finds an adapter that lost its labels, and the page says why it matched; desktop and phone.
Screenshots go to $ZOO_SCREENSHOTS (else the test's tmp dir)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright
from sqlalchemy import select

from tests.conftest import copy_seeded
from zoo.store.labels import remove_label
from zoo.store.models import Adapter
from zoo.store.session import make_engine, session_factory, write_transaction

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing (apt-get install -y chromium)")

QUERY = "adapters of the qv task"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`zoo serve` over a copy of the seeded SQLite zoo whose w01 (task qv) lost its task label."""
    root = tmp_path_factory.mktemp("browser-text-zoo")
    seeded = copy_seeded(request, "sqlite", root)
    sessions = session_factory(seeded.url)
    with write_transaction(sessions) as session:
        w01 = session.scalar(select(Adapter.id).where(Adapter.name == "w01"))
        assert w01 is not None and remove_label(session, w01, "task")
    make_engine(seeded.url).dispose()
    port = free_port()
    cmd = [sys.executable, "-m", "zoo.cli", "--db", seeded.url, "--data-dir", str(seeded.data_dir), "serve", "--host", "127.0.0.1"]
    log = (root / "serve.log").open("wb")
    proc = subprocess.Popen([*cmd, "--port", str(port), "--workers", "1"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/v1/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"zoo serve did not come up: {(root / 'serve.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_a_description_finds_an_unlabelled_adapter(server: str, tmp_path: Path) -> None:
    shots = Path(os.environ["ZOO_SCREENSHOTS"]) if os.environ.get("ZOO_SCREENSHOTS") else tmp_path
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM))
        try:
            for prefix, viewport in (("desktop", {"width": 1280, "height": 900}), ("phone", {"width": 390, "height": 844})):
                page = browser.new_page(viewport=viewport)
                errors: list[str] = []
                page.on("console", lambda m, errors=errors: errors.append(m.text) if m.type == "error" else None)
                page.goto(server + "/")
                page.fill("input[name=q]", QUERY)
                page.click("form.search button[type=submit]")
                page.wait_for_url(re.compile(r"\?q=adapters"))
                assert page.input_value("select[name=semantic]") == "1"  # by meaning: the page's default
                card = page.locator("article.card").filter(has=page.get_by_role("link", name="w01", exact=True))
                assert card.count() == 1, page.locator("article.card h2").all_inner_texts()
                why = card.locator("p.why .chip").all_inner_texts()
                assert why and not any(w == "text" for w in why), why  # no text of its own says qv
                assert any(w.startswith("predicted task=qv") or w.startswith("near #") for w in why), why
                labelled = page.locator("article.card").filter(has=page.get_by_role("link", name="w03", exact=True))
                assert labelled.locator("p.why .chip").first.inner_text() == "text"
                width, inner = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
                assert width <= inner, f"{width} px wide in a {inner} px viewport"
                page.screenshot(path=str(shots / f"{prefix}-search-by-meaning.png"), full_page=True)
                # exact words: the sentence is in no document
                page.select_option("select[name=semantic]", "0")
                page.click("form.search button[type=submit]")
                page.wait_for_url(re.compile(r"semantic=0"))
                assert page.locator("article.card").count() == 0
                assert not errors, errors
                page.close()
        finally:
            browser.close()
