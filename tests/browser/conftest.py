"""Chromium (Debian's, driven by Playwright) against the real service of the integration tests.

The service is ``tests/integration/test_service.py``'s fixture (PostgreSQL, Redis, ``kernelcrew
serve``, an orchestrator, a cpu worker), reused rather than copied, on a Redis database of its own. Without Chromium or Playwright
the browser tests skip on a laptop and fail under CI (``CI=true``), where ``.ci/run`` installs them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_service import BROWSER_REDIS_URL, service_fixture

service = service_fixture(BROWSER_REDIS_URL)  # the integration tests' service, on its own database

CHROMIUM = Path(os.environ.get("KERNELCREW_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1280, "height": 800}


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"the browser tests cannot run under CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("Playwright is not installed (pip install -e '.[dev]')")
    if not CHROMIUM.exists():
        _unavailable(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def shots() -> Path:
    """Where screenshots go: test artifacts, or ``KERNELCREW_SCREENSHOTS_DIR`` (docs/screenshots)."""
    default = Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"
    directory = Path(os.environ.get("KERNELCREW_SCREENSHOTS_DIR") or default)
    directory.mkdir(parents=True, exist_ok=True)
    return directory
