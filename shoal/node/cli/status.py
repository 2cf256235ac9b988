"""`shoal status`: the swarm at a glance, as a table or as JSON.

shoal status --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/12D3Koo... [--run NAME] [--json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from shoal.node.cli.node import add_network_arguments, client_network
from shoal.planning.memory import gib
from shoal.planning.swarm_view import SwarmView


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_network_arguments(parser, with_identity=False)
    parser.add_argument("--run", default=None, metavar="NAME[@RUN_ID]", help="the run to show")
    parser.add_argument("--run-config", default=None, metavar="FILE", help="or the run in this TOML file")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--join-timeout", type=float, default=30.0, metavar="S",
                        help="keep trying the initial peers this long, then say what each one is (exit 2)")  # fmt: skip


def _stage_list(stages: list[int]) -> str:
    words = [str(s) for s in stages]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def swarm_needs(view: SwarmView) -> dict[str, Any]:
    """What the run still needs before it can train: a live replica of every stage.

    Stage 0 is held by a data node, stages 1..S-1 by workers, so a run of S stages needs at least
    S nodes. A node that announced `leaving` does not count; a joining one does (it is about to hold
    its stage). Every stage without a live replica takes one more node: a node started with the
    default role fills an empty stage first.
    """
    required = view.stages
    missing = [s for s in range(view.stages) if not view.replicas(s)]
    why = f"this run needs at least {required}: one data node and one worker per block stage"
    if not missing:
        message = "ready: every stage has a live replica"
    else:
        have = "has" if len(missing) == 1 else "have"
        nodes = "node" if len(missing) == 1 else "nodes"
        stage_word = "stage" if len(missing) == 1 else "stages"
        message = (
            f"{stage_word} {_stage_list(missing)} {have} no live replica: start {len(missing)} more {nodes} ({why})"
        )
    waiting = [{"peer_id": n.peer_id, "stages": list(n.waiting_for)} for n in view.live_nodes() if n.waiting_for]
    if waiting:
        message += "; " + "; ".join(
            f"data node {w['peer_id'][-8:]} is waiting for stage(s) {w['stages']}" for w in waiting
        )
    return {
        "waiting": waiting,
        "ready": not missing,
        "nodes_required": required,
        "live_nodes": len(view.live_nodes()),
        "stages_without_replica": missing,
        "nodes_to_start": len(missing),
        "message": message,
    }


def summarize(run, view) -> dict[str, Any]:
    """The status document: run, nodes, per-stage totals and what the run needs (plain data, also used by the demo)."""
    now = view.taken_at
    nodes = []
    for n in view.nodes:
        blocks = max(1, view.blocks_per_stage[n.stage])
        nodes.append(
            {
                "peer_id": n.peer_id,
                "role": n.role,
                "stage": n.stage,
                "state": n.state,
                "throughput": n.block_throughput / blocks,
                "block_throughput": n.block_throughput,
                "max_inflight": n.max_inflight,
                "inner_step": n.inner_step,
                "outer_epoch": n.outer_epoch,
                "loss": n.loss,
                "grad_norm": n.grad_norm,
                "age_s": max(0.0, now - n.updated_at),
                "expires_in_s": max(0.0, n.expires_at - now),
                "maddrs": list(n.maddrs),
                "waiting_for": list(n.waiting_for),
                "replica_distance": n.replica_distance,
                "grad_norm_clipped": n.grad_norm_clipped,
                "repair": None if n.repair is None else asdict(n.repair),
                "reachable": n.reachable,
                "relays": list(n.relays),
                "links": [{"peer_id": p, "latency_s": lat, "bandwidth_Bps": bw} for p, lat, bw in n.links],
                "relay_service": n.relay_service,
                "excluded": [{"peer_id": peer, "reason": reason} for peer, reason in n.excluded],
                "device": None if n.device is None else asdict(n.device),
                "placement_note": n.placement_note,
            }
        )
    stages = [
        {"stage": s, "replicas": len(view.replicas(s)), "throughput": view.stage_throughput(s) if s else None}
        for s in range(view.stages)
    ]
    repairs = [{"peer_id": n["peer_id"], **n["repair"]} for n in nodes if n["repair"] is not None]
    return {
        "run": {"name": run.name, "run_id": run.run_id, "stages": run.pipeline.stages},
        "nodes": nodes,
        "repairs": repairs,
        "excluded": exclusions(nodes),
        "stages": stages,
        "needs": swarm_needs(view),
    }


def exclusions(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Who stopped trusting whom, and why: a data node's audits take a replica out of its routes, a
    worker's robust outer step refuses a replica as its averaging partner (docs/security.md)."""
    return [
        {"peer_id": e["peer_id"], "by": n["peer_id"], "by_role": n["role"], "reason": e["reason"]}
        for n in nodes
        for e in n["excluded"]
    ]


def device_label(device: dict[str, Any]) -> str:
    """The device's kind, its name, and the precision where it is not float32 (`cpu AMD EPYC`)."""
    precision = " bf16" if device["compute_dtype"] == "bfloat16" else ""
    return f"{device['kind']} {device['name'][:24]}{precision}"


def print_table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    run = doc["run"]
    table = Table(title=f"run {run['name']}@{run['run_id']}: {len(doc['nodes'])} nodes, {run['stages']} stages")
    for column in ("peer", "role", "stage", "device", "memory free", "mb/s", "state", "inner step", "loss", "age"):
        table.add_column(column, justify="left" if column in ("peer", "role", "device", "state") else "right")
    for n in doc["nodes"]:
        device = n.get("device")
        table.add_row(
            "…" + n["peer_id"][-10:],
            n["role"],
            str(n["stage"]),
            Text("-" if device is None else device_label(device)),  # the name is the peer's text
            "-" if device is None else f"{gib(device['free_bytes'])} / {gib(device['total_bytes'])}",
            f"{n['throughput']:.1f}",
            n["state"],
            str(n["inner_step"]),
            "-" if n["loss"] is None else f"{n['loss']:.3f}",
            f"{n['age_s']:.0f}s",
        )
    console = Console()
    console.print(table)
    covered = ", ".join(f"{s['stage']}:{s['replicas']}" for s in doc["stages"])
    console.print(f"replicas per stage  {covered}")
    for n in doc["nodes"]:
        if n.get("placement_note"):
            console.print(Text(f"…{n['peer_id'][-10:]} {n['placement_note']}", style="yellow"))
    for n in doc["nodes"]:
        if n["relays"]:
            through = ", ".join(f"…{r[-10:]}" for r in n["relays"])
            console.print(f"…{n['peer_id'][-10:]} is behind NAT, reached through relay(s) {through}")
        elif n["reachable"] is False:
            console.print(f"…{n['peer_id'][-10:]} is not reachable: peers could not open a connection to it (see its "
                          "log)")  # fmt: skip
    relays = [f"…{n['peer_id'][-10:]}" for n in doc["nodes"] if n["relay_service"]]
    if relays:
        console.print(f"relaying for nodes behind NAT: {', '.join(relays)} (and the bootstrap peers, by default)")
    for repair in doc["repairs"]:
        sources = ", ".join(str(s) for s in repair["sources"]) or "nothing"
        note = f" ({repair['note']})" if repair["note"] else ""
        console.print(
            f"stage {repair['stage']} rebuilt by {repair['rule']} from stage(s) {sources} at inner step "
            f"{repair['inner_step']} by …{repair['peer_id'][-10:]}{note}"
        )
    for e in doc.get("excluded", ()):  # reasons are peers' text: printed as Text, never as markup
        what = {"data": "excluded from the routes of", "rollout": "dropped as a rollout source by"}.get(
            e["by_role"], "refused as averaging partner by"
        )
        console.print(Text(f"…{e['peer_id'][-10:]} {what} …{e['by'][-10:]}: {e['reason']}", style="bold red"))
    needs = doc["needs"]
    console.print(Text(needs["message"], style="bold green" if needs["ready"] else "bold yellow"))


def run(args: argparse.Namespace) -> int:
    import uvloop

    from shoal.dht.identity import load_identity
    from shoal.dht.swarm import SwarmDHT
    from shoal.node.config import NodeConfig, RunChoice
    from shoal.node.run_source import resolve_run

    network = client_network(args)
    lookup = NodeConfig(network=network, run=RunChoice(run_name=args.run, run_config_path=args.run_config))

    async def main() -> dict[str, Any]:
        dht = await SwarmDHT.create(load_identity(None), network.initial_peers, network.host_maddrs, client_mode=True,
                                    join_timeout_s=args.join_timeout)  # fmt: skip
        try:
            run_config = await resolve_run(dht, lookup)
            return summarize(run_config, await dht.read_view(run_config))
        finally:
            await dht.shutdown()

    doc = uvloop.run(main())
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_table(doc)
    return 0
