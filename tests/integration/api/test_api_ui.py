"""The jobs page in a real browser (Debian's headless Chromium, driven by Selenium): log in with a key, see a
running job's progress move without reloading, open its page with the batch charts. Screenshots are kept
under the test's tmp_path (their paths are printed).

Without Chromium the test skips on a laptop and fails under CI (.ci/run installs it).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.wait import WebDriverWait

from tests.integration.api_server import api_server, make_key
from tests.integration.processes import service_env, workers
from worker.store.results import ResultStore

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,900",
)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        message = f"{CHROMIUM} and {CHROMEDRIVER} are needed: apt-get install -y chromium chromium-driver"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def done_of(driver: webdriver.Chrome, job_id: str) -> int:
    """The finished items the page shows for the job, from its "done / total" cell."""
    count = driver.find_element(By.CSS_SELECTOR, f'[data-job="{job_id}"] .count').text
    return int(count.split("/")[0])


@pytest.mark.slow
def test_the_jobs_page_shows_a_running_jobs_progress_moving(
    browser: webdriver.Chrome, redis_url: str, pg_url: str, pg_store: ResultStore, tmp_path: Path
) -> None:
    env = service_env(redis_url, pg_url, metrics_port=0)
    env.update(BATCHWORK_SIMULATED_BASE_MS="150", BATCHWORK_SIMULATED_PER_ITEM_MS="0")
    env["BATCHWORK_BATCHING"] = json.dumps({"simulated": {"max_batch_size": 4, "max_wait_ms": 5}})
    key = make_key(pg_url, "alice")
    with workers(env), api_server(env) as api:
        answer = httpx.post(
            f"{api.url}/v1/jobs",
            json={"model": "simulated", "inputs": [f"text {i}" for i in range(160)]},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert answer.status_code == 202, answer.text
        job_id = answer.json()["id"]

        browser.get(f"{api.url}/ui/")
        browser.find_element(By.NAME, "key").send_keys(key)
        browser.find_element(By.CSS_SELECTOR, "form button").click()
        wait = WebDriverWait(browser, 30, poll_frequency=0.2)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'[data-job="{job_id}"]'))
        browser.execute_script("window.notReloaded = true")
        first = done_of(browser, job_id)
        wait.until(lambda d: done_of(d, job_id) > first, f"the page's progress stayed at {first} items")
        assert browser.execute_script("return window.notReloaded") is True  # the script moved it, no reload
        bar = browser.find_element(By.CSS_SELECTOR, f'[data-job="{job_id}"] .done')
        assert bar.size["width"] > 0
        save(browser, tmp_path / "jobs-page.png")

        browser.get(f"{api.url}/ui/jobs/{job_id}")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".chart rect"))
        titles = [element.text for element in browser.find_elements(By.CSS_SELECTOR, ".chart > div")]
        assert [title.split(" (")[0] for title in titles] == [
            "batch size",
            "padding",
            "oldest item's wait",
            "run time",
        ]
        save(browser, tmp_path / "job-page.png")

        browser.get(f"{api.url}/ui/jobs/00000000-0000-0000-0000-000000000000")
        assert "No job" in browser.find_element(By.TAG_NAME, "body").text


def save(browser: webdriver.Chrome, path: Path) -> None:
    assert browser.save_screenshot(str(path))
    print(f"screenshot: {path}")
