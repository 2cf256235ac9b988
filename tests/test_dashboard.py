"""`shoal dashboard` against a real local swarm: its JSON, then its page in headless Chromium.

Chromium is Debian's `chromium` package; the session fixture installs it with apt-get when it is
missing and we are root (about a minute here), and skips the test, saying why, when it cannot.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers.processes import wait_until
from tests.helpers.tiny import write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600)]

TTL = "6"  # seconds: records re-announced every 2 s, a killed node gone within the test
SERIES_RGB = (214, 39, 40)  # #d62728: the first series on the page's plots, and nothing else there
APT_TIMEOUT_S = 420


@pytest.fixture(scope="session")
def chromium() -> str:
    """A Chromium that runs headless: found, or installed with apt-get (root only)."""
    found = shutil.which("chromium")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("chromium is not installed and cannot be installed here (needs root and apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=APT_TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired:
            pytest.skip(f"`{' '.join(command)}` took over {APT_TIMEOUT_S} s: chromium could not be installed")
        if result.returncode != 0:
            pytest.skip(f"`{' '.join(command)}` failed ({result.returncode}): {result.stderr.strip()[-400:]}")
    found = shutil.which("chromium")
    if not found:
        pytest.skip("apt-get installed chromium but no `chromium` is on PATH")
    return found


def browse(chromium: str, url: str, profile: Path, *action: str, timeout_s: float = 120.0) -> str:
    """Load `url` in headless Chromium (8 s of page time: a few polls of /api/state); returns stdout.
    Chromium runs in a process group of its own, ended by that id if it overstays."""
    command = [
        chromium,
        "--headless",
        "--no-sandbox",  # we run as root
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        f"--user-data-dir={profile}",
        "--window-size=1200,900",
        "--virtual-time-budget=8000",
        *action,
        url,
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    assert process.returncode == 0, f"chromium exited with {process.returncode}: {err[-2000:]}"
    return out


def api_state(url: str) -> dict:
    with urllib.request.urlopen(url + "api/state", timeout=10) as response:
        return json.loads(response.read())


def live_by_stage(state: dict) -> dict[int, list[str]]:
    return {s["stage"]: [r["peer_id"] for r in s["replicas"] if r["state"] != "leaving"] for s in state["stages"]}


def test_dashboard_shows_a_live_swarm_in_a_browser(swarm, tmp_path, chromium):
    run_file = write_tiny_run(tmp_path, **{"train.steps": 5000})  # still training when the test ends
    bootstrap = swarm.start_bootstrap("--run-config", str(run_file))
    entry = bootstrap.maddrs[0]
    nodes = [swarm.start_node([entry], "--record-ttl", TTL, wait=False) for _ in range(3)]
    for node in nodes:
        swarm.wait_ready(node)
    dashboard, url = swarm.start_dashboard(entry, "--interval-s", "1")
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", url), url

    def training() -> dict | None:
        state = api_state(url)
        covered = all(len(peers) == 1 for peers in live_by_stage(state).values())
        return state if covered and len(state["loss"]) >= 2 and state["throughput"] else None

    state = wait_until(training, 150, "the dashboard to show 3 stages, a loss curve and a throughput", 1.0)
    assert state["run"]["name"] == "test-tiny" and state["needs"]["ready"], state["needs"]
    assert {p for peers in live_by_stage(state).values() for p in peers} == {n.peer_id for n in nodes}
    data = next(n for n in nodes if n.stage == 0)
    assert {s["peer_id"] for s in state["loss"]} == {data.peer_id}
    assert all(math.isfinite(s["value"]) and 0 < s["value"] < 20 for s in state["loss"])
    assert all(s["value"] > 0 for s in state["throughput"])  # tokens per second
    assert [e["kind"] for e in state["events"]][-1] == "view"  # the first view, oldest

    # The page, as a browser draws it: both plots hold the data node's series (its colour).
    png = tmp_path / "dashboard.png"
    browse(chromium, url, tmp_path / "profile", f"--screenshot={png}")
    with Image.open(png) as image:
        pixels = np.asarray(image.convert("RGB"), dtype=np.int32)  # (H, W, 3)
    assert pixels.shape == (900, 1200, 3)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50, "the screenshot is nearly uniform"
    drawn = int((np.abs(pixels - np.array(SERIES_RGB)).sum(axis=-1) < 30).sum())
    assert drawn > 300, f"only {drawn} pixels of the plotted series' colour: {png}"

    # A crash: the dashboard tells it once the record expires, and the page lists it.
    (victim,) = [n for n in nodes if n.peer_id in live_by_stage(state)[2]]
    killed_at = time.time()  # DHT time is wall-clock time
    swarm.kill(victim)

    def lost() -> dict | None:
        state = api_state(url)
        kinds = {(e["kind"], e["peer_id"] or e["stage"]) for e in state["events"] if e["at"] >= killed_at}
        return state if {("lost", victim.peer_id), ("uncovered", 2)} <= kinds else None

    state = wait_until(lost, 60, "the dashboard to report the crash", 1.0)
    assert live_by_stage(state)[2] == [] and not state["needs"]["ready"]

    def page_shows_the_crash() -> str | None:
        # a loaded machine can let a live node's record lapse for a poll: render again then
        dom = browse(chromium, url, tmp_path / "profile", "--dump-dom")
        survivors = all(n.peer_id in dom for n in nodes if n is not victim)
        return dom if survivors and f"…{victim.peer_id[-8:]} lost from stage 2" in dom else None

    dom = wait_until(page_shows_the_crash, 120, "the page to show the survivors and the crash", 1.0)
    assert victim.peer_id not in dom  # its card is gone; events name peers by their short id
    assert "stage 2 has no live replica" in dom
    losses = [float(x) for x in re.findall(r'data-loss="([^"]+)"', dom)]
    assert len(losses) == 1 and math.isfinite(losses[0]), losses
    assert dashboard.alive and "Traceback" not in dashboard.log()
