"""The tour notebook in a real JupyterLab, in headless Chromium, as a person uses it.

A JupyterLab server runs on 127.0.0.1 (random port, token) over a temporary
folder holding a copy of ``examples/01_tour.ipynb``; Debian's Chromium, driven
by Playwright, opens it, runs every cell from the Run menu, and then checks
what is on the screen:

* every cell ran (a number in its prompt) and none shows an error;
* the device picker is drawn, lists ``cpu``, and choosing a device in it
  changes the kernel's current device (a cell typed afterwards prints it);
* the memory gauges are drawn, and the kernel's figure on the CPU gauge rises
  while a cell holds a large tensor and falls when it is deleted; beside the
  bar, the history line gains a point every step.

Screenshots of each step go to ``artifacts/browser/``. The test skips only when
Chromium, JupyterLab or Playwright are missing (``.ci/browser-deps.sh``
installs them). Run it with::

    python -m pytest -m browser tests/browser -v

Nothing waits a fixed time. Each notebook's kernel is started through the
server's REST API and answers before the page opens the notebook, so
JupyterLab connects to a running kernel instead of starting one; and each step
waits until what it needs is on the screen (the notebook drawn, its kernel
named and idle in the toolbar and the status bar, cells numbered), under limits
generous enough for a loaded machine. Running cells in a notebook whose kernel
is not there yet is what put up JupyterLab's "Select Kernel" dialog on a slow
machine; one that appears anyway is answered with the python3 kernel.
``GPUMAGIC_BROWSER_KERNEL_DELAY=20`` tries it with a kernel that takes 20 s
to start.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings

import pytest
from labharness import (
    ARTIFACTS,
    KERNEL_DISPLAY_NAME,
    KERNEL_NAME,
    ROOT,
    Browser,
    LabServer,
    missing_requirements,
)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]

TOUR = ROOT / "examples" / "01_tour.ipynb"
SHAREDTRAIN = ROOT / "examples" / "03_sharedtrain.ipynb"
SHOTS = ARTIFACTS / "browser"
RUN_ALL_TIMEOUT = 300  # seconds: the whole tour, a cold kernel and torch's import on a busy machine
CELL_TIMEOUT = 120
KERNEL_TIMEOUT = 300  # seconds for a kernel to start and the page to connect to it (limits, not waits)
BIG_MIB = 512  # the tensor the test allocates while watching the gauge

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


# --------------------------------------------------------------------------- fixtures
# Both are always shut down, whatever the test does.

@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    missing = missing_requirements()
    if missing:
        why = "browser test needs " + ", ".join(missing) + "; .ci/browser-deps.sh installs them"
        if os.environ.get("GPUMAGIC_REQUIRE_BROWSER") == "1":  # CI: a skip would hide the test
            pytest.fail(why)
        pytest.skip(why)
    if not TOUR.exists():
        pytest.fail(f"{TOUR} is missing")
    shutil.rmtree(SHOTS, ignore_errors=True)  # only this run's pictures
    server = LabServer(tmp_path_factory.mktemp("jupyterlab"))
    shutil.copy(TOUR, server.root / TOUR.name)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def browser(lab):
    SHOTS.mkdir(parents=True, exist_ok=True)
    browser = Browser(lab.home)
    try:
        yield browser
    finally:
        browser.stop()



# --------------------------------------------------------------------------- page helpers

def _shot(page, name: str) -> str:
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return str(path)


def _to_bytes(number: str, unit: str) -> float:
    return float(number) * _UNITS[unit]


# The notebook on screen is drawn (no loading spinner, cells shown) and its
# kernel is python3, connected and idle, as the toolbar's kernel name, its
# execution indicator and the status bar show it. The execution indicator alone
# is not enough: it reads "idle" while the notebook has no kernel yet.
_KERNEL_READY_JS = """name => {
    const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
    if (!panel || panel.querySelector('.jp-Spinner') || !panel.querySelector('.jp-Notebook .jp-Cell')) return false;
    const kernel = panel.querySelector('.jp-Toolbar-kernelName');
    const label = kernel && (kernel.getAttribute('aria-label') || kernel.textContent).trim();
    const indicator = panel.querySelector('.jp-Notebook-ExecutionIndicator');
    const status = [...document.querySelectorAll('#jp-main-statusbar .jp-StatusBar-Item')]
        .some(e => e.textContent.trim() === name + ' | Idle');
    return label === name && indicator && indicator.dataset.status === 'idle' && status;
}"""


def _accept_dialogs(page) -> list[str]:
    """Answer each dialog JupyterLab put up; a kernel choice gets the python3 kernel.

    Returns the dialogs' titles. None is expected: the kernel is running
    before the notebook opens; this only keeps a late one from blocking the page.
    """
    titles = []
    dialog = page.locator(".jp-Dialog")
    while dialog.count():
        first = dialog.first
        titles.append(first.locator(".jp-Dialog-header").inner_text().strip())
        choice = first.locator("select")
        if choice.count():  # "Select Kernel": its options' values are JSON kernel choices
            value = choice.first.evaluate(
                """(s, name) => { for (const o of s.options) {
                       try { if (JSON.parse(o.value).name === name) return o.value; } catch (e) {} }
                   return null; }""", KERNEL_NAME)
            if value is not None:
                choice.first.select_option(value=value)
        first.locator(".jp-mod-accept").first.click()
        first.wait_for(state="detached")
    if titles:
        print(f"answered JupyterLab dialogs: {titles}")
    return titles


def _wait_kernel_ready(page, timeout: float = KERNEL_TIMEOUT) -> None:
    """Until the notebook is drawn and its kernel idle; a dialog on the way is answered."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the notebook's {KERNEL_DISPLAY_NAME} kernel was not connected "
                                 f"and idle within {timeout} s")
        page.wait_for_function(f"name => ({_KERNEL_READY_JS})(name) || !!document.querySelector('.jp-Dialog')",
                               arg=KERNEL_DISPLAY_NAME, timeout=left * 1000)
        if not _accept_dialogs(page) and _kernel_ready(page):
            return


def _kernel_ready(page) -> bool:
    return page.evaluate(_KERNEL_READY_JS, KERNEL_DISPLAY_NAME)


def _open_notebook(page, lab, name: str) -> None:
    """Start the notebook's kernel, wait until it is idle, then open the notebook on it."""
    lab.start_kernel_for(name, timeout=KERNEL_TIMEOUT)
    page.goto(f"{lab.url}/lab/tree/{name}?token={lab.token}")
    _wait_kernel_ready(page)


def _prompts(page) -> list[str]:
    return page.eval_on_selector_all(
        ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt",
        "els => els.map(e => e.textContent.trim())")


def _wait_cells_done(page, timeout: float) -> list[str]:
    """Wait until no cell is queued or running and the kernel is idle; returns the prompts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        prompts = _prompts(page)
        if prompts and not any("*" in p for p in prompts) and _kernel_ready(page):
            time.sleep(0.5)  # idle may flicker between two queued cells
            again = _prompts(page)
            if again == prompts and _kernel_ready(page):
                return prompts
        time.sleep(0.5)
    raise AssertionError(f"cells still running after {timeout} s: {_prompts(page)}")


def _menu(page, menu: str, item: str, done_js: str, timeout: float = 60_000) -> None:
    """Choose ``menu > item`` until ``done_js`` holds in the page.

    A click that lands while a menu is still opening or closing can do
    nothing; the choice is repeated (each of ours is harmless to repeat
    before it took effect).
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    for _ in range(3):
        _accept_dialogs(page)          # nothing modal in the way of the menu
        page.keyboard.press("Escape")  # no other menu half-open
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{re.escape(menu)}$")).click()
        entry = page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$"))
        entry.wait_for(state="visible")
        entry.click()
        try:
            page.wait_for_function(done_js, timeout=timeout)
            return
        except PlaywrightTimeout:
            continue
    raise AssertionError(f"{menu} > {item} did nothing")


_PROMPTS_JS = "[...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt')]"
# (cells on screen first: with none drawn yet, "every prompt is clear" would hold already)
_ALL_CLEARED = f"() => {_PROMPTS_JS}.length > 0 && {_PROMPTS_JS}.every(e => !/\\d/.test(e.textContent))" \
               " && !document.querySelector('.jp-OutputArea-output')"
_ANY_STARTED = f"() => {_PROMPTS_JS}.some(e => /[*\\d]/.test(e.textContent))"


def _run_all(page) -> list[str]:
    """Clear the stored outputs, then run every cell, as from the menus."""
    _wait_kernel_ready(page)
    _menu(page, "Edit", "Clear Outputs of All Cells", _ALL_CLEARED)
    _menu(page, "Run", "Run All Cells", _ANY_STARTED)
    return _wait_cells_done(page, RUN_ALL_TIMEOUT)


def _cells(page):
    return page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell")


def _output_text(cell) -> str:
    return "\n".join(cell.locator(".jp-OutputArea-output").all_inner_texts())


def _add_cell_and_run(page, source: str) -> object:
    """Type ``source`` into a new cell at the end, as a person would, and run it."""
    cells = _cells(page)
    index = cells.count()
    cells.nth(index - 1).locator(".jp-InputPrompt").click()   # select the last cell
    page.keyboard.press("Escape")                             # command mode
    page.keyboard.press("b")                                  # insert a cell below
    page.wait_for_function(f"() => document.querySelectorAll('.jp-Notebook .jp-Cell').length > {index}",
                           timeout=CELL_TIMEOUT * 1000)
    new = cells.nth(index)
    new.locator(".cm-content").click()
    # insert_text types without key events, so the editor's bracket closing cannot add characters.
    page.keyboard.insert_text(source)
    page.keyboard.press("Control+Enter")                      # run it, stay on it
    deadline = time.monotonic() + CELL_TIMEOUT
    while time.monotonic() < deadline:
        prompt = new.locator(".jp-InputPrompt").inner_text().strip()
        if re.fullmatch(r"\[\d+\]:", prompt) and _kernel_ready(page):
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"typed cell did not finish: {source!r}")
    _assert_no_error(new, source)
    return new


_ERROR_LINE = re.compile(r"^\s*(\w+Error|\w+Exception|KeyboardInterrupt)\b.*", re.M)


def _assert_no_error(cell, what: str) -> None:
    text = _output_text(cell)
    assert "Traceback (most recent call last)" not in text, f"{what} shows a traceback:\n{text}"
    assert not _ERROR_LINE.search(text), f"{what} shows an error:\n{text}"
    assert "Error displaying widget" not in text, f"{what}: a widget failed to render:\n{text}"


def _gauges(page):
    """Memory gauges on screen: ``HBox([HTML label, progress bar, HTML caption])``."""
    return page.locator(".widget-hbox:has(> .widget-hprogress)")


def _cpu_gauge(page):
    gauge = _gauges(page).filter(has=page.locator(".widget-html-content", has_text=re.compile(r"^cpu\b")))
    return gauge.last


def _kernel_bytes(caption: str) -> float | None:
    match = re.search(r"kernel\s+([\d.]+)\s*(B|KiB|MiB|GiB|TiB)", caption)
    return _to_bytes(*match.groups()) if match else None


def _wait_kernel_bytes(gauge, accept, timeout: float = 90.0) -> tuple[float, str]:
    deadline = time.monotonic() + timeout
    caption = ""
    while time.monotonic() < deadline:
        caption = gauge.locator(".widget-html-content").last.inner_text()
        value = _kernel_bytes(caption)
        if value is not None and accept(value):
            return value, caption
        time.sleep(0.25)
    raise AssertionError(f"the CPU gauge never showed the expected kernel memory; last caption: {caption!r}")


# The points of a gauge's memory line (a lone point is drawn as a dot), and its tooltip.
_HISTORY_JS = """g => { const s = g.querySelector('svg.gpumagic-history'); if (!s) return null;
    const n = [...s.querySelectorAll('.gpumagic-history-memory')].reduce((k, e) => k + (e.tagName === 'circle'
        ? 1 : e.getAttribute('points').trim().split(/\\s+/).length), 0);
    const t = s.querySelector('title'); return [n, t ? t.textContent : ''];
}"""


def _wait_history_points(gauge, accept, timeout: float = 90.0) -> tuple[int, str]:
    """Until the gauge's history line holds points ``accept`` takes (a step is 5 s); ``(points, tooltip)``."""
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        seen = gauge.evaluate(_HISTORY_JS)
        if seen is not None and accept(seen[0]):
            return seen[0], seen[1]
        time.sleep(0.5)
    raise AssertionError(f"the gauge's history line never showed the expected points; last: {seen!r}")


_OUTPUT_AREA = "xpath=ancestor::div[contains(concat(' ', normalize-space(@class), ' '), ' jp-OutputArea ')][1]"


def _picture(picker, gauge) -> str:
    """README's and the site's picture: ``%gpuinfo``'s output (table and picker) above the gauges.

    Saved as ``artifacts/browser/picker-and-gauges.png``, in 64 colours (a few tens of KB);
    ``docs/_static/picker-and-gauges.png`` is a copy of it.
    """
    from PIL import Image
    parts = []
    for i, element in enumerate((picker, gauge)):
        area = element.locator(_OUTPUT_AREA)
        area.scroll_into_view_if_needed()
        path = SHOTS / f"picture_part{i}.png"
        area.screenshot(path=str(path))
        with Image.open(path) as part:
            parts.append(part.convert("RGB"))
    gap = 16
    canvas = Image.new("RGB", (max(p.width for p in parts), sum(p.height for p in parts) + gap), "white")
    canvas.paste(parts[0], (0, 0))
    canvas.paste(parts[1], (0, parts[0].height + gap))
    out = SHOTS / "picker-and-gauges.png"
    canvas.quantize(colors=64).save(out, optimize=True)
    return str(out)


# --------------------------------------------------------------------------- the test

def test_tour_in_jupyterlab(lab, browser):
    page = browser.start()
    try:
        _tour(lab, page)
    except BaseException:
        # What the page showed, what it logged and what the server said, for the failure report.
        try:
            _shot(page, "failure")
        finally:
            print("--- browser console ---\n" + "\n".join(browser.console[-60:]))
            print("--- jupyterlab log ---\n" + lab.log_text())
        raise


def _tour(lab, page):
    _open_notebook(page, lab, TOUR.name)
    _shot(page, "01_opened")

    # Every cell runs, and none shows an error.
    prompts = _run_all(page)
    _shot(page, "02_ran_all")
    cells = _cells(page)
    for i in range(cells.count()):
        _assert_no_error(cells.nth(i), f"cell {i}")  # markdown cells have no output: nothing to find
    assert all(re.fullmatch(r"\[\d+\]:", p) for p in prompts), f"cells that did not run: {prompts}"

    # The device picker is drawn and offers at least the CPU.
    picker = page.locator(".gpumagic-device-picker select").first
    picker.wait_for(state="visible", timeout=CELL_TIMEOUT * 1000)
    options = picker.locator("option").all_inner_texts()
    devices = [o.replace("\xa0", " ").split(": ")[0].strip() for o in options]
    assert "cpu" in devices, f"picker options: {options}"
    shown = picker.evaluate("s => s.options[s.selectedIndex].textContent").replace("\xa0", " ").split(": ")[0]

    # What the picker shows is the kernel's device...
    cell = _add_cell_and_run(page, "import gpumagic\nprint(gpumagic.current_device())")
    assert _output_text(cell).strip() == shown
    # ...and choosing another device in it moves the kernel there, and back again.
    others = [d for d in devices if d != shown]
    if not others:
        warnings.warn(f"the device picker offers only {devices}: choosing another device in it "
                      "could not be exercised on this machine", stacklevel=2)
    for chosen in others[:1] + ([shown] if others else []):
        picker.select_option(index=devices.index(chosen))
        # The choice travels to the kernel over the widget's comm: poll what the kernel says.
        deadline = time.monotonic() + 60
        while True:
            cell = _add_cell_and_run(page, "print(gpumagic.current_device())")
            said = _output_text(cell).strip()
            if said == chosen or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert said == chosen, f"chose {chosen} in the dropdown; the kernel says {said}"
        picker.scroll_into_view_if_needed()
        _shot(page, f"03_picked_{chosen.replace(':', '')}")
    picker.scroll_into_view_if_needed()
    _shot(page, "03_picker")

    # The gauges are drawn, and the kernel's memory on the CPU gauge follows a big tensor.
    _add_cell_and_run(page, "%gpumem --watch")
    gauge = _cpu_gauge(page)
    gauge.wait_for(state="visible", timeout=CELL_TIMEOUT * 1000)
    assert gauge.locator(".progress-bar").count() == 1
    before, caption_before = _wait_kernel_bytes(gauge, lambda v: v > 0)
    _add_cell_and_run(page, f"import torch\nbig = torch.ones({BIG_MIB} * 2**20 // 4)"
                            f"  # {BIG_MIB} MiB, every page written")
    grown, caption_grown = _wait_kernel_bytes(gauge, lambda v: v >= before + 0.8 * BIG_MIB * 2**20)
    _shot(page, "04_gauge_with_big_tensor")
    _add_cell_and_run(page, "del big")
    shrunk, caption_shrunk = _wait_kernel_bytes(gauge, lambda v: v <= grown - 0.5 * BIG_MIB * 2**20)
    print(f"CPU gauge: {caption_before!r} -> {caption_grown!r} -> {caption_shrunk!r}")

    # Beside the bar, the device's last minutes: a line of memory (and utilisation) that gains a point a step.
    points, title = _wait_history_points(gauge, lambda n: n >= 2)
    assert re.fullmatch(r"cpu, last 5 min: memory \(blue\), peak \d+%; utilisation \(orange\)", title), title
    gauge.scroll_into_view_if_needed()
    _shot(page, "04b_gauge_history")
    print(f"CPU history line: {points} points; {title!r}")
    print(f"the picture of the picker and the gauges: {_picture(picker, gauge)}")

    # Stopping the gauges ends their thread; the kernel is still usable afterwards.
    _add_cell_and_run(page, "%gpumem --stop")
    cell = _add_cell_and_run(page, "import threading\nfrom gpumagic.widgets.monitor import THREAD_NAME\n"
                                   "print([t.name for t in threading.enumerate() if t.name == THREAD_NAME])")
    assert _output_text(cell).strip() == "[]"
    _shot(page, "05_done")

    # The notebook as saved by the browser holds no error output either.
    page.keyboard.press("Escape")
    page.keyboard.press("Control+s")
    page.wait_for_function(
        "() => !document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)')"
        "?.classList.contains('jp-mod-dirty') && !document.querySelector('.lm-TabBar-tab.jp-mod-dirty')",
        timeout=30_000)
    saved = json.loads((lab.root / TOUR.name).read_text())
    errors = [o for c in saved["cells"] if c["cell_type"] == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"saved notebook has error outputs: {[e.get('ename') for e in errors]}"


def test_stored_sharedtrain_notebook_still_shows_its_loss_plot(lab, browser):
    """Opened as saved (not trusted, nothing run), a %%sharedtrain summary keeps its loss plot.

    JupyterLab sanitizes the HTML outputs of a notebook it does not trust and
    drops inline SVG; the plot is an image, which it keeps. An inline SVG added
    to the same output shows the notebook really is treated as untrusted.
    """
    notebook = json.loads(SHAREDTRAIN.read_text())
    outputs = [o for c in notebook["cells"] for o in c.get("outputs", [])
               if "data:image/svg+xml" in "".join(o.get("data", {}).get("text/html", ""))]
    assert len(outputs) == 1, "the stored notebook holds one sharedtrain summary with its plot"
    html = "".join(outputs[0]["data"]["text/html"])
    outputs[0]["data"]["text/html"] = html + "<svg width='10' height='10'><rect width='10' height='10'/></svg>"
    (lab.root / SHAREDTRAIN.name).write_text(json.dumps(notebook))
    page = browser.start()
    try:
        _open_notebook(page, lab, SHAREDTRAIN.name)
        plot = page.locator(".jp-RenderedHTMLCommon img[src^='data:image/svg+xml']")
        plot.first.wait_for(timeout=CELL_TIMEOUT * 1000)
        page.wait_for_function("""() => { const i = document.querySelector(
            ".jp-RenderedHTMLCommon img[src^='data:image/svg+xml']"); return i && i.complete; }""")
        plot.first.scroll_into_view_if_needed()
        _shot(page, "10_stored_sharedtrain_plot")
        assert plot.count() == 1
        assert plot.first.evaluate("e => [e.naturalWidth, e.naturalHeight]") == [360, 120]
        assert page.locator(".jp-RenderedHTMLCommon svg rect").count() == 0, "inline SVG was not sanitized away"
        summary = page.locator(".jp-RenderedHTMLCommon").filter(has=page.locator("img[src^='data:image/svg+xml']"))
        assert "trained 'model'" in summary.first.inner_text()
    except BaseException:
        print("--- browser console ---\n" + "\n".join(browser.console[-60:]))
        raise
