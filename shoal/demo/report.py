"""The demo's report: what the data node measured, every node's counters, and the loss plot."""

from __future__ import annotations

import json
from pathlib import Path

from shoal.config import RunConfig
from shoal.demo.launcher import LocalSwarm
from shoal.report import write_report
from shoal.train.repair import steps_to_recover


def _node_row(peer, stats_path: Path) -> dict:
    peer.refresh()  # a node started without waiting (a replacement) has not been read yet
    row = {
        "name": peer.name,
        "peer_id": peer.peer_id,
        "role": peer.role,
        "stage": peer.stage,
        "exit_code": peer.process.returncode,
    }
    if stats_path.exists():
        stats = json.loads(stats_path.read_text())
        engine, traffic = stats.get("engine", {}), stats.get("traffic", {})
        row.update(
            {
                "state": "stopped",
                "inner_steps": stats.get("inner_step"),
                "forwards": engine.get("forwards"),
                "backwards": engine.get("backwards"),
                "bytes_sent": traffic.get("bytes_sent"),
                "bytes_received": traffic.get("bytes_received"),
                "wire_bytes": stats.get("wire_bytes"),
                "peak_rss_mb": round(stats.get("peak_rss_bytes", 0) / 2**20, 1),
                "start_rss_mb": round(stats.get("start_rss_bytes", 0) / 2**20, 1),
                "averaging": engine.get("averaging"),
            }
        )
    else:
        row["state"] = "crashed" if peer.process.returncode not in (0, None) else "unknown"
    return row


def averaging_summary(run: RunConfig, nodes: list[dict]) -> dict:
    """Per block stage: outer steps taken (pairs and local) and each replica's distance to its partner
    before every pair update, as [[inner step, distance], ...]."""
    stages: dict[int, dict] = {}
    for row in nodes:
        averaging = row.get("averaging") or {}
        if row.get("stage") in (None, 0) or averaging.get("mode") != "noloco":
            continue
        stage = stages.setdefault(row["stage"], {"outer_steps": 0, "local_steps": 0, "replica_distance": []})
        stage["outer_steps"] += averaging.get("pair_steps", 0) + averaging.get("local_steps", 0)
        stage["local_steps"] += averaging.get("local_steps", 0)
        stage["replica_distance"] += averaging.get("replica_distance", [])
    for stage in stages.values():
        stage["replica_distance"].sort()
    return {"mode": run.averaging.mode, "stages": {str(s): v for s, v in sorted(stages.items())}}


def repair_summary(events: list[dict], wipe: dict | None) -> list[dict]:
    """Each stage repair the data node saw: its rule, how long it took, and the loss around it.

    loss_before is the mean loss of the 3 steps before the stage was wiped (or before the repair, if
    the demo did not wipe it), loss_after the loss of the first step after the repair, and
    steps_to_recover the steps from the repair until the loss is back under loss_before (None: never).
    Where the run evaluates after every step (train.eval_every 1), val_before, val_after and
    val_steps_to_recover say the same of the validation loss, which has no batch-to-batch noise."""
    steps = [e for e in events if e["event"] == "step"]
    losses = {e["step"]: e["loss"] for e in steps if e["loss"] is not None}
    val = {e["step"]: e["val_loss"] for e in steps if e.get("val_loss") is not None}  # train.eval_every
    rows = []
    for event in (e for e in events if e["event"] == "repair"):
        wiped_at = wipe["step"] if wipe and wipe.get("stage") == event["stage"] else event["step"]
        before = [losses[s] for s in range(wiped_at - 3, wiped_at) if s in losses]
        loss_before = sum(before) / len(before) if before else None
        after = sorted(s for s in losses if s >= event["step"])
        first = event["inner_step"]  # the first step the rebuilt stage trains
        val_before = val.get(first - 1)  # after the last step the lost stage trained
        validation = {}
        if val_before is not None:
            validation = {
                "val_before": val_before,
                "val_after": val.get(first),
                "val_steps_to_recover": steps_to_recover(val, val_before, first),
            }
        rows.append(
            {
                "stage": event["stage"],
                "step": event["step"],
                "rule": event["rule"],
                "sources": event["sources"],
                "seconds": event["seconds"],
                "note": event["note"],
                "loss_before": loss_before,
                "loss_after": losses[after[0]] if after else None,
                "steps_to_recover": None
                if loss_before is None
                else steps_to_recover(losses, loss_before, event["step"]),
                **validation,
            }
        )
    return rows


def wire_per_token(nodes: list[dict], tokens: int) -> dict[str, float]:
    """Bytes every node sent, by kind (activation, gradient, outer, copy, control), per trained token."""
    totals: dict[str, int] = {}
    for node in nodes:
        for kind, nbytes in (node.get("wire_bytes") or {}).items():
            totals[kind] = totals.get(kind, 0) + nbytes
    return {kind: round(nbytes / tokens, 1) for kind, nbytes in totals.items()} if tokens else {}


def build_report(
    directory: Path,
    run: RunConfig,
    events: list[dict],
    swarm: LocalSwarm,
    workdir: Path,
    crash: dict,
    wall_s: float,
    wipe: dict | None = None,
    restarts: list[dict] | None = None,
    replicas_at_end: dict[str, int] | None = None,
) -> Path:
    steps = [e for e in events if e["event"] == "step"]
    done = next((e for e in events if e["event"] == "done"), {})
    stats_files = {
        p.name: workdir / (f"stats-{'data' if p.name == 'data' else 'w' + p.name[6:]}.json")
        for p in swarm.peers
        if p.name != "bootstrap"
    }
    report = {
        "mode": "swarm",
        "run": run.name,
        "run_id": run.run_id,
        "steps": len(steps),
        "initial_loss": done.get("initial_loss"),
        "final_loss": done.get("final_loss"),
        "val_loss": done.get("val_loss"),
        "tokens_per_s": done.get("tokens_per_s"),
        "wall_s": wall_s,
        "microbatches_injected": done.get("microbatches_injected"),
        "microbatches_completed": done.get("microbatches_completed"),
        "microbatches_abandoned": done.get("microbatches_abandoned"),
        "abandoned_reasons": done.get("abandoned_reasons", {}),
        "crash": crash or None,
        "wipe": wipe or None,
        "restarts": restarts or [],
        "replicas_at_end": replicas_at_end or {},
        "repairs": repair_summary(events, wipe),
        "nodes": [_node_row(p, stats_files[p.name]) for p in swarm.peers if p.name != "bootstrap"],
        "losses": [e["loss"] for e in steps],
        "val_losses": [[e["step"], e["val_loss"]] for e in steps if e.get("val_loss") is not None],
    }
    report["averaging"] = averaging_summary(run, report["nodes"])
    report["wire_bytes_per_token"] = wire_per_token(report["nodes"], sum(e.get("tokens", 0) for e in steps))
    curve = [(e["step"], e["loss"]) for e in steps if e["loss"] is not None]
    marks = [(crash["step"], f"crash (stage {crash['stage']})")] if crash and "stage" in crash else []
    if wipe and "stage" in wipe:
        marks.append((wipe["step"], f"stage {wipe['stage']} wiped"))
    marks += [(r["step"], f"stage {r['stage']} rebuilt ({r['rule']})") for r in report["repairs"]]
    curves = {"swarm": ([s for s, _ in curve], [v for _, v in curve])}
    if report["val_losses"]:  # train.eval_every
        curves["validation"] = ([s for s, _ in report["val_losses"]], [v for _, v in report["val_losses"]])
    return write_report(
        directory,
        report,
        curves,
        f"shoal demo ({run.name}): {len(report['nodes'])} nodes",
        marks,
    )
