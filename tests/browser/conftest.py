"""Fixtures for the browser tests: a JupyterLab server on loopback and a headless Chromium page.

Both are always shut down, whatever the test does; a failing test leaves a
screenshot, the browser console and the server log behind.
"""
from __future__ import annotations

import shutil

import pytest

from labharness import ARTIFACTS, ROOT, Browser, LabServer, missing_requirements

TOUR = ROOT / "examples" / "01_tour.ipynb"
SHOTS = ARTIFACTS / "browser"


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, "rep_" + report.when, report)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    missing = missing_requirements()
    if missing:
        pytest.skip("browser test needs " + ", ".join(missing) + "; .ci/browser-deps.sh installs them")
    if not TOUR.exists():
        pytest.fail(f"{TOUR} is missing")
    server = LabServer(tmp_path_factory.mktemp("jupyterlab"))
    shutil.copy(TOUR, server.root / TOUR.name)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def page(lab, request):
    shutil.rmtree(SHOTS, ignore_errors=True)  # only this run's pictures
    SHOTS.mkdir(parents=True, exist_ok=True)
    browser = Browser(lab.home)
    try:
        page = browser.start()
        yield page
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            page.screenshot(path=str(SHOTS / "failure.png"), full_page=True)
            print("--- browser console ---\n" + "\n".join(browser.console[-60:]))
            print("--- jupyterlab log ---\n" + lab.log_text())
    finally:
        browser.stop()
