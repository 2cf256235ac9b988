#!/usr/bin/env python3
"""Build shoal's image with podman and train the bundled run in a swarm of its containers.

    sudo deploy/container-check.py          # from the repository root; prints a summary, exit 0 if all held

What it does, each step checked:
  1. installs podman and what it needs from Debian's packages (apt-get) if podman is missing;
  2. makes the base image from Debian's packages (deploy/make-base) unless BASE names another
     (BASE=python:3.11-slim, the Dockerfile's public default, where a registry is reachable);
  3. serves the torch wheel of WHEELS (/opt/wheels) as a package index on loopback and builds the
     image with it as TORCH_INDEX (without such a wheel: the Dockerfile's default, PyTorch's CPU index);
     it reports the build time and the image's size;
  4. on an internal podman network (no route out of this machine): a bootstrap peer publishing `tiny`,
     then the three nodes that run's three stages need (a data node and a worker on each block stage);
  5. waits for training steps, runs the image's health check until a worker is healthy, restarts the
     data node's container mid-run and checks that it keeps its peer id and goes on from its saved step,
     waits for the run's last step, checks every node's health, and prints `shoal status`;
  6. removes its containers, volumes and network (KEEP=1 leaves them).

Settings (environment): BASE, WHEELS, TORCH_INDEX (skips the local index), IMAGE (localhost/shoal:check),
NO_CACHE=1 (build every layer), SUBNET (10.89.55.0/24), RESTART_AT (the data node's step to restart at,
60), TIMEOUT_S (900, for each wait of the run), KEEP. One line on stderr and a non-zero exit on the first
failure; exit 77 when podman is missing and cannot be installed (not root, or no apt-get).
Podman settings that this machine needed are in deploy/containers.conf (passed as CONTAINERS_CONF).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
NAME = "shoal-check"
IMAGE = os.environ.get("IMAGE", "localhost/shoal:check")
LOCAL_BASE = "localhost/shoal-base:bookworm"
BASE = os.environ.get("BASE", LOCAL_BASE)
WHEELS = Path(os.environ.get("WHEELS", "/opt/wheels"))
SUBNET = os.environ.get("SUBNET", "10.89.55.0/24")
RESTART_AT = int(os.environ.get("RESTART_AT", "60"))
TIMEOUT_S = float(os.environ.get("TIMEOUT_S", "900"))
KEEP = os.environ.get("KEEP") == "1"
RUN = "tiny"
PORT = 31337
# Debian packages: podman and the network stack it drives (netavark calls iptables), runc (see
# containers.conf), debootstrap for the base image
PACKAGES = ["podman", "runc", "crun", "netavark", "aardvark-dns", "iptables", "uidmap", "slirp4netns",
            "fuse-overlayfs", "debootstrap"]  # fmt: skip
# the containers: the bootstrap peer, then one node per stage of `tiny` (3 stages)
NODES = {
    "data": ["--role", "data", "--progress-file", "/data/progress.jsonl", "--save-every-s", "10"],
    "w1": ["--role", "worker", "--stage", "1"],
    "w2": ["--role", "worker", "--stage", "2"],
}
CONTAINERS = ["boot", *NODES]
SAVED = re.compile(r"resumed stage (\d+) from /data/state \(inner step (\d+),")
ACTIVE = re.compile(r"^node (\w+) active: data on stage 0", re.M)

os.environ["CONTAINERS_CONF"] = os.environ.get("CONTAINERS_CONF", str(HERE / "containers.conf"))
started = time.monotonic()


class Failed(Exception):
    pass


def say(msg: str) -> None:
    print(f"[{time.monotonic() - started:6.0f} s] {msg}", flush=True)


def sh(*args: str, check: bool = True, quiet: bool = False, timeout: float | None = None) -> str:
    """Run a command; its stdout (stripped). A failure raises Failed with its last stderr line."""
    p = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    # podman says on every start of a container with a health check that it could not reach systemd
    # (no systemd here, so no health check timers): noise, since the checks are run by hand below
    err = "\n".join(line for line in p.stderr.splitlines() if "systemd" not in line)
    if check and p.returncode != 0:
        last = err.strip().splitlines()[-1] if err.strip() else f"exit status {p.returncode}"
        raise Failed(f"`{' '.join(args[:4])} ...` failed: {last}")
    if err.strip() and not quiet:
        print(err, file=sys.stderr)
    return p.stdout.strip()


def ulimits() -> list[str]:
    """--ulimit flags within this machine's limits: podman as root gives a container 1048576 open files
    and 32768 processes, and raising a limit above the hard one needs CAP_SYS_RESOURCE (a sandboxed root
    may lack it). Open files: the hard limit (at most 65536). Processes: at most 16384 (32768 and 65536
    failed on the machine this was tested on although its hard limit was 96367; 16384 and 20000 worked)."""
    import resource

    def cap(kind: int, most: int) -> int:
        hard = resource.getrlimit(kind)[1]
        return most if hard == resource.RLIM_INFINITY else min(hard, most)

    nofile, nproc = cap(resource.RLIMIT_NOFILE, 65536), cap(resource.RLIMIT_NPROC, 16384)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def ensure_podman() -> None:
    missing = [tool for tool in ("podman", "runc", "iptables") if shutil.which(tool) is None]
    if BASE == LOCAL_BASE and shutil.which("debootstrap") is None:
        missing.append("debootstrap")
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        print(f"container-check: {', '.join(missing)} missing and not installable here (needs root and apt-get)",
              file=sys.stderr)  # fmt: skip
        sys.exit(77)
    say(f"installing {' '.join(PACKAGES)} with apt-get ({', '.join(missing)} missing)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", *PACKAGES]):
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if p.returncode != 0:
            raise Failed(f"{' '.join(cmd[:2])} failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")


def ensure_base() -> None:
    if BASE != LOCAL_BASE or subprocess.run(["podman", "image", "exists", BASE]).returncode == 0:
        return
    say(f"making {BASE} from Debian's packages (deploy/make-base)")
    t = time.monotonic()
    sh(str(HERE / "make-base"), BASE, quiet=True)
    say(f"base made in {time.monotonic() - t:.0f} s")


def torch_index() -> tuple[str | None, subprocess.Popen | None]:
    """The TORCH_INDEX build argument, and the local index server to stop after the build (if any)."""
    if "TORCH_INDEX" in os.environ:
        return os.environ["TORCH_INDEX"], None
    if not list(WHEELS.glob("torch-*+cpu-*.whl")):
        return None, None  # the Dockerfile's default
    server = subprocess.Popen([sys.executable, str(HERE / "wheel-index.py"), str(WHEELS)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    line = server.stdout.readline().strip() if server.stdout else ""
    if not line.startswith("http://"):
        server.kill()
        raise Failed(f"the local wheel index did not start: {line or 'no output'}")
    return line.split()[0], server


def build() -> tuple[float, int]:
    """Build IMAGE; (seconds, size in bytes)."""
    index, server = torch_index()
    args = ["podman", "build", "--format", "docker", "--network", "host", *ulimits(), "--build-arg", f"BASE={BASE}"]
    if os.environ.get("NO_CACHE") == "1":
        args.append("--no-cache")
    if index:
        args += ["--build-arg", f"TORCH_INDEX={index}"]
    # The build's pip talks to PyPI over HTTPS; where a proxy re-signs TLS with a CA of its own, only the
    # host's trust store knows that CA. Debian's pip reads the system bundle, so it is lent to the build's
    # RUN steps (a mount: it is not part of the image).
    host_ca = Path("/etc/ssl/certs/ca-certificates.crt")
    if BASE == LOCAL_BASE and host_ca.exists():
        args += ["--volume", f"{host_ca}:{host_ca}:ro"]
    say(f"building {IMAGE} from {BASE}, torch from {index or 'the Dockerfile default index'}")
    t = time.monotonic()
    try:
        p = subprocess.run([*args, "-t", IMAGE, str(REPO)], capture_output=True, text=True)
    finally:
        if server is not None:
            server.kill()
            server.wait()
    seconds = time.monotonic() - t
    log = Path(os.environ.get("BUILD_LOG", "/tmp/shoal-container-build.log"))
    log.write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise Failed(f"the build failed after {seconds:.0f} s (log: {log}): {p.stderr.strip().splitlines()[-1]}")
    for line in p.stdout.splitlines():
        if line.startswith(("torch ", "No broken requirements")):
            say(f"build: {line}")
    size = int(sh("podman", "image", "inspect", "--format", "{{.Size}}", IMAGE))
    return seconds, size


def run_steps() -> int:
    import tomllib

    return tomllib.loads((REPO / "shoal" / "runs" / f"{RUN}.toml").read_text())["train"]["steps"]


def container(role: str) -> str:
    return f"{NAME}-{role}"


def ip(role: str) -> str:
    prefix = SUBNET.split("/")[0].rsplit(".", 1)[0]
    return f"{prefix}.{10 + CONTAINERS.index(role)}"


def volume_file(role: str, name: str) -> Path:
    return Path(sh("podman", "volume", "inspect", "--format", "{{.Mountpoint}}", container(role))) / name


def wait_for(what: str, probe, timeout_s: float, every_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        for role in CONTAINERS:  # a container that died is a failure now, not a timeout later
            state = sh("podman", "inspect", "--format", "{{.State.Status}}", container(role), check=False, quiet=True)
            if state and state != "running":
                tail = sh("podman", "logs", "--tail", "5", container(role), check=False, quiet=True)
                raise Failed(f"{container(role)} is {state} while waiting for {what}; its log ends: {tail[-400:]}")
        time.sleep(every_s)
    raise Failed(f"timed out after {timeout_s:.0f} s waiting for {what}")


def progress() -> list[dict]:
    path = volume_file("data", "progress.jsonl")
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_since_start(events: list[dict]) -> list[dict]:
    """The step lines after the last `start` line (the old process may write a step after we looked)."""
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    return [e for e in events[starts[-1] :] if e["event"] == "step"] if starts else []


def steps_done() -> int:
    return max((e["step"] + 1 for e in progress() if e["event"] == "step"), default=0)


def ready(role: str) -> dict:
    path = volume_file(role, "ready.json")
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError:
        return {}  # being written


def log(role: str) -> str:
    """The container's log, stdout and stderr in the order written (both runs of a restarted container)."""
    p = subprocess.run(["podman", "logs", container(role)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p.stdout


def healthy(role: str) -> bool:
    """The image's HEALTHCHECK, run now: exit status 0 is healthy (podman 4.3 prints nothing then). Podman
    runs health checks on systemd timers, and there is no systemd here: the containers start with
    --health-interval disable (no timer, and no error about systemd), and the checks are run by hand."""
    return subprocess.run(["podman", "healthcheck", "run", container(role)], capture_output=True).returncode == 0


def start(role: str, args: list[str], entrypoint: bool = False) -> None:
    run = ["podman", "run", "-d", "--name", container(role), "--network", NAME, "--ip", ip(role), *ulimits(),
           "-v", f"{container(role)}:/data", "--health-interval", "disable"]  # fmt: skip
    if entrypoint:
        run += ["--no-healthcheck", "--entrypoint", "shoal"]
    sh(*run, IMAGE, *args, quiet=True)


def cleanup() -> None:
    if KEEP:
        say(f"KEEP=1: left {', '.join(container(r) for r in CONTAINERS)}, their volumes and network {NAME}")
        return
    for role in CONTAINERS:
        subprocess.run(["podman", "rm", "-f", "-t", "10", container(role)], capture_output=True)
        subprocess.run(["podman", "volume", "rm", "-f", container(role)], capture_output=True)
    subprocess.run(["podman", "network", "rm", "-f", NAME], capture_output=True)


def swarm() -> dict:
    """Run the swarm; what the summary reports."""
    found = {}
    cleanup()  # what a killed earlier run left
    # --internal: no route off this machine; the containers reach each other by address
    sh("podman", "network", "create", "--internal", "--subnet", SUBNET, NAME, quiet=True)
    start("boot", ["--log-level", "INFO", "bootstrap", "--identity", "/data/bootstrap.id", "--host-maddrs",
                   f"/ip4/0.0.0.0/tcp/{PORT}", "--announce-maddrs", f"/ip4/{ip('boot')}/tcp/{PORT}", "--run-config",
                   RUN], entrypoint=True)  # fmt: skip
    entry = wait_for("the bootstrap peer's address", lambda: re.search(r"^/ip4/\S+/p2p/\S+", log("boot"), re.M), 180)
    entry = entry.group(0)
    say(f"bootstrap peer {container('boot')} at {entry}")
    for role, extra in NODES.items():
        start(role, ["--initial-peers", entry, "--announce-maddrs", f"/ip4/{ip(role)}/tcp/{PORT}", "--threads", "1",
                     *extra])  # fmt: skip
    t = time.monotonic()
    wait_for("three active nodes", lambda: all(ready(r) for r in NODES), 300)
    placed = ", ".join(f"{container(r)}: {ready(r)['role']} on stage {ready(r)['stage']}" for r in NODES)
    say(f"active: {placed}")
    wait_for("the first training steps", lambda: steps_done() >= 5, 300)
    say(f"training: step {steps_done()}, loss {progress()[-1].get('loss')}")

    t_health = time.monotonic()
    wait_for(f"{container('w1')} to be healthy", lambda: healthy("w1"), 300, every_s=5)
    found["healthy_s"] = time.monotonic() - t_health
    found["health_status"] = sh("podman", "inspect", "--format", "{{.State.Health.Status}}", container("w1"))
    say(f"{container('w1')}: health check says {found['health_status']} ({found['healthy_s']:.0f} s of checks)")

    # the restart: SIGTERM (the node announces leaving and saves its state), then the same container again
    wait_for(f"step {RESTART_AT}", lambda: steps_done() >= RESTART_AT, TIMEOUT_S)
    found["peer_before"] = ACTIVE.search(log("data")).group(1)
    if ready("data").get("peer_id") != found["peer_before"]:
        raise Failed(f"the ready file names {ready('data').get('peer_id')}, the log {found['peer_before']}")
    before_lines = len(progress())
    found["step_at_restart"] = steps_done()
    say(f"restarting {container('data')} after {found['step_at_restart']} steps (peer {found['peer_before']})")
    sh("podman", "restart", "-t", "60", container("data"), quiet=True)
    resumed = wait_for("the data node to resume", lambda: SAVED.search(log("data")), 300)
    found["resumed_stage"], found["resumed_step"] = int(resumed.group(1)), int(resumed.group(2))
    # the log holds both runs of the container: its peer id as the one after the resume says it
    again = wait_for("the data node to be active again",
                     lambda: ACTIVE.search(log("data").split("resumed stage")[-1]), 120)  # fmt: skip
    found["peer_after"] = again.group(1)
    if ready("data").get("peer_id") != found["peer_after"]:
        raise Failed(f"the ready file names {ready('data').get('peer_id')}, the log {found['peer_after']}")
    after = wait_for("a step after the restart", lambda: steps_since_start(progress()[before_lines:]), 300)
    found["first_step_after"] = after[0]["step"]
    say(f"{container('data')} back as {found['peer_after']}, resumed from its saved step {found['resumed_step']}; "
        f"its next step: {found['first_step_after']}")  # fmt: skip

    done = wait_for("the run's last step", lambda: next((e for e in progress() if e["event"] == "done"), None),
                    TIMEOUT_S, every_s=5)  # fmt: skip
    found["train_s"] = time.monotonic() - t
    steps = [e for e in progress() if e["event"] == "step"]
    found["steps"] = steps_done()
    found["step_events"] = len(steps)
    found["loss_first"], found["loss_last"] = steps[0]["loss"], steps[-1]["loss"]
    found["val_loss"] = done.get("val_loss")
    found["abandoned"] = done.get("microbatches_abandoned")
    found["health"] = {role: healthy(role) for role in NODES}
    found["status"] = sh("podman", "exec", "-e", "COLUMNS=150", container("w1"), "shoal", "status",
                         "--initial-peers", entry, quiet=True)  # fmt: skip
    return found


def interrupted(signum, frame):
    raise KeyboardInterrupt  # SIGTERM too: the containers are removed on the way out


def main() -> int:
    signal.signal(signal.SIGTERM, interrupted)
    try:
        ensure_podman()
        say(f"{sh('podman', '--version')}, runtime {sh('podman', 'info', '--format', '{{.Host.OCIRuntime.Name}}')}")
        ensure_base()
        build_s, size = build()
        say(f"built {IMAGE} in {build_s:.0f} s: {size / 1e9:.2f} GB ({size:,} bytes)")
        try:
            found = swarm()
        finally:
            cleanup()
    except Failed as e:
        print(f"container-check FAILED: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("container-check: interrupted", file=sys.stderr)
        return 130

    print(found.pop("status"))
    health = ", ".join(f"{container(r)} {'healthy' if ok else 'NOT healthy'}" for r, ok in found["health"].items())
    same = found["peer_before"] == found["peer_after"]
    resumed = found["resumed_stage"] == 0 and found["first_step_after"] == found["resumed_step"] > 0
    ok = same and resumed and all(found["health"].values()) and found["steps"] == run_steps()
    nodes = ", ".join(container(r) for r in NODES)
    f = found
    rows = [
        ("image", f"{IMAGE} from {BASE}: {size / 1e9:.2f} GB ({size:,} bytes), built in {build_s:.0f} s"),
        ("swarm", f"{container('boot')} (bootstrap peer, run {RUN}) + {nodes} on podman network {NAME}"),
        ("training", f"{f['steps']} steps in {f['train_s']:.0f} s ({f['step_events'] - f['steps']} trained again "
                     f"after the restart), microbatches abandoned: {f['abandoned']}"),
        ("loss", f"step 0 {f['loss_first']:.3f}, last step {f['loss_last']:.3f}, validation {f['val_loss']:.3f}"),
        ("health check", f"{container('w1')} {f['health_status']} after {f['healthy_s']:.0f} s of checks"),
        ("at the end", health),
        ("restart", f"{container('data')} after {f['step_at_restart']} steps: peer id {f['peer_before']} -> "
                    f"{f['peer_after']} ({'same' if same else 'CHANGED'})"),
        ("resumed", f"from its saved state at step {f['resumed_step']}, next step trained: {f['first_step_after']} "
                    f"({'resumed' if resumed else 'NOT resumed'})"),
        ("total", f"{time.monotonic() - started:.0f} s"),
    ]  # fmt: skip
    print("\ncontainer-check summary")
    for key, value in rows:
        print(f"  {key:<13} {value}")
    if not ok:
        print("container-check FAILED: see the summary above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
