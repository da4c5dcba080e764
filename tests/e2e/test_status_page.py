"""The status page in a real headless Chromium (Debian's), driven by Playwright."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from gpuwatch.testing.daemon_process import DaemonProcess

CHROMIUM = shutil.which("chromium")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(CHROMIUM is None, reason="Debian package chromium not installed")]


def test_status_page_shows_the_faulty_sim_gpu(demo_daemon: DaemonProcess, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and demo_daemon.get("/v1/gpus/5")["state"] != "unhealthy":
        time.sleep(1)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"],
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(demo_daemon.url + "/")
            row = page.locator('tr[data-gpu="5"]')
            assert row.get_attribute("data-state") == "unhealthy"
            assert "ecc_uncorrectable" in row.inner_text()
            assert "reset_gpu" in row.inner_text()
            assert "yes" in row.locator("td").nth(5).inner_text()
            assert page.locator('tr[data-gpu="0"]').get_attribute("data-state") == "healthy"
            assert page.locator("meta[http-equiv=refresh]").count() == 1
            shot = tmp_path / "status-page.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            print(f"screenshot: {shot}")
        finally:
            browser.close()
