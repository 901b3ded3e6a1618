"""Headless Chromium for the browser tests: Debian's /usr/bin/chromium driven by Playwright.

Playwright's own browser download cannot run on these machines, so the tests launch the
system browser by path, in a fresh profile, with nothing that phones home. Without the browser
or Playwright the test skips (scripts/test.sh installs Chromium where it runs as root).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ARGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
)
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"  # screenshots; gitignored


def require_chromium():
    """Playwright's sync API, or skip the test where the browser or Playwright is missing."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is absent (apt-get install chromium)")
    return pytest.importorskip("playwright.sync_api", reason="playwright is not installed")


@contextmanager
def chromium(profile_dir: Path, *, width: int = 1280, height: int = 900) -> Iterator:
    """A Playwright browser context on a fresh profile in `profile_dir`; skips the test without one."""
    sync_api = require_chromium()
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile_dir), executable_path=str(CHROMIUM), headless=True, args=list(ARGS),
            viewport={"width": width, "height": height},
        )
        try:
            yield context
        finally:
            context.close()
