"""The container image, built and run: deploy/container-check.py builds the Dockerfile with podman and
trains the bundled run in a swarm of its containers (a bootstrap peer and a node per stage), with the
health check, a restart that keeps the peer id and resumes, and the image's size (docs/deploy.md).

Marked `container`: it takes minutes and a container engine, so `make test` leaves it out; run it with
`pytest -m container -n 0 tests/test_container_image.py -s`. It installs podman from Debian's packages
when it is missing and we are root, and skips the test, saying why, when it cannot."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "deploy" / "container-check.py"
NOT_INSTALLABLE = 77  # the script's exit status when podman is missing and cannot be installed


@pytest.mark.container
@pytest.mark.timeout(3600)
def test_the_image_builds_and_its_containers_train_a_swarm_that_survives_a_restart(tmp_path):
    if shutil.which("podman") is None and (os.geteuid() != 0 or shutil.which("apt-get") is None):
        pytest.skip("podman is not installed and cannot be installed here (needs root and apt-get)")
    env = {**os.environ, "BUILD_LOG": str(tmp_path / "build.log")}
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=3500)
    if result.returncode == NOT_INSTALLABLE:
        pytest.skip(result.stderr.strip())
    print(result.stdout)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-2000:]}"
    summary = result.stdout.split("container-check summary", 1)[1]
    assert "(same)" in summary and "(resumed)" in summary and "NOT healthy" not in summary
