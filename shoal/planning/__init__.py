"""Pure planning: stage allocation, partial-path scheduling and flow routing over plain data.

No sockets, clocks or hidden randomness: every function takes a `Swarm` snapshot (and a seeded
`random.Random` where it draws), so the daemon and the simulator run exactly the same decisions.
"""
