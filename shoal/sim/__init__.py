"""Discrete-event simulator of a swarm in virtual time, driven by the same `shoal.planning` code the
daemon runs: nodes with their compute and memory, links with latency and bandwidth, data nodes,
and churn. Every routing decision is delegated to `shoal.planning`; this package only keeps time."""
