"""Streams carried by a relay at shoal's level (shoal/p2p/stream_relay.py), over the in-memory
transport: the node behind NAT sees the true origin, megabytes pass, strangers are refused."""

from __future__ import annotations

import asyncio

import pytest

from shoal.p2p.memory import MemoryNetwork
from shoal.p2p.stream_relay import RelayingTransport, RelayRefused
from shoal.protocol.messages import RelayedFrom

BIG = bytes(range(256)) * 12_000  # ~3 MB: a hop of a real model, far past a p2pd circuit's 128 KiB


def nodes(*names: str) -> tuple[MemoryNetwork, dict[str, RelayingTransport]]:
    network = MemoryNetwork()
    return network, {name: RelayingTransport(network.transport(name)) for name in names}


def test_a_relay_carries_a_stream_both_ways_and_the_node_behind_nat_sees_its_origin():
    async def scenario():
        _, t = nodes("relay", "home", "origin")
        await t["relay"].serve_relay(5.0)
        await t["home"].serve_relayed(5.0)
        t["home"].own_relays = lambda: ("relay",)
        t["origin"].relays_of = lambda peer: ("gone", "relay") if peer == "home" else ()  # the first is down
        senders = []

        async def echo(stream):
            while True:
                try:
                    data = await stream.read_frame(max_bytes=len(BIG), wait_s=1.0)
                except Exception:
                    return
                senders.append(stream.peer)
                await stream.write_frame(data[::-1])

        await t["home"].add_handler("echo", echo, 5.0)
        stream = await t["origin"].open("home", "echo", 5.0)
        assert stream.peer == "home"
        for payload in (b"hello", BIG):  # two requests on one kept stream
            await stream.write_frame(payload)
            assert await stream.read_frame(max_bytes=len(BIG)) == payload[::-1]
        stream.close()
        await asyncio.sleep(0.05)
        return senders, t["relay"]

    senders, relay = asyncio.run(scenario())
    assert senders == ["origin", "origin"]
    assert relay.carried == 1 and relay.carried_bytes > 2 * len(BIG)


def test_the_relay_refuses_what_it_cannot_carry_and_the_node_refuses_strangers():
    async def scenario():
        network, t = nodes("relay", "home", "origin", "stranger")
        await t["relay"].serve_relay(5.0)
        await t["home"].serve_relayed(5.0)
        t["home"].own_relays = lambda: ("relay",)
        handled = []

        async def note(stream):
            handled.append(stream.peer)

        await t["home"].add_handler("echo", note, 5.0)
        # a stranger that claims to be a relay carrying a stream from "origin": refused, never handled
        forged = await t["stranger"].inner.open("home", "shoal.relayed", 5.0)
        await forged.write_message(RelayedFrom(origin="origin", protocol="echo"))
        await asyncio.sleep(0.05)
        assert handled == []
        # to itself, or to a node that keeps no connection to the relay: refused with the reason
        t["origin"].relays_of = lambda peer: ("relay",)
        with pytest.raises(RelayRefused, match="not a node behind NAT"):
            await t["origin"].open("relay", "echo", 5.0)
        network.kill("home")
        with pytest.raises(RelayRefused, match="keeps no connection to this relay"):
            await t["origin"].open("home", "echo", 5.0)
        # a node listed as relayed through us is reached directly
        network, t = nodes("relay", "home")
        t["relay"].relays_of = lambda peer: ("relay",)
        await t["home"].add_handler("echo", note, 5.0)
        (await t["relay"].open("home", "echo", 5.0)).close()
        await asyncio.sleep(0.05)
        return handled

    assert asyncio.run(scenario()) == ["relay"]
