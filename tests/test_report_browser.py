"""The report page in a real headless browser: Chromium from the system packages
(``apt-get install chromium chromium-driver``), driven by Selenium. Skipped, saying why,
where either is missing (``make test`` passes without them).

It opens the page from a file, checks that every chart rendered with data (plotly drew
its SVG and at least one trace with paths in each chart) and that the page fetched
nothing (no resource entry at all: plotly.js is inline), and takes a screenshot.
``REMOTELOADER_REPORT_SCREENSHOT=docs/report.png`` writes the screenshot there too
(how docs/report.png was made).
"""
from __future__ import annotations

import os
import shutil

import pytest

from remoteloader.tools.report import CHARTS, build_report

from .report_data import canned_status

pytestmark = pytest.mark.slow

_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_DRIVERS = ("chromedriver", "/usr/lib/chromium/chromedriver")

# Per chart: plotly's SVG layers, trace groups in the plot area, and the paths they drew.
_RENDERED = """
const out = {};
for (const div of document.querySelectorAll('div.plotly-graph-div')) {
  out[div.id] = {svg: div.querySelectorAll('.main-svg').length,
                 traces: div.querySelectorAll('.cartesianlayer g.trace').length,
                 paths: div.querySelectorAll('.cartesianlayer g.trace path').length};
}
return out;
"""


def _find(names) -> str | None:
    for name in names:
        path = shutil.which(name) or (name if os.path.isabs(name) and os.access(name, os.X_OK) else None)
        if path:
            return path
    return None


@pytest.fixture
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    from selenium.webdriver.chrome.service import Service

    binary, driver = _find(_BROWSERS), _find(_DRIVERS)
    if binary is None or driver is None:
        pytest.skip(f"no headless browser: {'chromium' if binary is None else 'chromedriver'} not found on PATH "
                    "(apt-get install -y chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    try:
        chrome = webdriver.Chrome(service=Service(driver), options=options)
    except Exception as e:  # a browser that cannot start here (another version than its driver, no libs)
        pytest.skip(f"headless {binary} with {driver} did not start: {str(e).splitlines()[0][:200]}")
    chrome.set_page_load_timeout(120)
    yield chrome
    chrome.quit()


def test_every_chart_renders_with_data_offline_in_headless_chromium(browser, tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    page = tmp_path / "run.html"
    page.write_text(build_report(canned_status(), generated_at=1_767_000_700.0), encoding="utf-8")
    browser.get(page.as_uri())

    def drawn(driver):
        charts = driver.execute_script(_RENDERED)
        return charts if len(charts) == len(CHARTS) and all(c["traces"] > 0 for c in charts.values()) else False

    charts = WebDriverWait(browser, 60, poll_frequency=0.25).until(drawn)
    assert sorted(charts) == sorted(f"chart-{n}" for n in CHARTS)
    for name, c in charts.items():
        assert c["svg"] > 0 and c["traces"] > 0 and c["paths"] > 0, (name, c)
    assert charts["chart-workers"]["traces"] >= 3  # the count, and a mark for each kind of decision
    # Nothing was fetched: the page is one file.
    assert browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)") == []
    assert browser.execute_script("return typeof Plotly") == "object"

    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1280, height + 250)
    WebDriverWait(browser, 30).until(drawn)  # charts are responsive: drawn again at the new size
    shot = tmp_path / "report.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    target = os.environ.get("REMOTELOADER_REPORT_SCREENSHOT")
    if target:
        shutil.copyfile(shot, target)
