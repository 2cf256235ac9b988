"""DHT key names. Every value is stored under its owner's public key as subkey, so only it can write."""

from __future__ import annotations

from hivemind.dht.routing import DHTID

DEFAULT_RUN_KEY = "shoal.run.@default"


def nodes_key(run_id: str) -> str:
    return f"shoal.{run_id}.nodes"


def run_key(name: str) -> str:
    return f"shoal.run.{name}"


def key_id(key: str) -> bytes:
    """What a validator sees of a key: its DHT id (the raw key name never travels)."""
    return DHTID.generate(source=key).to_bytes()
