"""The console in a real browser: Debian's Chromium (``/usr/bin/chromium``, installed by ``make test``),
driven by playwright, against one real ``serve.py --model tiny`` with the learner process and an A/B
experiment between two adapter versions.

The experiment's rewards are posted by hand, so the numbers the page must show are known from their
definition: arm ``fam@1`` gets rewards 1, 1, 0, 1 (n 4, mean 0.75, 95% t-interval 0.75 ± t(0.975, 3) ·
0.5 / 2) and ``fam@2`` gets 0, 1, 0 (n 3, mean 1/3, ± t(0.975, 2) · sqrt(1/3) / sqrt(3)). Screenshots of
every view go to the test's output folder (``LOOPWISE_CONSOLE_SHOTS`` to choose it).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

ADMIN = "console-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
REWARDS = {"fam@1": [1.0, 1.0, 0.0, 1.0], "fam@2": [0.0, 1.0, 0.0]}
T975 = {3: 3.182446305284263, 2: 4.302652729911275}  # Student t quantiles, df 3 and 2 (tables)
HOSTILE = "<img src=x onerror=\"document.title='pwned'\"> what is 2+2?"


def expected_ci(values: list[float]) -> tuple[float, float, float]:
    n = len(values)
    mean = sum(values) / n
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
    half = T975[n - 1] * sd / n**0.5
    return mean, mean - half, mean + half


def admin(server, method: str, path: str, **kw) -> httpx.Response:
    r = httpx.request(method, server.base_url + path, headers=AUTH, timeout=120, **kw)
    assert r.status_code < 400, (path, r.status_code, r.text)
    return r


@pytest.fixture(scope="module")
def loop(start_server, tmp_path_factory, tiny_model_path):
    """One server for every browser test: two versions of ``fam`` under an experiment, rewarded by hand, and a learner."""
    from tests.runtime.test_adapter_serving import make_adapter

    data = tmp_path_factory.mktemp("console-data")
    for k in (1, 2):
        make_adapter(tiny_model_path, data / "adapters" / f"fam-{k}", seed=70 + k)
    server = start_server("--admin-key", ADMIN, "--learner", "--learner-min-trajectories", "1000", data_dir=data)
    admin(server, "POST", "/admin/adapters", json={"path": str(data / "adapters" / "fam-1"), "family": "fam", "alias": True})
    admin(server, "POST", "/admin/adapters", json={"path": str(data / "adapters" / "fam-2"), "family": "fam"})
    exp = {"name": "fam-ab", "family": "fam", "arms": [{"adapter": "fam@1"}, {"adapter": "fam@2"}], "metric": "feedback", "min_samples": 3}
    admin(server, "POST", "/admin/experiments", json=exp)
    for adapter, rewards in REWARDS.items():
        for i, value in enumerate(rewards):
            body = {"model": adapter, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 4}
            r = httpx.post(server.url + "/chat/completions", json=body, headers={"X-Session-Id": f"s-{adapter}-{i}"}, timeout=60)
            assert r.status_code == 200, r.text
            fb = {"trajectory_id": r.json()["loopwise"]["trajectory_id"], "reward": value, "source": "feedback"}
            assert httpx.post(server.url + "/feedback", json=fb, timeout=30).status_code == 200
    hostile = {"model": "tiny", "messages": [{"role": "user", "content": HOSTILE}], "max_tokens": 3}
    r = httpx.post(server.url + "/chat/completions", json=hostile, timeout=60)
    assert r.status_code == 200

    # the learner process: wait for its status, then ask for an update (no samples: it says why it did not train);
    # two learners start (calc-lora and the chat learner) and either may write its status first
    def calc_learner() -> dict | None:
        return next((x for x in admin(server, "GET", "/admin/learner").json()["data"] if x["family"] == "calc-lora"), None)

    deadline = time.monotonic() + 120
    while calc_learner() is None:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.5)
    admin(server, "POST", "/admin/learner/update", json={"family": "calc-lora"})
    while not (calc_learner() or {}).get("history"):
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.5)
    return server


@pytest.fixture(scope="module")
def browser(chromium):
    return chromium


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    out = Path(os.environ["LOOPWISE_CONSOLE_SHOTS"]) if os.environ.get("LOOPWISE_CONSOLE_SHOTS") else tmp_path_factory.mktemp("console-shots")
    out.mkdir(parents=True, exist_ok=True)
    return out


class Page:
    """A browser tab on the console that records console errors, uncaught exceptions and admin API statuses."""

    def __init__(self, browser, server, **context) -> None:
        self.ctx = browser.new_context(viewport={"width": 1280, "height": 900}, **context)
        self.page = self.ctx.new_page()
        self.errors: list[str] = []
        self.statuses: list[tuple[str, int]] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("response", lambda r: self.statuses.append((r.url.split(server.base_url, 1)[-1], r.status)))
        self.server = server

    def open(self, key: str) -> None:
        self.page.goto(self.server.base_url + "/console")
        self.page.fill("#key", key)
        self.page.click("#login-form button[type=submit]")

    def view(self, name: str, ready: str) -> None:
        self.page.click(f'nav a[data-view="{name}"]')
        self.page.wait_for_selector(f"#view-{name} {ready}", timeout=30_000)

    def text(self, selector: str) -> str:
        return self.page.inner_text(selector).strip()


def test_console_shows_the_loop_without_errors(loop, browser, shots):
    tab = Page(browser, loop)
    page = tab.page
    tab.open(ADMIN)
    page.wait_for_selector('[data-testid=version-row][data-name="fam@2"]', timeout=30_000)
    assert tab.text('[data-testid=version-row][data-name="fam@1"] [data-col=aliases]') == "fam"
    assert tab.text('[data-testid=version-row][data-name="fam@2"] [data-col=aliases]') == "–"
    assert page.locator('[data-testid=version-row][data-name="base"]').count() == 1
    page.screenshot(path=str(shots / "overview.png"), full_page=True)

    tab.view("experiments", '[data-testid=arm-row][data-adapter="fam@2"]')
    api = {a["adapter"]: a for a in admin(loop, "GET", "/admin/experiments/fam-ab").json()["arms"]}
    for adapter, rewards in REWARDS.items():
        row = f'[data-testid=experiment][data-name="fam-ab"] [data-testid=arm-row][data-adapter="{adapter}"]'
        mean, low, high = expected_ci(rewards)
        assert tab.text(f"{row} [data-col=n]") == str(len(rewards))
        assert tab.text(f"{row} [data-col=mean]") == f"{mean:.3f}"
        assert tab.text(f"{row} [data-col=ci95]") == f"[{low:.3f}, {high:.3f}]"
        if adapter == "fam@2":  # the challenger's always-valid p-value, as the API computed it
            assert tab.text(f"{row} [data-col=p]") == f"{api[adapter]['msprt_p_value']:.4f}"
    assert page.locator('[data-testid=experiment][data-name="fam-ab"] svg.plot').count() == 2  # CI bars, p-value over time
    evidence = admin(loop, "GET", "/admin/experiments/fam-ab").json()["evidence"]
    assert (
        "rewards of source 'feedback'" in evidence and page.locator('[data-testid=experiment][data-name="fam-ab"]').inner_text().count(evidence) == 1
    )
    page.screenshot(path=str(shots / "experiments.png"), full_page=True)

    tab.view("learners", '[data-testid=learner][data-family="calc-lora"]')
    why = tab.text('[data-testid=learner][data-family="calc-lora"] [data-testid=learner-why]')
    assert "no optimizer step" in why and "gate: skipped" in why
    page.screenshot(path=str(shots / "learners.png"), full_page=True)

    tab.view("traffic", "[data-testid=traffic-adapters]")
    cols = {r.split("\t")[0]: r.split("\t") for r in tab.text("[data-testid=traffic-adapters] tbody").splitlines()}
    assert cols["fam@1"][1] == "4" and cols["fam@2"][1] == "3"  # chat requests per version in the last hour
    assert cols["fam@1"][4] == "–"  # none of them failed
    page.screenshot(path=str(shots / "traffic.png"), full_page=True)

    tab.view("trajectories", "[data-testid=trajectory-row]")
    cells = "[...document.querySelectorAll('[data-testid=trajectory-row] [data-col=rewards]')]"
    rewards_shown = f"() => {cells}.some(td => td.textContent.includes('feedback'))"
    page.wait_for_function(rewards_shown)
    page.screenshot(path=str(shots / "trajectories.png"), full_page=True)
    newest = page.locator("[data-testid=trajectory-row]").first
    trajectory_id = newest.get_attribute("data-id")
    newest.click()
    page.wait_for_selector("#trajectory [data-testid=turn]")
    assert HOSTILE in tab.text("#trajectory-body")  # a recorded message is shown as text, never run as HTML
    assert page.locator("#trajectory-body img").count() == 0 and page.title() != "pwned"
    page.fill("#trajectory form [name=reward]", "0.25")
    page.fill("#trajectory form [name=comment]", "from the console test")
    page.click("#trajectory form button[type=submit]")
    page.wait_for_selector(".toast.ok")
    stored = admin(loop, "GET", f"/admin/trajectories/{trajectory_id}").json()["rewards"]
    assert [(r["value"], r["comment"]) for r in stored] == [(0.25, "from the console test")]
    page.screenshot(path=str(shots / "trajectory.png"), full_page=True)
    page.click("#trajectory-close")

    page.set_viewport_size({"width": 390, "height": 844})  # a phone
    tab.view("overview", '[data-testid=version-row][data-name="fam@1"]')
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than the screen: tables scroll inside
    page.screenshot(path=str(shots / "overview-narrow.png"), full_page=True)
    assert tab.errors == []
    assert all(status < 400 for path, status in tab.statuses if path.startswith(("/admin", "/console", "/v1"))), tab.statuses
    tab.ctx.close()


def test_promote_click_changes_the_alias(loop, browser, shots):
    tab = Page(browser, loop)
    page = tab.page
    tab.open(ADMIN)
    tab.view("experiments", '[data-testid=arm-row][data-adapter="fam@2"] [data-testid=promote]')
    page.click('[data-testid=arm-row][data-adapter="fam@2"] [data-testid=promote]')
    page.wait_for_selector("#confirm[open]")
    assert "fam@2" in tab.text("#confirm-text")
    assert admin(loop, "GET", "/admin/adapters").json()["aliases"]["fam"] == "fam@1"  # nothing happens before the confirmation
    page.screenshot(path=str(shots / "confirm.png"))
    page.click("#confirm-ok")
    page.wait_for_selector(".toast.ok")
    assert admin(loop, "GET", "/admin/adapters").json()["aliases"]["fam"] == "fam@2"
    assert admin(loop, "GET", "/admin/experiments/fam-ab").json()["status"] == "promoted"
    page.wait_for_selector('[data-testid=experiment][data-name="fam-ab"] .badge.promoted')
    assert tab.errors == []
    tab.ctx.close()


def test_a_wrong_admin_key_gets_no_data(loop, browser, shots):
    tab = Page(browser, loop)
    page = tab.page
    tab.open("not-the-key")
    page.wait_for_function("() => document.querySelector('#login-error').textContent.length > 0")
    assert "not accepted" in tab.text("#login-error")
    assert page.locator("[data-testid=version-row]").count() == 0 and page.is_hidden("#app")
    assert page.evaluate("sessionStorage.getItem('loopwise.adminKey')") is None
    admin_calls = [(p, s) for p, s in tab.statuses if p.startswith("/admin")]
    assert admin_calls and all(s == 401 for _, s in admin_calls), admin_calls
    page.screenshot(path=str(shots / "wrong-key.png"))
    tab.ctx.close()
    # the same through the URL form serve.py prints (#key=...), in a fresh tab: refused, and the key leaves the address bar
    tab = Page(browser, loop)
    tab.page.goto(loop.base_url + "/console#key=also-wrong")
    tab.page.wait_for_function("() => document.querySelector('#login-error').textContent.length > 0")
    assert "also-wrong" not in tab.page.url and tab.page.locator("[data-testid=version-row]").count() == 0
    tab.ctx.close()


def test_console_files_are_served_with_a_strict_content_security_policy(loop):
    for path in ("/console", "/console/console.js", "/console/charts.js", "/console/console.css"):
        r = httpx.get(loop.base_url + path, timeout=10)
        assert r.status_code == 200 and "script-src 'self'" in r.headers["content-security-policy"], path
    assert httpx.get(loop.base_url + "/console/..%2Fconsole.py", timeout=10).status_code == 404
    assert httpx.get(loop.base_url + "/console/index.htm", timeout=10).status_code == 404
    assert json.loads(httpx.get(loop.base_url + "/admin/adapters", timeout=10).text)["error"]["code"] == "invalid_admin_key"
