"""Real-browser journeys: the real dashboard (`ddpdash ui`) in Debian's Chromium through Playwright.

Chromium must be installed (`.ci/run` installs it); a missing browser fails these tests, it does not
skip them. Each journey saves a screenshot of its last screen under test-artifacts/."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from sqlalchemy.orm import Session

from ddpdash.db.migrate import open_store
from ddpdash.db.runs import list_runs
from ddpdash.trainer.config import RunConfig
from tests.conftest import ROOT, stop_active_runs
from tests.seed import seed_run

pytestmark = [pytest.mark.browser, pytest.mark.slow]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = ROOT / "test-artifacts"
TIMEOUT_MS = 60_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_ui(home: Path, address: str = "127.0.0.1", **env: str) -> tuple[subprocess.Popen[bytes], str, str]:
    """The dashboard as `ddpdash ui` serves it: the process, its base URL, and the first link it printed
    (which carries this start's token when there is no password)."""
    port = free_port()
    full_env = {**os.environ, "DDPDASH_HOME": str(home), **env}
    full_env.pop("DDPDASH_DB_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "ddpdash.cli", "ui", "--port", str(port), "--address", address],
                            env=full_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    printed = proc.stdout.readline().decode()
    first_url = printed.rsplit(" ", 1)[-1].strip()
    url = f"http://127.0.0.1:{port}"
    assert first_url.startswith(url), printed
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url, first_url
        except OSError:
            time.sleep(0.3)
        if proc.poll() is not None:
            raise AssertionError(f"ddpdash ui exited: {proc.stdout.read().decode() if proc.stdout else ''}")
    proc.kill()
    raise AssertionError("the dashboard did not become healthy within 60 s")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert Path(CHROMIUM).exists(), "Debian's chromium is required: apt-get install -y chromium (.ci/run does)"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, str]]:
    home = tmp_path_factory.mktemp("browser") / "home"
    # Paces rank 0 so a few hundred steps take long enough to watch them grow (a test-only switch).
    proc, url, first_url = start_ui(home, DDPDASH_TEST_FAULT="sleep:0:0.05")
    yield url, home, first_url
    stop_active_runs(open_store(f"sqlite:///{home / 'ddpdash.db'}"))
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def page(browser: Browser, server: tuple[str, Path, str]) -> Iterator[Page]:
    """A browser tab that has opened the link `ddpdash ui` printed, as a user does: the token is then
    remembered in a cookie and left out of the address."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    url, _, first_url = server
    pg.goto(first_url, wait_until="domcontentloaded")
    expect(pg).to_have_url(re.compile(re.escape(url) + r"/?$"))
    yield pg
    context.close()


def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def set_number(page: Page, label: str, value: str) -> None:
    box = page.get_by_label(label, exact=True)
    box.fill(value)
    box.press("Enter")


def choose(page: Page, label: str, option: str, attempts: int = 5) -> None:
    """Pick an option; a rerun that lands while the list is open closes it, so open it again."""
    for _ in range(attempts):
        page.get_by_role("combobox", name=label).click()
        try:
            page.get_by_role("option", name=option, exact=True).click(timeout=5_000)
            break
        except PlaywrightTimeout:
            page.keyboard.press("Escape")
    expect(page.get_by_role("combobox", name=label)).to_have_value(option, timeout=30_000)


def steps_done(page: Page) -> int:
    text = page.get_by_text(re.compile(r"\d+/\d+ steps")).first.inner_text()
    return int(re.search(r"(\d+)/\d+ steps", text).group(1))  # type: ignore[union-attr]


def test_journey_launch_watch_and_stop(server: tuple[str, Path, str], page: Page) -> None:
    url, home, _ = server
    page.goto(f"{url}/new", wait_until="domcontentloaded")
    expect(page.get_by_role("heading", name="New run")).to_be_visible()
    set_number(page, "Num procs", "2")
    choose(page, "Backend", "gloo")
    set_number(page, "Batch size", "16")
    choose(page, "Amp", "bf16")
    set_number(page, "Max steps", "400")
    expect(page.get_by_text("32 = 16 × 2 ranks × 1 accum")).to_be_visible(timeout=30_000)
    page.get_by_role("button", name="Launch", exact=True).click()
    page.wait_for_url(re.compile(r"/(live)?\?run=\d+$"))  # Live is the default page: its URL is /
    chart = page.locator("[data-testid='stVegaLiteChart'] svg").first
    expect(chart).to_be_visible(timeout=90_000)
    expect(chart.get_by_text("rank 0", exact=True)).to_be_visible(timeout=30_000)
    expect(chart.get_by_text("rank 1", exact=True)).to_be_visible(timeout=30_000)
    first = steps_done(page)
    deadline = time.monotonic() + 30
    second = first
    while second <= first and time.monotonic() < deadline:  # two looks, a refresh or more apart
        time.sleep(2)
        second = steps_done(page)
    assert second > first, (first, second)
    page.get_by_role("button", name="Stop").click()
    page.get_by_role("button", name="Yes, stop it").click()
    expect(page.get_by_text("stopped", exact=True).first).to_be_visible(timeout=30_000)
    shot(page, "journey1-live-stopped")
    with Session(open_store(f"sqlite:///{home / 'ddpdash.db'}")) as s:
        assert [r.status for r in list_runs(s)] == ["stopped"]


def test_journey_bad_form_shows_the_error_and_launches_nothing(server: tuple[str, Path, str], page: Page) -> None:
    url, home, _ = server
    engine = open_store(f"sqlite:///{home / 'ddpdash.db'}")
    with Session(engine) as s:
        before = len(list_runs(s))
    page.goto(f"{url}/new", wait_until="domcontentloaded")
    set_number(page, "Batch size", "0")
    expect(page.get_by_text("Batch size must be ≥ 1, got 0")).to_be_visible()
    page.get_by_role("button", name="Launch", exact=True).click()
    expect(page.get_by_text("Nothing was launched")).to_be_visible()
    shot(page, "journey2-bad-form")
    with Session(engine) as s:
        assert len(list_runs(s)) == before


def test_journey_compare_two_finished_runs(server: tuple[str, Path, str], page: Page) -> None:
    url, home, _ = server
    engine = open_store(f"sqlite:///{home / 'ddpdash.db'}")
    ids = [seed_run(engine, RunConfig(name="lr-0.05", num_procs=2), steps=300),
           seed_run(engine, RunConfig(name="lr-0.2", num_procs=2, lr=0.2), steps=300, loss_scale=0.7)]
    page.goto(f"{url}/runs", wait_until="domcontentloaded")
    expect(page.get_by_role("heading", name="Runs")).to_be_visible()
    picker = page.get_by_role("combobox", name="Compare runs")
    for run_id, name in zip(ids, ["lr-0.05", "lr-0.2"], strict=True):
        picker.click()
        page.get_by_role("option", name=f"#{run_id} {name}").click()
    page.keyboard.press("Escape")
    page.get_by_role("button", name="Compare").click()
    page.wait_for_url(re.compile(r"/compare\?runs="))
    overlay = page.locator("[data-testid='stVegaLiteChart'] svg").first
    expect(overlay).to_be_visible(timeout=90_000)
    expect(overlay.get_by_text(f"#{ids[1]} lr-0.2")).to_be_visible()
    expect(page.get_by_role("heading", name="Config diff")).to_be_visible()
    expect(page.get_by_text("setting(s) differ")).to_be_visible()
    shot(page, "journey3-compare")
    shutil.copy(ARTIFACTS / "journey3-compare.png", ARTIFACTS / "compare.png")
    page.goto(f"{url}/live?run={ids[1]}", wait_until="domcontentloaded")  # a link to one run's Live page
    expect(page.get_by_role("heading", name="lr-0.2")).to_be_visible()
    expect(page.get_by_text("Page not found")).to_have_count(0)


def test_password_gates_every_page_and_sign_in_lands_on_the_deep_link(tmp_path: Path, browser: Browser) -> None:
    proc, url, first_url = start_ui(tmp_path / "home", address="0.0.0.0", DDPDASH_PASSWORD="s3cret-pw")
    assert first_url == f"{url}/"  # no token: the password is asked instead
    try:
        context = browser.new_context()
        pg = context.new_page()
        pg.set_default_timeout(TIMEOUT_MS)
        for path in ("/new", "/runs", "/live", "/compare?runs=1,2"):
            pg.goto(f"{url}{path}", wait_until="domcontentloaded")
            expect(pg.get_by_label("Password", exact=True)).to_be_visible()
            expect(pg.get_by_role("heading", name="New run")).to_have_count(0)
        pg.get_by_label("Password", exact=True).fill("wrong")
        pg.get_by_role("button", name="Sign in").click()
        expect(pg.get_by_text("Wrong password.")).to_be_visible()
        pg.get_by_label("Password", exact=True).fill("s3cret-pw")
        pg.get_by_role("button", name="Sign in").click()
        expect(pg.get_by_role("heading", name="Compare")).to_be_visible()  # where the link pointed
        expect(pg).to_have_url(re.compile(r"/compare\?runs=1(,|%2C)2"))
        context.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_public_bind_without_password_refuses_to_start(tmp_path: Path) -> None:
    env = {**os.environ, "DDPDASH_HOME": str(tmp_path)}
    env.pop("DDPDASH_PASSWORD", None)
    result = subprocess.run([sys.executable, "-m", "ddpdash.cli", "ui", "--address", "0.0.0.0", "--port",
                             str(free_port())], env=env, capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert result.returncode == 2
    assert "refusing to listen on 0.0.0.0" in result.stderr and "DDPDASH_PASSWORD" in result.stderr


@pytest.fixture(scope="module")
def sweep_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, str]]:
    """A dashboard on a machine of two CPU slots, rank 0 paced so a queue forms and can be watched."""
    home = tmp_path_factory.mktemp("sweep") / "home"
    proc, url, first_url = start_ui(home, DDPDASH_CPU_SLOTS="2", DDPDASH_TEST_FAULT="sleep:0:0.02")
    yield url, home, first_url
    stop_active_runs(open_store(f"sqlite:///{home / 'ddpdash.db'}"))
    proc.terminate()
    proc.wait(10)


def test_journey_a_sweep_queues_runs_and_shows_its_scaling_study(browser: Browser,
                                                                   sweep_server: tuple[str, Path, str]) -> None:
    url, home, first_url = sweep_server
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(first_url, wait_until="domcontentloaded")
    page.goto(f"{url}/new", wait_until="domcontentloaded")
    expect(page.get_by_role("heading", name="New run")).to_be_visible()
    set_number(page, "Batch size", "16")
    set_number(page, "Max steps", "250")
    page.get_by_text("Sweep: a grid of runs").click()
    grid = page.get_by_role("textbox", name="Grid, one setting per line")
    grid.fill("num_procs=1,2")
    grid.press("Control+Enter")  # a text area applies its value on Ctrl+Enter (or when it loses focus)
    expect(page.get_by_text(re.compile(r"2 run\(s\): 2 num_procs"))).to_be_visible(timeout=30_000)
    page.get_by_role("button", name="Launch sweep").click()
    page.wait_for_url(re.compile(r"/sweep\?sweep=sweep-"), timeout=90_000)
    engine = open_store(f"sqlite:///{home / 'ddpdash.db'}")
    with Session(engine) as s:
        one, two = sorted(list_runs(s), key=lambda r: r.id)
    assert (one.world_size, two.world_size) == (1, 2) and one.sweep == two.sweep
    # The 2-rank run waits while the 1-rank run holds one of the two slots: Live says so.
    page.goto(f"{url}/live?run={two.id}", wait_until="domcontentloaded")
    expect(page.get_by_text(re.compile(rf"Queued, #1 in line: needs 2 CPU slot\(s\); 1 of 2 are used by run\(s\) "
                                       rf"#{one.id}"))).to_be_visible(timeout=30_000)
    shot(page, "journey-sweep-queued")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        with Session(engine) as s:
            if all(r.status == "succeeded" for r in list_runs(s)):
                break
        time.sleep(1)
    page.goto(f"{url}/sweep?sweep={one.sweep}", wait_until="domcontentloaded")
    expect(page.get_by_role("heading", name="Scaling study")).to_be_visible(timeout=60_000)
    expect(page.get_by_text("ideal (linear)").first).to_be_visible(timeout=60_000)
    expect(page.get_by_text("2 run(s); 0 queued or running")).to_be_visible()
    shot(page, "journey-sweep-scaling")
    with Session(engine) as s:
        done = sorted(list_runs(s), key=lambda r: r.id)
    assert [r.status for r in done] == ["succeeded", "succeeded"]
    assert done[0].ended_at <= done[1].admitted_at  # the second waited for the first
    context.close()
