"""Time from `shoal node` start to its record appearing in `shoal status`, on loopback.

    python benchmarks/join_latency.py --repeats 3

Starts a bootstrap peer, then one node at a time; for each, polls `shoal status --json` until the
node's record is listed. Writes benchmarks/results/join_latency.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from shoal.demo.launcher import LocalSwarm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/join_latency.json")
    args = parser.parse_args()
    samples, ready_samples = [], []
    with tempfile.TemporaryDirectory() as tmp:
        swarm = LocalSwarm(Path(tmp), log_level="WARNING")
        try:
            entry = swarm.start_bootstrap("--run-config", "shoal/runs/tiny.toml").maddrs[0]
            for _ in range(args.repeats):
                started = time.monotonic()
                node = swarm.start_node([entry], wait=False)
                swarm.wait_ready(node)
                ready_samples.append(time.monotonic() - started)
                while node.peer_id not in {n["peer_id"] for n in swarm.status(entry)["nodes"]}:
                    time.sleep(0.1)
                samples.append(time.monotonic() - started)
        finally:
            swarm.close()
    result = {
        "what": "seconds from `shoal node` process start to its record listed by `shoal status`",
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "max_s": max(samples),
        "samples_s": samples,
        "ready_file_median_s": statistics.median(ready_samples),
        "note": "includes Python + torch import, p2pd start, capacity measurement, 1-3 settle rounds; "
        "the status call itself (a client DHT join, ~2-3 s) is included",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
