"""The web app end to end in a real browser (Debian's chromium driven by Playwright) against `zoo serve` on a
small real zoo: search and facets, the adapter page, the map, an upload, a download, a phone-sized screen.
Every page may only reach 127.0.0.1 and must log no console error.

Screenshots of each page go to $ZOO_SCREENSHOTS (else the test's tmp dir)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.conftest import copy_seeded
from zoo.domain.palette import CATEGORIES, SEQUENTIAL, distance
from zoo.store.session import make_engine

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing (apt-get install -y chromium)")

DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}


@dataclass
class Server:
    url: str
    root: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`zoo serve` (one gunicorn worker) on a free port over a copy of the seeded SQLite zoo (tests/conftest.py)."""
    root = tmp_path_factory.mktemp("browser-zoo")
    seeded = copy_seeded(request, "sqlite", root)
    db_url, data_dir = seeded.url, seeded.data_dir
    # more labels, as a real zoo has: a seed per adapter (a facet to fold away) and a group of 9 values (more than shown)
    (root / "more.csv").write_text("name,seed,group\n" + "".join(f"w{i:02d},{1000 + i},g{i % 9}\n" for i in range(12)))
    more = ["--db", db_url, "--data-dir", str(data_dir), "ingest", "--no-embed", str(root / "zoo"), "--labels", str(root / "more.csv")]
    more += ["--base-model", "tiny", "--json"]
    assert subprocess.run([sys.executable, "-m", "zoo.cli", *more], capture_output=True).returncode == 0
    # a job with an item that fails, with a long source and reason (the job page must wrap them)
    missing = str(root / "adapters-that-were-moved-elsewhere" / ("a-rather-long-folder-name-" * 6) / "lora")
    for args in (["jobs", "add", missing, "--base-model", "tiny"], ["worker", "--drain", "--concurrency", "1"]):
        subprocess.run([sys.executable, "-m", "zoo.cli", "--db", db_url, "--data-dir", str(data_dir), *args], capture_output=True)
    make_engine(db_url).dispose()
    port = _free_port()
    cmd = [sys.executable, "-m", "zoo.cli", "--db", db_url, "--data-dir", str(data_dir), "serve", "--host", "127.0.0.1"]
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
        yield Server(url, root)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM))
        yield b
        b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = Path(os.environ["ZOO_SCREENSHOTS"]) if os.environ.get("ZOO_SCREENSHOTS") else tmp_path_factory.mktemp("screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out


@dataclass
class Tab:
    """A page at one viewport that records every request and console error, for `assert_local_and_quiet`."""

    page: Page
    base: str
    shots: Path
    prefix: str
    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def goto(self, path: str) -> None:
        self.page.goto(self.base + path)

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(self.shots / f"{self.prefix}-{name}.png"), full_page=True)

    def no_horizontal_overflow(self) -> None:
        width, inner = self.page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        assert width <= inner, f"{self.page.url}: {width} px wide in a {inner} px viewport"

    def assert_local_and_quiet(self) -> None:
        outside = [u for u in self.requests if urlsplit(u).scheme not in ("data", "blob") and urlsplit(u).hostname != "127.0.0.1"]
        assert not outside, f"requests left 127.0.0.1: {outside}"
        assert not self.errors, f"console errors: {self.errors}"


def _tab(browser: Browser, server: Server, shots: Path, viewport: dict[str, int], prefix: str) -> Iterator[Tab]:
    context = browser.new_context(viewport=viewport, accept_downloads=True)
    page = context.new_page()
    tab = Tab(page, server.url, shots, prefix)
    page.on("request", lambda r: tab.requests.append(r.url))
    page.on("console", lambda m: tab.errors.append(f"{page.url}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: tab.errors.append(f"{page.url}: {e}"))
    yield tab
    context.close()
    tab.assert_local_and_quiet()


@pytest.fixture
def desktop(browser: Browser, server: Server, shots: Path) -> Iterator[Tab]:
    yield from _tab(browser, server, shots, DESKTOP, "desktop")


@pytest.fixture
def phone(browser: Browser, server: Server, shots: Path) -> Iterator[Tab]:
    yield from _tab(browser, server, shots, PHONE, "phone")


def _total(tab: Tab) -> int:
    return int(tab.page.inner_text("p.total").split()[0])


def test_search_facets_and_the_adapter_page(desktop: Tab, tmp_path: Path) -> None:
    page = desktop.page
    desktop.goto("/")
    page.fill("input[name=q]", "tiny")
    page.click("form.search button[type=submit]")
    page.wait_for_url(re.compile(r"\?q=tiny"))
    assert page.input_value("select[name=sort]") == "relevance"  # the landing page's "newest" does not stick to a query
    assert page.locator("article.card").count() == 12 and _total(desktop) == 12
    desktop.shot("search")
    headings = page.locator("aside.facets section.facet h3")
    assert headings.first.inner_text().lower() == "task"  # the facet people filter by comes first
    seed = page.locator("details.more-facets section.facet").filter(has=page.locator("h3", has_text=re.compile("^seed$", re.I)))
    assert seed.count() == 1 and not seed.is_visible()  # a value per adapter: folded away
    page.locator("details.more-facets > summary").click()
    assert seed.is_visible()
    group = page.locator("aside.facets > section.facet").filter(has=page.get_by_role("heading", name="group", exact=True))
    assert group.locator("> ul > li").count() == 8 and group.locator("details.more-values summary").inner_text() == "all 9"
    hidden = group.locator("details.more-values li a")
    assert hidden.count() == 1 and not hidden.is_visible()
    group.locator("details.more-values summary").click()
    assert hidden.is_visible()
    task = page.locator("section.facet").filter(has=page.get_by_role("heading", name="task", exact=True))
    task.get_by_role("link", name="qv", exact=True).click()
    page.wait_for_url(re.compile(r"filter=task%3Dqv"))
    assert _total(desktop) == 6 and page.locator("article.card").count() == 6
    assert page.locator(".active-filters .chip").inner_text().startswith("task=qv")
    desktop.shot("search-facet")

    page.locator("article.card h2 a").first.click()
    page.wait_for_url(re.compile(r"/adapters/\d+$"))
    neighbours = page.locator("ol.neighbours li")
    assert neighbours.count() >= 5
    scores = [float(s) for s in page.locator("ol.neighbours .score").all_inner_texts()]
    assert scores == sorted(scores, reverse=True)
    page.wait_for_selector("#spectra[data-series]")
    series = page.evaluate("Chart.getChart(document.getElementById('spectra')).data.datasets.map((d) => d.data.length)")
    assert int(page.get_attribute("#spectra", "data-series")) == len(series) >= 2 and min(series) >= 1
    assert "from the weights" in page.locator("h2", has_text="Predictions").inner_text()
    assert page.locator("dl.predictions .chip").count() >= 1
    assert page.locator("dl.kv:not(.predictions) dd", has_text="measured").count() == 1  # the given test_accuracy
    # the predictions set the given task and the measured accuracy first, and name the predictor
    assert page.locator("dl.predictions .chip.given").count() == 1 and page.locator("dl.predictions dd", has_text="measured").count() == 1
    assert page.locator("dl.predictions .support", has_text=" by ").count() >= 2
    lineage = page.locator("section.lineage")  # the other 11 adapters of base model tiny, each a link
    assert lineage.locator("h3", has_text="Same base model").locator(".badge").inner_text() == "11 other adapters"
    same_source = lineage.locator("h3", has_text="Same source")  # the count is a badge apart from the path, never its tail
    assert same_source.locator(".badge").inner_text() == "0 other adapters" and same_source.inner_text().startswith("Same source")
    assert re.search(r"/zoo/w\d\d$", lineage.locator("h3:has-text('Same source') + p.group-value").inner_text())
    assert lineage.locator("ul.related li a[href^='/adapters/']").count() == 11
    neighbours_box, lineage_box = page.locator("ol.neighbours").bounding_box(), lineage.bounding_box()
    assert neighbours_box and lineage_box and neighbours_box["y"] < lineage_box["y"]  # the neighbours first, then the lineage lists
    map_link = page.get_by_role("link", name="Show on the map")  # a link, not one more download button
    assert map_link.get_attribute("download") is None and "button" not in (map_link.get_attribute("class") or "")
    assert page.locator(".downloads").get_by_role("link", name="Show on the map").count() == 0
    desktop.shot("adapter")

    with page.expect_download() as info:
        page.locator(".downloads a.button", has_text="peft").click()
    saved = tmp_path / info.value.suggested_filename
    info.value.save_as(saved)
    assert saved.suffix == ".zip" and any(n.endswith("adapter_config.json") for n in zipfile.ZipFile(saved).namelist())


def _click_point(tab: Tab, dataset: int) -> int:
    """Click the map's first point of a dataset at the pixel Chart.js drew it; the adapter id it stands for."""
    js = "(i) => { const c = window.zooMapChart, p = c.getDatasetMeta(i).data[0]; return [p.x, p.y, c.data.datasets[i].data[0].id]; }"
    x, y, adapter_id = tab.page.evaluate(js, dataset)
    box = tab.page.locator("#map").bounding_box()
    assert box is not None
    tab.page.mouse.click(box["x"] + x, box["y"] + y)
    return int(adapter_id)


def test_map_point_opens_its_adapter(desktop: Tab) -> None:
    page = desktop.page
    desktop.goto("/map")
    page.wait_for_selector("#map[data-points]")
    assert int(page.get_attribute("#map", "data-points")) == 12
    assert page.input_value("#color-by") == "task"  # coloured by task unless asked otherwise
    desktop.shot("map")
    clicked = _click_point(desktop, dataset=0)
    page.wait_for_url(re.compile(rf"/adapters/{clicked}$"))
    assert page.locator("h1").inner_text().startswith("w")

    desktop.goto("/map?highlight=3")  # the adapter page's "show on map": coloured by task, as the map is by default
    page.wait_for_selector("#map[data-points]")
    labels = page.evaluate("window.zooMapChart.data.datasets.map((d) => d.label)")
    assert labels == ["this adapter", "qk", "qv"] and page.input_value("#color-by") == "task"
    colours = page.evaluate("window.zooMapChart.data.datasets.map((d) => d.backgroundColor)")
    assert colours == ["#000", *CATEGORIES[:2]]  # the server's palette, as in `zoo map --plot`
    desktop.shot("map-coloured")
    assert _click_point(desktop, dataset=0) == 3
    page.wait_for_url(re.compile(r"/adapters/3$"))


def _apart(first: dict[str, float], second: dict[str, float]) -> bool:
    """Two boxes (bounding_box) share no pixel."""
    return (
        first["x"] + first["width"] <= second["x"]
        or second["x"] + second["width"] <= first["x"]
        or first["y"] + first["height"] <= second["y"]
        or second["y"] + second["height"] <= first["y"]
    )


def _plot_area(tab: Tab) -> dict[str, float]:
    """The map's plot area (Chart.js's chartArea, where the points are) in page pixels."""
    box = tab.page.locator("#map").bounding_box()
    area = tab.page.evaluate("(() => { const a = window.zooMapChart.chartArea; return [a.left, a.top, a.right, a.bottom]; })()")
    assert box is not None
    return {"x": box["x"] + area[0], "y": box["y"] + area[1], "width": area[2] - area[0], "height": area[3] - area[1]}


@pytest.mark.parametrize("viewport", ["desktop", "phone"])
def test_the_map_has_a_colour_scale_and_a_key_beside_the_points(viewport: str, request: pytest.FixtureRequest) -> None:
    """Coloured by a metric: a colour bar from the scale's low end to its high end (viridis: light is high) with its
    min and max written at its ends; by a label: a swatch per value in the palette's colours. Either key sits beside
    (a phone: below) the plot area, on no point."""
    tab: Tab = request.getfixturevalue(viewport)
    page = tab.page
    tab.goto("/map?color_by=metric:test_accuracy")
    page.wait_for_selector("#map[data-points]")
    legend = page.evaluate("fetch('/api/v1/spaces/tiny/map?color_by=metric:test_accuracy').then((r) => r.json())")["legend"]
    bar, low, high = page.locator("#colour-bar"), page.locator("#scale-min"), page.locator("#scale-max")
    assert bar.is_visible() and low.is_visible() and high.is_visible()
    assert low.inner_text() == f"min {legend['min']:.4g}" and high.inner_text() == f"max {legend['max']:.4g}"
    assert page.locator("#map-key h2").inner_text() == "metric:test_accuracy"
    for name in ("#colour-bar", "#scale-min", "#scale-max"):
        box = page.locator(name).bounding_box()
        assert box and box["width"] > 0 and _apart(box, _plot_area(tab)), name
    ends = page.evaluate(
        "(() => { const b = document.getElementById('colour-bar'), c = b.getContext('2d'), y = Math.floor(b.height / 2);"
        " return [c.getImageData(1, y, 1, 1).data, c.getImageData(b.width - 2, y, 1, 1).data].map((d) => [d[0], d[1], d[2]]); })()"
    )
    assert distance(_hex(ends[0]), SEQUENTIAL[0]) < 10 and distance(_hex(ends[1]), SEQUENTIAL[-1]) < 10, ends  # low at the left
    coloured = "(() => { const d = window.zooMapChart.data.datasets[0]; return d.data.map((p, i) => [p.value, d.backgroundColor[i]]); })()"
    points = page.evaluate(coloured)
    (_, lowest), (_, highest) = min(points), max(points)
    assert _rgb_hex(lowest) == SEQUENTIAL[0] and _rgb_hex(highest) == SEQUENTIAL[-1]
    tab.no_horizontal_overflow()
    tab.shot("map-metric")

    tab.goto("/map?color_by=task")
    page.wait_for_selector("#map[data-points]")
    items = page.locator("#map-legend li")
    assert items.count() == 2 and page.locator("#colour-bar").is_hidden()
    for i in range(2):
        box = items.nth(i).bounding_box()
        assert box and items.nth(i).is_visible() and _apart(box, _plot_area(tab)), i
    items.first.locator("button").click()  # a swatch hides its points, and shows them again
    assert not page.evaluate("window.zooMapChart.isDatasetVisible(0)")
    items.first.locator("button").click()
    assert page.evaluate("window.zooMapChart.isDatasetVisible(0)")
    tab.shot("map-task")


def _hex(rgb: list[int]) -> str:
    return "#" + "".join(f"{v:02x}" for v in rgb)


def _rgb_hex(css: str) -> str:
    """ "rgb(r, g, b)" as "#rrggbb"."""
    return _hex([int(v) for v in re.findall(r"\d+", css)[:3]])


def test_upload_finds_similar_adapters(desktop: Tab, server: Server) -> None:
    page = desktop.page
    desktop.goto("/similar")
    new = server.root / "outside" / "new"
    page.set_input_files("input[type=file]", [str(new / "adapter_config.json"), str(new / "adapter_model.safetensors")])
    page.click("form.upload button[type=submit]")
    page.wait_for_selector("#similar-results li")
    assert page.locator("#similar-results li").count() == 10
    assert "from the weights" in page.locator("h2", has_text="Predictions").inner_text()
    assert page.locator("#stored-as").count() == 0  # a new file, not a stored adapter
    desktop.shot("similar")


def test_files_dropped_on_the_drop_zone_are_uploaded(desktop: Tab, server: Server) -> None:
    """The similar page's drop zone: a dashed area that takes the files dropped on it (dragover, drop) for the form."""
    page = desktop.page
    desktop.goto("/similar")
    zone = page.locator("#drop-zone")
    assert zone.is_visible() and page.evaluate("getComputedStyle(document.getElementById('drop-zone')).borderTopStyle") == "dashed"
    new = server.root / "outside" / "new"
    files = [{"name": f.name, "bytes": list(f.read_bytes())} for f in (new / "adapter_config.json", new / "adapter_model.safetensors")]
    transfer = page.evaluate_handle(
        "(files) => { const t = new DataTransfer();"
        " files.forEach((f) => t.items.add(new File([new Uint8Array(f.bytes)], f.name))); return t; }",
        files,
    )
    zone.dispatch_event("dragenter", {"dataTransfer": transfer})
    zone.dispatch_event("dragover", {"dataTransfer": transfer})
    assert "dragging" in (zone.get_attribute("class") or "")
    zone.dispatch_event("drop", {"dataTransfer": transfer})
    assert page.evaluate("document.querySelector('#drop-zone input[type=file]').files.length") == 2
    assert zone.locator(".drop-files").inner_text() == "adapter_config.json, adapter_model.safetensors"
    desktop.shot("similar-dropped")
    page.click("form.upload button[type=submit]")
    page.wait_for_selector("#similar-results li")
    assert page.locator("#similar-results li").count() == 10


def test_other_pages_stay_local(desktop: Tab) -> None:
    page = desktop.page
    desktop.goto("/jobs")
    assert page.locator("h1").inner_text() == "Ingestion jobs"
    desktop.shot("jobs")
    failed = page.locator("table tbody tr").filter(has=page.locator("td:nth-child(6)", has_text=re.compile(r"^[1-9]")))
    failed.first.locator("a").first.click()  # the job with the failed item (others hold the fixture's duplicates)
    page.wait_for_url(re.compile(r"/jobs/\d+$"))
    _reason_fits(desktop, DESKTOP["width"])
    desktop.shot("job")
    response = page.goto(desktop.base + "/api/v1/docs")  # under the CSP: anything it blocked would be a console error
    assert response and "script-src 'self';" in response.headers["content-security-policy"]
    page.wait_for_selector(".swagger-ui .opblock")
    assert page.locator("header.top a.brand").count() == 1  # the site's header: a way back to the app
    desktop.shot("api-docs")
    desktop.goto("/adapters/9999")
    assert "no adapter with id 9999" in page.locator(".error").inner_text()
    assert page.title() == "Not found · zoo" and page.locator("h1").inner_text() == "Not found (404)"
    desktop.errors[:] = [e for e in desktop.errors if "status of 404" not in e]  # the browser logs the page's own 404


def _reason_fits(tab: Tab, width: int) -> None:
    """The failed item's reason is on the job page whole, inside the viewport (wrapped, not cut at the table's edge)."""
    cell = tab.page.locator("table tbody tr td.wrap").last
    assert "no such file" in cell.inner_text()
    box = cell.bounding_box()
    assert box and box["x"] + box["width"] <= width, box


def test_phone_layout(phone: Tab) -> None:
    page = phone.page
    phone.goto("/?q=tiny")
    assert page.locator("article.card").count() == 12
    phone.no_horizontal_overflow()
    first = page.locator("article.card").first.bounding_box()
    assert first and first["y"] + first["height"] <= PHONE["height"]  # results start on the first screen, below the facets
    facets = page.locator("aside.facets")  # folded into "Filters", closed: the results are not pushed down by them
    assert not facets.is_visible() and page.locator("details.filters > summary").inner_text() == "Filters"
    phone.shot("search")
    page.locator("details.filters > summary").click()
    assert facets.is_visible() and page.locator("section.facet h3").first.inner_text().lower() == "task"
    phone.no_horizontal_overflow()
    phone.shot("search-filters")

    page.locator("article.card h2 a").first.click()
    page.wait_for_url(re.compile(r"/adapters/\d+$"))
    page.wait_for_selector("#spectra[data-series]")
    phone.no_horizontal_overflow()
    for target in ("h1", ".downloads a.button >> nth=0", "ol.neighbours li a >> nth=0", "#spectra", "#spectra-type"):
        box = page.locator(target).bounding_box()
        assert box and box["width"] > 0 and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"], target
    phone.shot("adapter")
    page.locator("ol.neighbours li a").first.click()
    page.wait_for_url(re.compile(r"/adapters/\d+$"))

    phone.goto("/map")
    page.wait_for_selector("#map[data-points]")
    phone.no_horizontal_overflow()
    phone.shot("map")
    phone.goto("/similar")
    phone.no_horizontal_overflow()
    phone.shot("similar")
    phone.goto("/api/v1/docs")
    page.wait_for_selector(".swagger-ui .opblock")
    phone.no_horizontal_overflow()
    assert page.locator("header.top a.brand").is_visible()
    phone.shot("api-docs")


def test_wide_tables_scroll_inside_their_wrapper_on_a_phone(phone: Tab) -> None:
    """At 390 px the modules and jobs tables are wider than the screen: the page does not scroll sideways, the table's
    wrapper does, and a visible line says so until the table is scrolled to its end."""
    page = phone.page
    for path, table in (("/adapters/1", "section:has(h2:text('Modules')) .scroll"), ("/jobs", ".scroll")):
        phone.goto(path)
        page.wait_for_load_state("load")
        phone.no_horizontal_overflow()
        wrapper = page.locator(table).first
        width, visible, overflow = wrapper.evaluate("(w) => [w.scrollWidth, w.clientWidth, getComputedStyle(w).overflowX]")
        assert width > visible and overflow == "auto", (path, width, visible, overflow)
        hint = page.locator(f"{table} >> xpath=preceding-sibling::p[1]").first
        assert hint.is_visible() and "scroll" in hint.inner_text(), path
        box = hint.bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"]
        phone.shot("table-" + path.strip("/").replace("/", "-"))
        wrapper.evaluate("(w) => { w.scrollLeft = w.scrollWidth; }")
        assert wrapper.evaluate("(w) => w.scrollLeft") > 0 and page.evaluate("window.scrollX") == 0
        page.wait_for_function("(w) => w.classList.contains('at-end')", arg=wrapper.element_handle())
