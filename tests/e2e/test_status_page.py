"""The status page at the HTTP port's ``/`` in a real headless browser: Debian's chromium driven
by selenium through Debian's chromedriver (tests/support/install-chromium.sh; nothing is
downloaded). The page loads and names the model, its numbers move under load, and a chat
answer streams in. Each number is checked against the daemon's own metrics read by the test:
the counts equal them once the load stops, and each percentile lies in the histogram bucket
where that quantile falls; the chat answer is the one the daemon generated for the page."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from benchmarks._support.daemon import Daemon
from benchmarks._support.metrics import scrape, value
from zerolayer.client import SyncClient

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
    "--window-size=1100,900",
)  # fmt: skip


def _browser():
    if not (os.path.exists(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.fail(
            "chromium is missing: `make test` installs it (tests/support/install-chromium.sh)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


def _wait(check, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"the page never showed {what}")


TOKENS = "zerolayer_generation_tokens_total"
TTFT, ITL = "zerolayer_time_to_first_token_seconds", "zerolayer_inter_token_latency_seconds"


def _total(samples: dict, name: str) -> float:
    """A counter summed over its label sets, as the page shows it."""
    return sum(v for (sample, _), v in samples.items() if sample == name)


def _bucket_of(samples: dict, name: str, q: float) -> tuple[float, float]:
    """(lower, upper) bounds in ms of the bucket of histogram ``name`` holding its ``q``
    quantile: the first bucket whose cumulative count reaches q x the total."""
    buckets = sorted(
        (float(dict(labels)["le"]), count)
        for (sample, labels), count in samples.items()
        if sample == name + "_bucket"
    )
    total = buckets[-1][1]
    lower = 0.0
    for le, count in buckets:
        if count >= q * total:
            return 1000 * lower, 1000 * le
        lower = le
    raise AssertionError(f"{name} has no bucket for q={q}")


def _ms(text: str) -> float:
    assert text.endswith(" ms"), text
    return float(text[:-3])


@pytest.mark.timeout(300)
def test_status_page_loads_moves_under_load_and_chats(tmp_path):
    with Daemon({"ENGINE__SYNTHETIC_STEP_MS": "5"}) as d:
        browser = _browser()
        stop = threading.Event()

        def load() -> None:  # two streams at a time until the test is done
            with SyncClient(d.endpoint, "") as c:
                while not stop.is_set():
                    for n, _ in enumerate(c.stream("load", 400)):
                        if stop.is_set() or n > 300:
                            break

        threads = [threading.Thread(target=load) for _ in range(2)]
        try:
            browser.get(d.http_url + "/")
            text = lambda i: browser.find_element("id", i).text  # noqa: E731
            _wait(lambda: text("model") == "synthetic", "the model name")
            assert text("health") == "ready" and text("version")
            _wait(lambda: "s" in text("uptime"), "the uptime")
            for t in threads:
                t.start()
            _wait(lambda: text("running") not in ("", "–", "0"), "running streams")
            first = _wait(lambda: text("tokens") not in ("", "–") and int(text("tokens")), "tokens")
            _wait(lambda: int(text("tokens")) > first, "the token count moving")
            _wait(lambda: text("tps") not in ("", "–") and float(text("tps")) > 0, "tokens/s")
            _wait(lambda: text("ttft50").endswith("ms"), "a TTFT percentile")
            _wait(lambda: text("itl99").endswith("ms"), "an ITL percentile")
            stop.set()
            for t in threads:
                t.join(60)
            # the load has stopped: once the page has polled again, its numbers are the daemon's
            _wait(lambda: value(scrape(d.metrics_url), "zerolayer_num_requests_running") == 0,
                  "the load's streams ending")  # fmt: skip
            m = scrape(d.metrics_url)
            done, tokens = _total(m, "zerolayer_request_success_total"), _total(m, TOKENS)
            _wait(lambda: text("tokens") == f"{tokens:.0f}", f"the daemon's {tokens:.0f} tokens")
            assert text("requests") == f"{done:.0f}" and text("running") == "0"
            ttft_count = m[(TTFT + "_count", ())]
            assert text("ttftn") == f"{ttft_count:.0f}"
            for key, name, q in (("ttft50", TTFT, 0.5), ("itl99", ITL, 0.99)):
                lower, upper = _bucket_of(m, name, q)
                shown = _ms(text(key))
                assert lower - 0.05 <= shown <= upper + 0.05, (key, shown, lower, upper)  # rounding
            browser.find_element("id", "prompt").send_keys("Hello from the browser")
            browser.find_element("id", "send").click()
            answer = browser.find_element("id", "answer")
            _wait(lambda: answer.get_attribute("data-done") == "1", "the chat answer's end")
            shown = answer.get_attribute("textContent")
            assert "[" not in shown  # no error appended
            # the page asks for 128 tokens; the synthetic model writes one character a token
            m = scrape(d.metrics_url)
            assert value(m, TOKENS, api="openai") == 128
            assert len(shown) == 128
            shot = os.environ.get("STATUS_PAGE_SCREENSHOT") or str(tmp_path / "status.png")
            assert browser.save_screenshot(shot)
        finally:
            stop.set()
            browser.quit()
