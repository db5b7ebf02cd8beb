"""The inspection console at ``/``, in a real browser (Debian's chromium + chromedriver, driven by Selenium)
against a real ``padim serve`` on 127.0.0.1.

Screenshots are saved as test artifacts in ``$PADIM_TEST_ARTIFACTS`` (default ``test-artifacts/`` in
the repository, which git ignores). The browser is the ``browser`` component of tests/components.py
(``bash tests/setup-system.sh`` installs Debian's chromium and chromium-driver; elsewhere point
``PADIM_TEST_CHROMIUM`` and ``PADIM_TEST_CHROMEDRIVER`` at a Chromium that runs headless); without
it these tests skip, saying so.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import durations
import httpx
import pytest
from components import browser_paths
from helpers import SCORE_ATOL, running_server

pytestmark = [pytest.mark.browser, pytest.mark.system]

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("PADIM_TEST_ARTIFACTS", ROOT / "test-artifacts"))


@pytest.fixture(scope="module")
def browser():
    chromium, chromedriver = browser_paths()  # there: the browser marker checked it
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = chromium
    # a closed network: no background connections, no first-run, a fresh profile
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1366,768",
    ):
        options.add_argument(flag)
    with durations.timed("browser start-ups"):
        driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    driver.set_page_load_timeout(30)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver, condition, timeout: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(condition)


def text(driver, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id).text


def api_score(url: str, path: Path, **params) -> dict:
    response = httpx.post(
        f"{url}/models/weave/score",
        content=path.read_bytes(),
        params=params,
        headers={"content-type": "image/png"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_upload_shows_the_apis_score_and_the_threshold_slider_rescores(browser, server, dataset):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    defect = dataset / "test" / "hole" / "000.png"
    browser.get("about:blank")  # the page of another test's server (stopped, or still polled) stops here
    browser.get_log("browser")  # and what it logged is not this page's
    browser.get(server.url + "/")
    wait(browser, lambda d: not d.find_element(By.ID, "model").get_property("disabled"))
    assert browser.find_element(By.ID, "model").get_attribute("value") == "weave"
    assert not browser.find_element(By.ID, "demo-warning").get_property("hidden")  # random weights say so

    browser.find_element(By.ID, "file-input").send_keys(str(defect))
    wait(browser, lambda d: d.find_element(By.ID, "score").text)
    expected = api_score(server.url, defect)  # another request than the page's: equal to SCORE_ATOL
    shown = float(browser.find_element(By.ID, "score").get_attribute("data-value"))
    assert shown == pytest.approx(expected["score"], abs=SCORE_ATOL)
    assert text(browser, "score") == f"{shown:.4f}"  # the page shows what it was given
    assert float(text(browser, "score")) == pytest.approx(expected["score"], abs=0.5e-4 + SCORE_ATOL)
    assert text(browser, "verdict") == ("ANOMALOUS" if shown >= 0.5 else "NORMAL")
    assert "ms on the server" in text(browser, "latency")
    assert browser.find_element(By.ID, "overlay").get_attribute("src").startswith("data:image/png;base64,")
    browser.save_screenshot(str(ARTIFACTS / "console-scored.png"))

    # a threshold just above the image's score: the page re-scores and must agree with the API
    above = min(0.99, round(expected["score"] + 0.005, 2) if expected["score"] < 0.985 else 0.99)
    slider = browser.find_element(By.ID, "threshold")
    slider.click()  # keyboard focus on the slider; Home then Right steps of 0.01 from 0.01
    slider.send_keys(Keys.HOME)
    for _ in range(round(above * 100) - 1):
        slider.send_keys(Keys.ARROW_RIGHT)
    wait(browser, lambda d: text(d, "used-threshold") == f"{above:.2f}")
    moved = api_score(server.url, defect, threshold=above)
    assert text(browser, "verdict") == ("ANOMALOUS" if moved["is_anomaly"] else "NORMAL")
    assert float(browser.find_element(By.ID, "area").get_attribute("data-value")) == pytest.approx(
        moved["anomalous_area"], abs=1e-3
    )  # a few pixels on the threshold may fall either way
    browser.find_element(By.ID, "show-mask").click()
    assert (
        browser.find_element(By.ID, "mask").is_displayed() and not browser.find_element(By.ID, "overlay").is_displayed()
    )
    browser.save_screenshot(str(ARTIFACTS / "console-threshold.png"))

    # keyboard only: r resets to the model's threshold
    browser.find_element(By.TAG_NAME, "body").send_keys("r")
    wait(browser, lambda d: text(d, "used-threshold") == "0.50")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#history li")) == 1
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe


@pytest.mark.load_sensitive
def test_several_images_fill_the_session_history(browser, server, dataset):
    from selenium.webdriver.common.by import By

    paths = [
        dataset / "test" / "good" / "000.png",
        dataset / "test" / "hole" / "001.png",
        dataset / "test" / "good" / "001.png",
    ]
    browser.get(server.url + "/")
    wait(browser, lambda d: not d.find_element(By.ID, "model").get_property("disabled"))
    browser.find_element(By.ID, "file-input").send_keys("\n".join(map(str, paths)))
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#history li")) == 3)
    tags = [float(e.text) for e in browser.find_elements(By.CSS_SELECTOR, "#history .tag")]  # 3 decimals
    expected = [api_score(server.url, p)["score"] for p in reversed(paths)]  # newest first
    assert tags == pytest.approx(expected, abs=0.5e-3 + SCORE_ATOL)
    browser.find_elements(By.CSS_SELECTOR, "#history button")[2].click()  # the first image again
    first = api_score(server.url, paths[0])["score"]
    wait(
        browser,
        lambda d: d.find_elements(By.CSS_SELECTOR, "#history button")[2].get_attribute("aria-current") == "true",
    )
    assert float(browser.find_element(By.ID, "score").get_attribute("data-value")) == pytest.approx(
        first, abs=SCORE_ATOL
    )


def test_a_server_with_an_api_key_asks_for_it_and_the_key_stays_in_the_tab(browser, model_file, dataset, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    with running_server(tmp_path, [model_file], env={"PADIM_API_KEY": "s3cret-key"}) as keyed:
        browser.get(keyed.url + "/")
        wait(browser, lambda d: "API key" in text(d, "error"))
        assert browser.switch_to.active_element.get_attribute("id") == "api-key"
        field = browser.find_element(By.ID, "api-key")
        field.send_keys("s3cret-key", Keys.TAB)
        wait(browser, lambda d: not d.find_element(By.ID, "model").get_property("disabled"))
        assert browser.execute_script("return sessionStorage.getItem('padim-api-key')") == "s3cret-key"
        assert browser.execute_script("return localStorage.length") == 0
        browser.find_element(By.ID, "file-input").send_keys(str(dataset / "test" / "good" / "000.png"))
        wait(browser, lambda d: d.find_element(By.ID, "score").text)
        browser.save_screenshot(str(ARTIFACTS / "console-api-key.png"))


def test_the_page_and_its_files_come_from_the_server_only(server):
    page = httpx.get(server.url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert "http://" not in page.text and "https://" not in page.text  # no CDN: works on a closed network
    for asset in ("/console/console.js", "/console/console.css"):
        response = httpx.get(server.url + asset, timeout=10)
        assert response.status_code == 200 and "http://" not in response.text and "https://" not in response.text
    missing = httpx.get(server.url + "/console/nothing.js", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert "/" not in httpx.get(server.url + "/openapi.json", timeout=10).json()["paths"]


def test_a_tiled_fp16_model_with_a_region_says_so_and_scores_a_picture(browser, dataset, tmp_path):
    from helpers import run_cli
    from selenium.webdriver.common.by import By

    model = tmp_path / "tiled.padim"
    run_cli(
        "-q",
        "train",
        dataset / "train" / "good",
        "--output",
        model,
        "--weights",
        "random",
        "--image-size",
        64,
        "--tiles",
        "2x2",
        "--roi",
        "8,8,80,80",
        "--calibration-folds",
        2,
        "--embedding-dim",
        32,
        "--precision",
        "fp16",
        "--expect",
        "auto",
    )
    with running_server(tmp_path, [model]) as srv:
        browser.get(srv.url + "/")
        wait(browser, lambda d: not d.find_element(By.ID, "model").get_property("disabled"))
        option = browser.find_element(By.CSS_SELECTOR, "#model option").text
        assert "2x2 tiles of 64 px (128x128, position statistics)" in option
        info = text(browser, "model-info")
        assert "Scores the region x=8, y=8, 80x80 px only." in info and "Input: 2x2 tiles of 64 px" in info
        assert "Runtime torch at fp16 (scores within " in info and "% of fp32's on 16 training pictures)" in info
        assert "1.5x what 30 training pictures showed (light " in info  # --expect auto's cover
        path = dataset / "test" / "hole" / "000.png"
        browser.find_element(By.ID, "file-input").send_keys(str(path))
        wait(browser, lambda d: d.find_element(By.ID, "score").text)
        response = httpx.post(
            f"{srv.url}/score", content=path.read_bytes(), headers={"content-type": "image/png"}, timeout=60
        )
        shown = float(browser.find_element(By.ID, "score").get_attribute("data-value"))
        assert shown == pytest.approx(response.json()["score"], abs=SCORE_ATOL)
        browser.save_screenshot(str(ARTIFACTS / "console-tiled.png"))


def test_the_monitor_panel_says_what_the_monitor_json_says(browser, model_file, tmp_path):
    from helpers import normal_and_shifted, score_in_batches
    from selenium.webdriver.common.by import By

    normal, shifted = normal_and_shifted(tmp_path / "line", 40)
    env = {"PADIM_MONITOR_WINDOW": "40", "PADIM_MONITOR_MIN_IMAGES": "30"}

    def panel_agrees() -> dict:
        expected = httpx.get(f"{server.url}/models/weave/monitor").json()
        wait(
            browser,
            lambda d: d.find_element(By.ID, "monitor-status").get_attribute("data-status") == expected["status"],
        )
        assert text(browser, "monitor-verdict") == expected["verdict"][0].upper() + expected["verdict"][1:]
        assert text(browser, "monitor-window").startswith(
            f"Version 1: {expected['images']} of the last 40 images kept since"
        )
        # the plot: the calibration's bars and the window's drawn, the threshold line in the middle
        drawn = browser.execute_script(
            "const c = document.getElementById('monitor-plot'); const d = c.getContext('2d')"
            ".getImageData(0, 0, c.width, c.height).data; let blue = 0, grey = 0, red = 0;"
            "for (let i = 0; i < d.length; i += 4) { if (d[i+3] === 0) continue;"
            " if (d[i+2] > 150 && d[i] < 100) blue++; else if (d[i] > 180 && d[i+1] < 80) red++;"
            " else if (Math.abs(d[i] - d[i+2]) < 30 && d[i] > 120 && d[i] < 230) grey++; }"
            "return {blue, grey, red};"
        )
        assert drawn["grey"] > 100 and drawn["red"] > 50, drawn
        assert (drawn["blue"] > 50) == (expected["images"] > 0), drawn
        return expected

    with running_server(tmp_path, [model_file], env=env) as server:
        score_in_batches(server.url, normal)
        browser.get(server.url + "/")
        calm = panel_agrees()
        assert calm["status"] == "normal" and text(browser, "monitor-status") == "normal"
        score_in_batches(server.url, shifted)  # the panel refreshes on its own within 5 s
        drift = panel_agrees()
        assert drift["status"] == "alarm" and text(browser, "monitor-status") == "ALARM"
        assert "more flags than normal images alone would give" in text(browser, "monitor-verdict")
        browser.execute_script("document.getElementById('monitor').scrollIntoView()")
        assert browser.execute_script(
            "const a = document.querySelector('aside'); return a.scrollWidth <= a.clientWidth"
        )
        browser.save_screenshot(str(ARTIFACTS / "console-monitor-alarm.png"))
        browser.find_element(By.ID, "monitor-reset").click()
        browser.switch_to.alert.accept()
        # the reset's answer is what the panel shows; reading /monitor before the POST lands would expect the alarm
        wait(browser, lambda d: d.find_element(By.ID, "monitor-status").get_attribute("data-status") == "collecting")
        after = panel_agrees()
        assert after["status"] == "collecting" and after["images"] == 0


def test_the_console_shows_versions_an_admin_rolls_back_and_sizes_the_threshold(browser, model_file, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    from padim.models.repository import Repository

    repository = Repository(tmp_path / "repo")
    for _ in range(2):
        repository.activate("weave", repository.add("weave", model_file).version)
    env = {"PADIM_ADMIN_KEY": "adm1n-key", "PADIM_RECORD_DIR": str(tmp_path / "record")}
    with running_server(tmp_path, [], env=env, args=("--repository", str(tmp_path / "repo"))) as served:
        browser.get(served.url + "/")
        wait(browser, lambda d: "Version 2." in text(d, "model-info"))
        assert "weave v2" in browser.find_element(By.ID, "model").text
        assert "v2 (active)" in text(browser, "version-list") and "v1 —" in text(browser, "version-list")
        wait(browser, lambda d: text(d, "monitor-window").startswith("Version 2:"))
        browser.find_element(By.ID, "rollback").click()  # no key yet: asks for it, changes nothing
        wait(browser, lambda d: "admin key" in text(d, "version-message"))
        browser.find_element(By.ID, "admin-key").send_keys("adm1n-key", Keys.TAB)
        browser.find_element(By.ID, "rollback").click()
        wait(browser, lambda d: d.switch_to.alert).accept()
        wait(browser, lambda d: "back on version 1" in text(d, "version-message"))
        wait(browser, lambda d: "Version 1." in text(d, "model-info"))
        assert "v1 (active)" in text(browser, "version-list")
        # the line has scored nothing yet: the route's answer says how many pictures a threshold sized by it needs
        browser.find_element(By.ID, "line-threshold").click()
        wait(browser, lambda d: "499 are needed" in text(d, "version-message"))
        assert "0 normal picture(s)" in text(browser, "version-message")
        assert "adm1n" not in browser.current_url
        assert browser.execute_script("return sessionStorage.getItem('padim-admin-key')") == "adm1n-key"
        assert browser.execute_script("return localStorage.length") == 0
        browser.save_screenshot(str(ARTIFACTS / "console-versions.png"))
        listed = httpx.get(served.url + "/models").json()["models"][0]
    assert listed["version"] == 1 and (tmp_path / "repo" / "weave" / "ACTIVE").read_text() == "1\n"


def test_the_review_queue_labels_pictures_by_keyboard(browser, model_file, dataset, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    env = {
        "PADIM_RECORD_DIR": str(tmp_path / "record"),
        "PADIM_REVIEW_SAMPLE": "1",
        "PADIM_RUNTIME": "torch",
        "PADIM_REPLICA": "press-a",
    }
    pictures = [
        *sorted(dataset.glob("test/good/*.png"))[:4],
        dataset / "test" / "hole" / "000.png",
    ]  # a defect last: first in the queue
    with running_server(tmp_path, [model_file], env=env) as server:
        ids = [api_score(server.url, p)["record_id"] for p in pictures]
        deadline = time.time() + 30
        while httpx.get(server.url + "/records/storage").json()["rows"] < len(ids):
            assert time.time() < deadline
            time.sleep(0.1)
        browser.get(server.url + "/")
        wait(browser, lambda d: not d.find_element(By.ID, "review").get_property("hidden"))
        wait(browser, lambda d: text(d, "server") == "1 model ready on replica press-a")  # which replica answers
        wait(browser, lambda d: text(d, "review-count") == "5 waiting")
        body = browser.find_element(By.TAG_NAME, "body")
        body.send_keys("v")
        newest_first = list(reversed(ids))
        for key, record in zip(("d", "n", "n"), newest_first, strict=False):
            wait(browser, lambda d, r=record: d.find_element(By.ID, "review-view").get_attribute("data-record") == r)
            wait(
                browser,
                lambda d: (d.find_element(By.ID, "review-heatmap").get_attribute("src") or "").startswith("blob:"),
            )
            if record == newest_first[0]:  # docs/images/console-review.png is this one
                browser.save_screenshot(str(ARTIFACTS / "console-review.png"))
            body.send_keys(key)
        wait(browser, lambda d: d.find_element(By.ID, "review-view").get_attribute("data-record") == newest_first[3])
        labels = [httpx.get(f"{server.url}/records/{r}").json()["label"] for r in newest_first]
        assert labels == ["defect", "normal", "normal", None, None]
        reviews = httpx.get(f"{server.url}/records/{newest_first[0]}").json()["reviews"]
        assert reviews[0]["reviewer"] == "console"
        body.send_keys(Keys.ESCAPE)
        wait(browser, lambda d: d.find_element(By.ID, "review-view").get_property("hidden"))
        wait(browser, lambda d: text(d, "review-count") == "2 waiting")


def test_the_lines_panel_shows_each_line_its_last_picture_and_a_sink_that_is_down(
    browser, model_file, dataset, tmp_path
):
    from helpers import free_port
    from selenium.webdriver.common.by import By

    (tmp_path / "in").mkdir()
    lines = tmp_path / "lines.yaml"
    down = free_port()  # nothing listens there: the webhook's verdicts wait in its outbox
    lines.write_text(
        "lines:\n  - name: press-3\n    source: {type: folder, path: in, settle_s: 0.2}\n"
        f"    sinks: [{{type: webhook, url: 'http://127.0.0.1:{down}/hook'}}]\n"
    )
    with running_server(tmp_path, [model_file], args=("--lines", str(lines))) as server:
        browser.get(server.url + "/")
        (tmp_path / "in" / "A-17.png").write_bytes((dataset / "test" / "hole" / "000.png").read_bytes())
        item = '#line-list [data-line="press-3"]'
        wait(browser, lambda d: "1 scored" in d.find_element(By.CSS_SELECTOR, item + " .line-counts").text)
        expected = httpx.get(server.url + "/lines/press-3").json()
        panel = browser.find_element(By.CSS_SELECTOR, item)
        assert panel.find_element(By.CSS_SELECTOR, ".line-state").text == "watching"
        assert panel.find_element(By.CSS_SELECTOR, ".line-last").text.startswith(
            f"last: {expected['last']['verdict']} (score {expected['last']['score']:.3f}), part A-17"
        )
        wait(
            browser, lambda d: "webhook: down, 1 waiting" in d.find_element(By.CSS_SELECTOR, item + " .line-sinks").text
        )
        wait(
            browser,
            lambda d: d.find_element(By.CSS_SELECTOR, item + " .line-picture").get_attribute("naturalWidth") != "0",
        )
        browser.execute_script("document.getElementById('lines').scrollIntoView()")
        browser.save_screenshot(str(ARTIFACTS / "console-lines.png"))
