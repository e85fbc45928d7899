"""The web UI in Chromium against the running service: sign in, submit, watch, read, chat, browse.

One module: the tests run in order on one browser context (signed in once) and one real CPU job
(the playbook, one step), so the whole walk takes about a minute. Screenshots of every page are
saved (``shots``); ``KERNELCREW_SCREENSHOTS_DIR=docs/screenshots`` regenerates docs/service.md's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import VIEWPORT
from tests.conftest import FIXTURES
from tests.unit.test_web import H100_REPORT, store_finished_job

TASK_FILE = FIXTURES / "tasks" / "pointwise.py"
JOB_TIMEOUT_MS = 150_000


@pytest.fixture(scope="module")
def page(browser, service) -> Iterator[Any]:
    context = browser.new_context(viewport=VIEWPORT, base_url=service.url)
    context.set_default_timeout(20_000)
    page = context.new_page()
    yield page
    context.close()


@pytest.fixture(scope="module")
def job(page, service) -> dict[str, str]:
    """Filled in by the upload test: the job the later tests read."""
    return {}


def shot(page: Any, shots: Path, name: str) -> None:
    page.screenshot(path=str(shots / f"{name}.png"))


def test_a_wrong_token_is_refused(page, shots):
    page.goto("/jobs")
    expect(page).to_have_url(re.compile(r"/signin\?next=/jobs$"))  # not signed in: sent to the sign-in page
    expect(page.get_by_label("API token", exact=True)).to_be_focused()  # by keyboard alone
    page.keyboard.type("kc_00000000_not-a-token")
    page.keyboard.press("Enter")
    expect(page.locator("#token-error")).to_contain_text("unknown or revoked")
    assert page.context.cookies() and not [c for c in page.context.cookies() if c["name"] == "kc_session"]
    shot(page, shots, "signin")


def test_sign_in_upload_a_task_and_watch_it_finish_live(page, service, shots, job):
    page.get_by_label("API token", exact=True).fill(service.tokens["alice"])
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Jobs")).to_be_visible()
    page.keyboard.press("Tab")
    expect(page.get_by_role("link", name="Skip to content")).to_be_focused()
    session = next(c for c in page.context.cookies() if c["name"] == "kc_session")
    assert session["httpOnly"] and session["sameSite"] == "Strict"

    page.get_by_role("link", name="New job").first.click()
    page.locator("#task_text").fill("def (:\n")
    page.get_by_role("button", name="Queue the job").click()
    expect(page.locator("#task-error")).to_contain_text("not a valid task")  # next to its input
    shot(page, shots, "new_job_errors")

    page.locator("#task_text").fill("")
    page.get_by_label("Upload the task file", exact=True).set_input_files(str(TASK_FILE))
    page.get_by_label("Target", exact=True).select_option("cpu")
    page.get_by_label("Backend", exact=True).select_option("playbook")
    page.get_by_label("Budget: steps", exact=True).fill("1")
    page.get_by_label("torch.compile baselines", exact=True).fill("none")
    page.get_by_label("Quick timing", exact=True).check()
    shot(page, shots, "new_job")
    page.get_by_role("button", name="Queue the job").click()
    expect(page).to_have_url(re.compile(r"/jobs/[0-9a-f]{32}$"))
    job["id"] = page.url.rstrip("/").split("/")[-1]

    listing = page.context.new_page()  # the jobs list, open in a second tab, follows the job live
    listing.goto("/jobs")
    row = listing.locator("tr", has=listing.locator(f"a[href='/jobs/{job['id']}']"))
    expect(row.locator(".status")).not_to_have_text("succeeded")
    listing.evaluate("window.__notReloaded = true")

    page.evaluate("window.__notReloaded = true")  # the page must update itself, not reload
    expect(page.locator(".live")).to_be_visible()
    expect(page.locator(".timeline .stage").first).to_be_visible(timeout=JOB_TIMEOUT_MS)
    shot(page, shots, "job_running")
    expect(page.locator("#job-head .status")).to_have_text("succeeded", timeout=JOB_TIMEOUT_MS)
    assert page.evaluate("window.__notReloaded") is True
    expect(row.locator(".status")).to_have_text("succeeded")
    assert listing.evaluate("window.__notReloaded") is True
    listing.close()
    expect(page.locator(".timeline")).to_contain_text("fused_pointwise")
    expect(page.get_by_role("link", name="Download best.py")).to_be_visible()


def test_the_job_page_shows_the_diff_the_charts_and_the_downloads(page, service, shots, job):
    page.goto(f"/jobs/{job['id']}")
    expect(page.locator("#job-head .pill.verdict-pass")).to_have_text("pass")
    replaced = page.locator("#replaced pre.diff")  # open: Model against ModelNew, not the whole file
    expect(replaced).to_be_visible()
    expect(replaced.locator(".d-del", has_text="class Model(")).to_have_count(1)
    expect(replaced.locator(".d-add", has_text="class ModelNew")).to_have_count(1)
    expect(page.locator("#kernels > summary")).to_contain_text("Kernels and helpers it adds")
    expect(page.locator("#kernels .part").first).not_to_be_visible()  # collapsed until asked for
    page.get_by_text("The whole file against the reference").click()
    diff = page.locator("#diff pre.diff")
    expect(diff).to_be_visible()
    expect(diff.locator(".d-add", has_text="class ModelNew")).to_have_count(1)
    page.get_by_text("The whole file against the reference").click()  # closed again
    expect(page.locator("#time-chart svg")).to_be_visible()
    expect(page.locator("#time-chart svg circle.dot")).to_have_count(1)
    expect(page.locator("#roofline-chart")).to_contain_text("Not available on this device because")
    expect(page.locator("#best-source .hl")).to_contain_text("class ModelNew")
    with page.expect_download() as download:
        page.get_by_role("link", name="Download best.py").click()
    assert "class ModelNew" in Path(download.value.path()).read_text()
    page.evaluate("window.scrollTo(0, 0)")
    shot(page, shots, "job")
    page.evaluate("document.getElementById('charts-h').scrollIntoView()")
    shot(page, shots, "job_charts")
    page.locator("#kernels > summary").click()
    page.evaluate("document.getElementById('replaced').scrollIntoView()")
    shot(page, shots, "job_diff")


def test_a_chat_message_resumes_the_finished_job_and_the_crew_answers(page, shots, job):
    page.goto(f"/jobs/{job['id']}")
    page.evaluate("window.__notReloaded = true")
    page.get_by_label("Message", exact=True).fill("stop")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".msg-user")).to_contain_text("stop")
    expect(page.get_by_label("Message", exact=True)).to_have_value("")
    expect(page.locator(".msg-crew").first).to_be_visible(timeout=JOB_TIMEOUT_MS)
    expect(page.locator("#job-head .status")).to_have_text("succeeded", timeout=JOB_TIMEOUT_MS)
    assert page.evaluate("window.__notReloaded") is True
    page.locator("#chat").scroll_into_view_if_needed()
    shot(page, shots, "job_chat")


def test_the_jobs_list_knowledge_base_and_workers_pages(page, shots, job):
    page.goto("/jobs")
    row = page.locator("tr", has=page.locator(f"a[href='/jobs/{job['id']}']"))
    expect(row.locator(".status")).to_have_text("succeeded")
    expect(row.locator("td[data-label='Verdict']")).to_have_text("pass")
    expect(row.locator("td[data-label='Answer']")).not_to_have_text("-")
    expect(row).to_contain_text("CPU")
    expect(row.locator("td[data-label='Task']")).to_contain_text("Fixture task: a two-input pointwise chain")
    shot(page, shots, "jobs")
    page.get_by_label("Verdict", exact=True).select_option("fail")
    page.get_by_role("button", name="Filter").click()
    expect(page).to_have_url(re.compile(r"/jobs\?.*\bverdict=fail\b"))
    expect(page.locator(f"a[href='/jobs/{job['id']}']")).to_have_count(0)
    page.get_by_label("Verdict", exact=True).select_option("pass")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator(f"a[href='/jobs/{job['id']}']")).to_have_count(1)

    page.get_by_role("link", name="Knowledge base").click()
    expect(page.locator("table.list")).to_contain_text("sm_90")  # the seeds of every architecture
    shot(page, shots, "kb")
    page.get_by_label("Search", exact=True).fill("pointwise")
    page.get_by_label("Architecture", exact=True).select_option("cpu")
    page.get_by_role("button", name="Search").click()
    expect(page).to_have_url(re.compile(r"/kb\?q=pointwise&arch=cpu"))
    rows = page.locator("table.list tbody tr")
    expect(rows.first).to_contain_text("pointwise")
    assert set(rows.locator("td:nth-child(2)").all_inner_texts()) == {"cpu"}  # the arch column
    page.locator("table.list tbody tr a").first.click()
    expect(page.locator("dl.facts")).to_contain_text("Pattern")
    shot(page, shots, "kb_record")

    page.get_by_role("link", name="Workers").click()
    expect(page.locator("table.list")).to_contain_text("cpu")
    shot(page, shots, "workers")


def test_a_gpu_report_draws_its_roofline_and_ncu_table(page, service, shots):
    """The GPU evidence a CPU machine cannot produce, from a committed H100 run's report (tests/fixtures/reports)."""
    report = json.loads(H100_REPORT.read_text())
    job_id = store_finished_job(service.engine, "alice", report, None)  # its best.py was not kept
    page.goto(f"/jobs/{job_id}")
    roofline = page.locator("#roofline-chart svg")
    expect(roofline).to_be_visible()
    expect(roofline.locator("circle.dot")).to_have_count(2 + len(report["iterations"]))
    expect(page.locator("table.ncu")).to_contain_text("DRAM throughput")
    expect(page.locator("#code-h + p")).to_contain_text("not stored")
    page.locator("#roofline-chart").screenshot(path=str(shots / "gpu_report_roofline_chart.png"))
    page.locator("table.ncu").screenshot(path=str(shots / "gpu_report_ncu.png"))


@pytest.mark.parametrize("width", [390])
def test_narrow_screens_scroll_only_vertically(browser, service, shots, job, width):
    """A phone-sized window: the list becomes one card per job, the job page stacks, nothing is
    wider than the screen (code and diffs scroll inside their own boxes)."""
    context = browser.new_context(viewport={"width": width, "height": 844}, base_url=service.url)
    try:
        page = context.new_page()
        page.goto("/signin")
        page.get_by_label("API token", exact=True).fill(service.tokens["alice"])
        page.get_by_role("button", name="Sign in").click()
        expect(page.get_by_role("heading", name="Jobs")).to_be_visible()
        overflow = "document.documentElement.scrollWidth - window.innerWidth"
        assert page.evaluate(overflow) <= 0
        shot(page, shots, "jobs_narrow")
        page.goto(f"/jobs/{job['id']}")
        expect(page.locator("#job-head h1")).to_be_visible()
        assert page.evaluate(overflow) <= 0
        shot(page, shots, "job_narrow")
    finally:
        context.close()
