"""Fuzzing live daemons: every RPC a node serves, hit over real libp2p streams with malformed,
truncated, oversized, type-confused and valid-but-hostile messages, plus spoofed DHT records.

Four processes run on loopback: a bootstrap peer, a stage worker, a data node (waiting for a stage
nobody serves, so its ledger must stay empty) and a GRPO rollout worker. One long-lived client
fuzzes each. Cases are drawn up front from hypothesis strategies (seeded: the seed is in every
failure message) and go out in one async loop, a few streams at a time per daemon, each also cut
short and with bits flipped; the RPCs are read from the service classes, so a new `rpc_*` handler
is fuzzed without touching this file.

What must hold: no daemon dies or logs a traceback, none answers `internal`, memory and file
descriptors come back near where they were, refused requests change no state (a worker's passes,
steps and epochs, a data node's ledger, the swarm view), and afterwards a real training step runs.

Run: .venv/bin/python -m pytest -n 0 tests/test_node_fuzz.py -q -s   (SHOAL_FUZZ_SEED=N replays a run)
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import functools
import itertools
import os
import random
import string
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hivemind.utils import get_dht_time
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import shoal
from shoal.config import RunConfig, run_config_from_dict
from shoal.dht.identity import load_identity
from shoal.dht.keys import nodes_key, run_key
from shoal.dht.runs import run_record
from shoal.dht.swarm import SwarmDHT
from shoal.grpo.policy import PolicySpec
from shoal.node.rollout.worker import MAX_PENDING_PER_PEER
from shoal.node.rpcs import EngineRpcs
from shoal.p2p.rpc import Service, serve
from shoal.p2p.services import NodeRpcs
from shoal.p2p.streams import FramedStream
from shoal.protocol.codec import decode, encode
from shoal.protocol.errors import MalformedMessage, ProtocolError
from shoal.protocol.limits import CHUNK_BYTES, INT64_MAX, INT64_MIN, MAX_MESSAGE_BYTES
from shoal.protocol.messages import ErrorReply, Ping
from shoal.protocol.pipeline import (
    MAX_ROUTE_HOPS,
    Ack,
    BackwardRequest,
    ForwardRequest,
    GossipRequest,
    GradientShare,
    Hop,
    RecomputeRequest,
    StepClose,
)
from shoal.protocol.registry import registered_messages, tag_of
from shoal.protocol.rollout import Completion
from shoal.protocol.tensors import DTYPE_SIZES, TensorHeader, TensorMeta, TensorSpec, frame_payload
from shoal.protocol.version import PROTOCOL_VERSION
from shoal.run_files import load_run_config
from tests.helpers.processes import metrics
from tests.helpers.raw_frames import announce_data_node, send_with_tensor, unchecked_encode
from tests.helpers.tiny import tiny_run, write_tiny_run
from tests.test_protocol_codec import any_message, message_strategy

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

# The services a node and a bootstrap peer serve (the daemon's start, BootstrapPeer.create); an RPC
# declared in one of them is fuzzed as it is.
NODE_SERVICES: tuple[type[Service], ...] = (NodeRpcs, EngineRpcs)
BOOTSTRAP_SERVICES: tuple[type[Service], ...] = (NodeRpcs,)
PROTOCOLS = {name: rpc.protocol for service in NODE_SERVICES for name, rpc in service.rpcs().items()}


def served(services: tuple[type[Service], ...]) -> dict[str, type]:
    """RPC name -> request type, for every RPC these services declare."""
    return {name: rpc.request for service in services for name, rpc in service.rpcs().items()}


RPCS = served(NODE_SERVICES) | served(BOOTSTRAP_SERVICES)
# Requests a handler may follow by reading a tensor: sent without one, they are a truncation.
TENSOR_REQUESTS = (ForwardRequest, BackwardRequest, RecomputeRequest, GossipRequest, GradientShare)

GENERIC_CASES = 560  # each goes to every daemon that serves its RPC, in every variant
LIVE_CASES = 160  # hostile requests about the worker's one live microbatch, from a stranger
ORIGIN_CASES = 160  # ... and from its own data node
RECORD_CASES = 40  # spoofed and replayed DHT records
STREAMS_PER_DAEMON = 8
REPLY_TIMEOUT_S = 8.0
MAX_INFLIGHT = 8  # the worker's bound on microbatches in flight
FLOOD = 5 * MAX_INFLIGHT
MAX_RSS_GROWTH = 150 * 2**20
MAX_FD_GROWTH = 24

# Names resolved per daemon when a case is sent: hostile requests name real peers and a real microbatch.
MADDR = "maddr:target"
MADDRS = [MADDR, "/ip4/127.0.0.1/tcp/1", "/ip6/::1/tcp/9", "/ip4/10.0.0.1/tcp/80", "/dns/x/tcp/1"]
TARGET, WORKER, DATA, ROLLOUT, ORIGIN, SELF = (
    f"peer:{name}" for name in ("target", "worker", "data", "rollout", "origin", "self")
)
LIVE = "mb:live"
TASK, RUN, TOKENIZER = "grpo:task", "grpo:run", "grpo:tokenizer"
TOKEN = string.ascii_letters + string.digits + "._:#@-"

D_MODEL = tiny_run().model.d_model
MICROBATCH = (2, 8, D_MODEL)  # (B, T, C): within the tiny run's microbatch size and sequence length
GRPO = {"task": "add2r", "prompts_per_round": 2, "group_size": 2, "rounds": 100, "round_deadline_s": 600.0,
        "eval_prompts": 4, "eval_every": 100}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Case:
    """One stream's worth of hostile input. Bytes go out as they are; a message is resolved (its
    placeholder names become real ids), encoded and framed. `reply`: the daemon has everything it
    needs to answer; otherwise the case is a truncation and the client closes the stream at once."""

    rpc: str
    parts: tuple[Any, ...]
    reply: bool


def frame(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def envelope(version: Any, tag: Any, body: Any) -> bytes:
    return msgpack.packb({"v": version, "t": tag, "b": body}, use_bin_type=True)


def body_of(message: object) -> dict:
    return msgpack.unpackb(encode(message), raw=False)["b"]


def answerable(data: bytes, expected: type) -> bool:
    """Whether a daemon can answer these bytes without waiting for more: the first frame is over
    the limit, or complete and not the request it expects (a valid request goes on to its handler)."""
    if len(data) < 4:
        return False
    length = int.from_bytes(data[:4], "big")
    if length > MAX_MESSAGE_BYTES:
        return True
    if len(data) < 4 + length:
        return False
    try:
        decode(data[4 : 4 + length], expected)
    except ProtocolError:
        return True
    return False


# ---------------------------------------------------------------- strategies

INTS = st.integers(-2, 3) | st.sampled_from([9, 19, 2**31, INT64_MAX, INT64_MIN]) | st.integers(INT64_MIN, INT64_MAX)
MSGPACK = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(INT64_MIN, 2**64 - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=16),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6) | st.integers(0, 9), inner, max_size=4)
    ),
    max_leaves=8,
)


def peer_names(with_self: bool) -> st.SearchStrategy[str]:
    names = [TARGET, WORKER, DATA, ROLLOUT, ORIGIN] + ([SELF] if with_self else [])
    return st.sampled_from(names) | st.text(TOKEN, max_size=8) | st.just("Qm" + "z" * 94)


def completions() -> st.SearchStrategy[tuple[Completion, ...]]:
    pair = st.tuples(st.integers(-1, 15), st.floats(-4.0, 0.5))
    one = st.builds(
        lambda index, pairs: Completion(index, tuple(t for t, _ in pairs), tuple(lp for _, lp in pairs)),
        st.integers(-1, 2),
        st.lists(pair, max_size=5),
    )
    return st.lists(one, max_size=5).map(tuple)


@functools.cache
def request_strategy(cls: type, with_self: bool = False, live_only: bool = False) -> st.SearchStrategy:
    """A schema-valid request of `cls`, its fields that name peers, microbatches, hops, rounds and
    addresses drawn from the values a handler acts on (placeholders, resolved per daemon)."""
    peer = peer_names(with_self)
    hop = st.builds(Hop, stage=INTS, peer_id=peer)
    targeted = {
        "microbatch_id": st.just(LIVE) if live_only else st.just(LIVE) | st.text(TOKEN, max_size=8) | st.just("m" * 96),
        "origin": peer,
        "lost_peer": peer,
        "route": st.lists(hop, max_size=3).map(tuple) | hop.map(lambda h: (h,) * MAX_ROUTE_HOPS),
        "hop": INTS,
        "step": INTS,
        "stage": INTS,
        "epoch": INTS,
        "completed": INTS,
        "abandoned": INTS,
        "round": st.integers(-1, 3) | INTS,
        "tensors": st.integers(-1, 24) | INTS,
        "reason": st.text(max_size=12) | st.just("x\n2026-12-01 WARNING forged\x1b[31m\x00"),
        "task": st.just(TASK) | st.text(max_size=8),
        "model_id": st.text(max_size=8),
        "tokenizer_id": st.just(TOKENIZER) | st.text(max_size=8),
        "run_id": st.sampled_from([RUN, ""]) | st.text(max_size=8),
        "completions": completions(),
        "maddrs": st.lists(st.sampled_from(MADDRS) | st.text(max_size=12), max_size=4).map(tuple),
    }
    fields = dataclasses.fields(cls)
    chosen = {f.name: targeted[f.name] for f in fields if f.name in targeted}
    required = {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if required <= set(chosen):
        return st.builds(cls, **chosen).filter(_encodes)
    # A request type this file does not know yet: the codec tests' strategy, with what we know redrawn.
    return (
        st.tuples(message_strategy(cls), st.fixed_dictionaries(chosen))
        .map(lambda pair: dataclasses.replace(pair[0], **pair[1]))
        .filter(_encodes)
    )


def _encodes(message: object) -> bool:
    """Whether our encoder writes `message`: a value drawn outside a field's bounds (a negative step where
    the schema says at least 0) never leaves a sender that uses it; `garbage` sends those by hand."""
    try:
        encode(message)
    except MalformedMessage:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class TensorFrames:
    frames: tuple[bytes, ...]
    complete: bool  # a receiver that reads this tensor gets an answer without waiting for more


FILLS = ("normal", "within", "edge", "beyond", "huge", "nan", "inf", "-inf")
HOSTILE_FILLS = ("beyond", "huge", "nan", "inf", "-inf")  # refused by any float spec with a bound
FRAMINGS = ("exact", "exact", "exact", "extra_chunk", "short_chunk", "empty_chunk", "oversized_chunk",
            "lying_nbytes", "lying_chunks", "huge_declared", "not_a_header", "noise_header",
            "cut_stream", "no_chunks")  # fmt: skip


def _payload(dtype: str, shape: tuple[int, ...], fill: str, seed_value: int) -> bytes:
    """Raw little-endian bytes of a random tensor, with one value set to `fill` (floats only)."""
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(seed_value)
    if not torch_dtype.is_floating_point:
        bound = min(2**20, torch.iinfo(torch_dtype).max)
        x = torch.randint(-bound, bound, shape, generator=generator, dtype=torch_dtype)
    else:
        value = {"within": 6e4, "edge": 65504.0, "beyond": 7e4, "huge": 3e38, "nan": float("nan"),
                 "inf": float("inf"), "-inf": float("-inf")}.get(fill)  # fmt: skip
        x = torch.randn(shape, generator=generator)
        if value is not None and x.numel():
            x.view(-1)[torch.randint(0, x.numel(), (1,), generator=generator)] = value
        x = x.to(torch_dtype)
    return x.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@st.composite
def tensors(draw: st.DrawFn, hostile: bool = False) -> TensorFrames:
    """A tensor after a request: right or wrong dtype and shape, finite or not, and framed exactly,
    short, long, lying or cut off. `hostile`: one no receiver may take (never a valid gradient)."""
    dtype = draw(st.sampled_from(("float32",) * 4 + tuple(sorted(DTYPE_SIZES))))
    shape = draw(
        st.tuples(st.integers(1, 2), st.integers(1, 32), st.just(D_MODEL))
        | st.tuples(st.integers(0, 3), st.integers(0, 40), st.sampled_from([D_MODEL, D_MODEL - 1, D_MODEL + 1, 0]))
        | st.lists(st.integers(1, 7), max_size=5).map(tuple)  # a rank and dims that match no stage weight
    )
    fill = draw(st.sampled_from(HOSTILE_FILLS if hostile else FILLS))
    framing = draw(st.sampled_from(FRAMINGS))
    meta = TensorMeta(dtype=dtype, shape=shape)
    header, chunks = frame_payload(meta, _payload(dtype, shape, fill, draw(st.integers(0, 2**31))))
    head, body = frame(encode(header)), [frame(bytes(c)) for c in chunks]
    if framing == "extra_chunk":
        return TensorFrames((head, *body, frame(b"\x00" * draw(st.integers(1, 64)))), True)
    if framing == "short_chunk" and chunks:
        return TensorFrames((head, frame(bytes(chunks[0])[: -draw(st.integers(1, len(chunks[0])))])), True)
    if framing == "empty_chunk":
        return TensorFrames((head, frame(b"")), True)
    if framing == "oversized_chunk":
        return TensorFrames((head, (CHUNK_BYTES + draw(st.integers(1, 2**20))).to_bytes(4, "big")), True)
    if framing in ("lying_nbytes", "lying_chunks"):
        delta = draw(st.sampled_from([-1, 1, 7, 2**40]))
        changes = {"nbytes": header.nbytes + delta} if framing == "lying_nbytes" else {}
        changes |= {"num_chunks": header.num_chunks + delta} if framing == "lying_chunks" else {}
        return TensorFrames((frame(encode(dataclasses.replace(header, **changes))), *body), True)
    if framing == "huge_declared":  # over every receiver's byte bound: refused before any allocation
        big = TensorMeta(dtype=dtype, shape=(2, draw(st.integers(2**16, 2**26)), D_MODEL))
        declared = TensorHeader(meta=big, nbytes=big.nbytes, num_chunks=-(-big.nbytes // CHUNK_BYTES))
        return TensorFrames((frame(encode(declared)),), True)
    if framing == "not_a_header":
        return TensorFrames((frame(encode(draw(other_messages(TensorHeader)))),), True)
    if framing == "noise_header":
        return TensorFrames((frame(draw(st.binary(max_size=64))),), True)
    if framing == "cut_stream" and chunks:  # the chunk's frame says more than ever arrives
        return TensorFrames((head, body[0][: -draw(st.integers(1, len(chunks[0])))]), False)
    if framing == "no_chunks" and chunks:
        return TensorFrames((head,), False)
    return TensorFrames((head, *body), True)


@functools.cache
def other_messages(cls: type) -> st.SearchStrategy:
    """Any registered message but `cls` (the codec tests' strategies)."""
    return any_message.filter(lambda m: type(m) is not cls)


@st.composite
def garbage(draw: st.DrawFn, cls: type) -> tuple[bytes, ...]:
    """Bytes that are not the request `cls`: noise, bare msgpack, a broken envelope, a body with a
    field dropped, added or of the wrong type, another message, or a frame over the size limit."""
    kind = draw(st.sampled_from(["raw", "noise", "msgpack", "envelope", "body", "body", "other", "oversized"]))
    if kind == "raw":
        return (draw(st.binary(max_size=40)),)
    if kind == "noise":
        return (frame(draw(st.binary(max_size=300))),)
    if kind == "msgpack":
        return (frame(msgpack.packb(draw(MSGPACK), use_bin_type=True)),)
    if kind == "envelope":
        version = draw(st.sampled_from([PROTOCOL_VERSION, 0, PROTOCOL_VERSION + 1, -1, 2**40]) | MSGPACK)
        tag = draw(st.sampled_from(sorted(registered_messages()) + ["", "FWD", "x" * 40]) | MSGPACK)
        body = draw(MSGPACK | request_strategy(cls).map(body_of))
        if draw(st.booleans()):
            return (frame(envelope(version, tag, body)),)
        extra = draw(st.dictionaries(st.text(max_size=3), MSGPACK, max_size=3))
        keys = draw(st.sets(st.sampled_from("vtb")))
        document = {k: v for k, v in {"v": version, "t": tag, "b": body}.items() if k in keys} | extra
        return (frame(msgpack.packb(document, use_bin_type=True)),)
    if kind == "body":
        body = draw(request_strategy(cls).map(body_of))
        key = draw(st.sampled_from(sorted(body) or ["x"]))
        how = draw(st.sampled_from(["drop", "retype", "retype", "extra", "long"]))
        if how == "drop":
            body.pop(key, None)
        elif how == "retype":
            body[key] = draw(MSGPACK)
        elif how == "extra":
            body[draw(st.text(max_size=8))] = draw(MSGPACK)
        else:
            body[key] = draw(st.sampled_from(["x", "\x1b[31m\n", "é"])) * draw(st.integers(97, 5000))
        return (frame(envelope(PROTOCOL_VERSION, tag_of(cls), body)),)
    if kind == "other":
        return (frame(encode(draw(other_messages(cls)))),)
    declared = draw(st.integers(MAX_MESSAGE_BYTES + 1, 2**32 - 1))
    return (declared.to_bytes(4, "big") + b"\x00" * draw(st.sampled_from([0, 16, 70_000])),)


@st.composite
def request_case(draw: st.DrawFn, rpc: str, cls: type) -> Case:
    """A schema-valid request, followed (mostly, where its handler reads one) by a tensor."""
    request = draw(request_strategy(cls))
    wants_tensor = cls in TENSOR_REQUESTS
    tensor = draw(tensors() if wants_tensor and draw(st.integers(0, 9)) else st.none())
    if tensor is None:
        return Case(rpc, (request,), not wants_tensor)
    return Case(rpc, (request, *tensor.frames), tensor.complete)


@st.composite
def generic_case(draw: st.DrawFn) -> Case:
    """A case for any RPC of any daemon; the sender is a stranger that no request names."""
    rpc = draw(st.sampled_from(sorted(RPCS)))
    cls = RPCS[rpc]
    if draw(st.integers(0, 9)) < 4:
        parts = draw(garbage(cls))
        return Case(rpc, parts, answerable(b"".join(parts), cls))
    return draw(request_case(rpc, cls))


PIPELINE_RPCS = sorted(
    name for name, cls in RPCS.items() if "microbatch_id" in {f.name for f in dataclasses.fields(cls)}
)
M_FORWARD = ForwardRequest(microbatch_id=LIVE, origin=ORIGIN, step=0, hop=0, route=(Hop(stage=1, peer_id=TARGET),))
M_BACKWARD = BackwardRequest(microbatch_id=LIVE, origin=ORIGIN, step=0, hop=0, route=(Hop(stage=1, peer_id=TARGET),))


@st.composite
def live_case(draw: st.DrawFn) -> Case:
    """A stranger's request about the live microbatch: the data node's own request with a few fields
    changed, the stranger naming itself as the hop before or after, the origin or the lost peer."""
    rpc = draw(st.sampled_from(PIPELINE_RPCS + ["step_close"]))
    cls = RPCS[rpc]
    request = draw(request_strategy(cls, with_self=True, live_only=True))
    names = {f.name for f in dataclasses.fields(cls)}
    near = {"origin": ORIGIN, "step": 0, "hop": 0, "route": M_FORWARD.route, "lost_peer": ORIGIN} | draw(
        st.fixed_dictionaries(
            {},
            optional={
                "origin": st.sampled_from([SELF, DATA]),
                "step": st.sampled_from([1, 19]),
                "hop": st.sampled_from([1, -1]),
                "route": st.sampled_from(
                    [(Hop(1, TARGET), Hop(2, SELF)), (Hop(2, SELF), Hop(1, TARGET)), (Hop(1, SELF),)]
                ),
                "lost_peer": st.sampled_from([SELF, TARGET]),
            },
        )
    )
    if draw(st.integers(0, 3)):  # mostly near the live microbatch's own requests; sometimes anything
        request = dataclasses.replace(request, **{k: v for k, v in near.items() if k in names})
    if cls not in TENSOR_REQUESTS:
        return Case(rpc, (request,), True)
    tensor = draw(st.just(valid_tensor()) | tensors())  # a valid tensor gets as far as the identity checks
    return Case(rpc, (request, *tensor.frames), tensor.complete)


@functools.cache
def valid_tensor() -> TensorFrames:
    """An activation or gradient a worker of the tiny run takes."""
    header, chunks = frame_payload(TensorMeta("float32", MICROBATCH), _payload("float32", MICROBATCH, "normal", 0))
    return TensorFrames((frame(encode(header)), *(frame(bytes(c)) for c in chunks)), True)


def spoofs_of_the_live_microbatch() -> list[Case]:
    """Every way a stranger can name itself in a request about the live microbatch (as its origin,
    the hop before or after it, the lost peer), each with a valid tensor: the identity checks alone
    must refuse them. Enumerated, so that none depends on a lucky draw."""
    routes = [(Hop(1, TARGET),), (Hop(1, TARGET), Hop(2, SELF)), (Hop(2, SELF), Hop(1, TARGET)), (Hop(1, SELF),)]
    values = {
        "microbatch_id": [LIVE],
        "origin": [ORIGIN, SELF],
        "step": [0, 9],
        "hop": [0, 1],
        "route": routes,
        "lost_peer": [ORIGIN, TARGET, SELF],
        "reason": ["forged"],
        "completed": [0],
        "abandoned": [0],
        "stage": [1],
        "peer_id": [SELF, TARGET],
    }
    cases = []
    for rpc in PIPELINE_RPCS + ["step_close"]:
        cls = RPCS[rpc]
        names = [f.name for f in dataclasses.fields(cls) if f.name in values]
        for choice in itertools.product(*(values[name] for name in names)):
            request = cls(**dict(zip(names, choice, strict=True)))
            tensor = valid_tensor().frames if cls in TENSOR_REQUESTS else ()
            cases.append(Case(rpc, (request, *tensor), True))
    return cases


@st.composite
def origin_case(draw: st.DrawFn) -> Case:
    """The live microbatch's own data node, replaying its forward or sending a gradient that must be
    refused: non-finite, huge, of the wrong shape or dtype, cut off, or naming the wrong hop or step."""
    if draw(st.booleans()):
        tensor = draw(tensors())
        return Case("forward", (M_FORWARD, *tensor.frames), tensor.complete)
    changes = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "origin": st.sampled_from([DATA, WORKER, "QmSomeoneElse"]),
                "step": st.sampled_from([-1, 1, 2**31]),
                "hop": st.just(-1),
                "route": st.sampled_from([(Hop(1, TARGET), Hop(2, ORIGIN)), (Hop(2, TARGET),), (Hop(1, ORIGIN),)]),
            },
        )
    )
    # A gradient naming the right origin, hop and step is taken: only a hostile tensor may go with it
    # (the one valid gradient comes after the fuzzing).
    tensor = draw(tensors(hostile=not {"origin", "step", "hop"} & set(changes)))
    return Case("backward", (dataclasses.replace(M_BACKWARD, **changes), *tensor.frames), tensor.complete)


def draw_cases(strategy: st.SearchStrategy[Case], count: int, seed_value: int) -> list[Case]:
    """`count` cases from a strategy, drawn by hypothesis's engine with a fixed seed."""
    cases: list[Case] = []

    @seed(seed_value)
    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(case: Case) -> None:
        cases.append(case)

    collect()
    return cases


# ---------------------------------------------------------------- sending


def resolve(value: Any, names: dict[str, str]) -> Any:
    """A message with every placeholder name replaced by the id it stands for."""
    if isinstance(value, str):
        return names.get(value, value)
    if isinstance(value, tuple):
        return tuple(resolve(v, names) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return dataclasses.replace(value, **{f.name: resolve(getattr(value, f.name), names) for f in fields})
    return value


@dataclasses.dataclass
class Tally:
    """What one daemon answered, by RPC and outcome."""

    outcomes: Counter = dataclasses.field(default_factory=Counter)
    internal: list[str] = dataclasses.field(default_factory=list)
    accepted: Counter = dataclasses.field(default_factory=Counter)
    silent: Counter = dataclasses.field(default_factory=Counter)  # (rpc, variant): no answer came
    sent: int = 0

    def note(self, rpc: str, outcome: str) -> None:
        self.sent += 1
        self.outcomes[(rpc, outcome)] += 1
        if outcome == "accepted":
            self.accepted[rpc] += 1

    def count(self, outcome: str) -> int:
        return sum(n for (_, o), n in self.outcomes.items() if o == outcome)


# Each generic case also goes out cut short and with bits flipped (cheap, seeded by the case).
VARIANTS = ("drawn", "cut", "cut", "flipped", "flipped", "flipped")


def vary(data: bytes, variant: str, rng: random.Random) -> bytes:
    """The bytes of a case cut at a random point, or with a few bits of its first frame flipped."""
    if variant == "cut":
        return data[: rng.randrange(len(data))] if data else data
    first = 4 + int.from_bytes(data[:4], "big") if len(data) >= 4 else len(data)
    flipped = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if flipped:
            flipped[rng.randrange(min(len(flipped), first))] ^= 1 << rng.randrange(8)
    return bytes(flipped)


async def deliver(
    client: SwarmDHT, peer_id: str, case: Case, names: dict[str, str], tally: Tally, variant: str, rng: random.Random
) -> None:
    chunks = [p if isinstance(p, bytes) else frame(unchecked_encode(resolve(p, names))) for p in case.parts]
    reply = case.reply
    if variant != "drawn":
        chunks = [vary(b"".join(chunks), variant, rng)]
        reply = answerable(chunks[0], RPCS[case.rpc])
    try:
        stream = await client.transport.open(peer_id, PROTOCOLS[case.rpc], REPLY_TIMEOUT_S)
    except Exception:
        tally.note(case.rpc, "no_stream")
        return
    try:
        for chunk in chunks:
            stream.writer.write(chunk)
        try:
            await asyncio.wait_for(stream.writer.drain(), REPLY_TIMEOUT_S)
        except (ConnectionError, TimeoutError):
            pass  # the daemon refused early and closed: its answer may still be there to read
        if not reply:
            tally.note(case.rpc, "cut")
            return
        try:
            answer = await stream.read_message()
        except (ProtocolError, TimeoutError, ConnectionError):
            tally.note(case.rpc, "silent")
            tally.silent[(case.rpc, variant)] += 1
            return
        if isinstance(answer, ErrorReply):
            if answer.code == "internal":
                tally.internal.append(f"{case.rpc} ({variant}): {answer.message} after {case.parts[0]!r:.300}")
            tally.note(case.rpc, f"error:{answer.code}")
        elif isinstance(answer, Ack):
            tally.note(case.rpc, "accepted" if answer.accepted else "declined")
        else:
            tally.note(case.rpc, type(answer).__name__)
    finally:
        stream.close()


async def fuzz(
    client: SwarmDHT,
    peer_id: str,
    cases: list[Case],
    names: dict[str, str],
    tally: Tally,
    variants: tuple[str, ...] = ("drawn",),
    fuzz_seed: int = 0,
) -> None:
    """Send every case (in every variant) to one daemon, `STREAMS_PER_DAEMON` streams at a time."""
    work = iter([(i, case, v) for i, case in enumerate(cases) for v in range(len(variants))])

    async def lane() -> None:
        for i, case, v in work:
            rng = random.Random(fuzz_seed * 1_000_003 + i * len(variants) + v)
            await deliver(client, peer_id, case, names, tally, variants[v], rng)

    await asyncio.gather(*(lane() for _ in range(STREAMS_PER_DAEMON)))


class Home:
    """The live microbatch's data node: takes its activation home and its gradient back."""

    def __init__(self) -> None:
        self.forwards = 0
        self.backwards = 0

    async def forward(self, request: ForwardRequest, stream: FramedStream, sender: str) -> Ack:
        await stream.read_tensor(TensorSpec("float32", (None, None, D_MODEL)))
        self.forwards += 1
        return Ack(accepted=True)

    async def backward(self, request: BackwardRequest, stream: FramedStream, sender: str) -> Ack:
        await stream.read_tensor(TensorSpec("float32", (None, None, D_MODEL)))
        self.backwards += 1
        return Ack(accepted=True)


async def until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


# ---------------------------------------------------------------- spoofed and replayed records


@st.composite
def record_spoof(draw: st.DrawFn) -> tuple[str, str, dict]:
    """(whose record to start from, whose subkey to store it under, changes): a record naming another
    peer, a victim's record replayed under our key or under theirs, or one with a field retyped."""
    victim = draw(st.sampled_from([WORKER, DATA]))
    under = draw(st.sampled_from(["ours", "victim"]))
    changes = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "peer_id": st.sampled_from([WORKER, DATA, ROLLOUT, ORIGIN]),
                "stage": st.integers(0, 3),
                "role": st.sampled_from(["data", "worker", "rollout"]),
                "block_throughput": st.sampled_from([1e9, 0.0]),
                "started_at": st.just(0.0),
                "inner_step": st.sampled_from(["1", -1, 1.5, None, [1], 2**63]),
            },
        )
    )
    return victim, under, changes


async def spoof_records(client: SwarmDHT, run: RunConfig, spoofs: list[tuple[str, str, dict]], ids: dict) -> list[str]:
    """Store each spoofed record; "refused" unless some peer took it. A control record of the
    client's own, under a key no node reads, shows that stores do reach the peers."""
    found = await client.node.get(nodes_key(run.run_id), latest=True)
    assert found is not None, "no node records to replay"
    records = {entry.value["peer_id"]: (subkey, entry.value) for subkey, entry in found.value.items()}
    expires = get_dht_time() + 60
    outcomes = []
    for victim, under, changes in spoofs:
        subkey, record = records[ids[victim]]
        spoofed = {**record, **{k: ids.get(v, v) if isinstance(v, str) else v for k, v in changes.items()}}
        key_subkey = client.owner_subkey if under == "ours" else subkey
        stored = await client.node.store(nodes_key(run.run_id), spoofed, expires, subkey=key_subkey)
        outcomes.append("stored" if stored else "refused")
    claimed = run_record(run, client.identity.signing_key, get_dht_time())
    forged_run = dict(claimed, toml=run.replace({"optim.lr": 1.0}).to_toml())  # its run id no longer hashes from it
    stored = await client.node.store(run_key(run.name), forged_run, expires, subkey=client.owner_subkey)
    outcomes.append("stored" if stored else "refused")
    control = {**records[ids[WORKER]][1], "peer_id": client.peer_id, "run_id": "fuzz-control"}
    stored = await client.node.store(nodes_key("fuzz-control"), control, expires, subkey=client.owner_subkey)
    assert stored, "no peer stored a valid record of our own: the refusals above would prove nothing"
    return outcomes


# ---------------------------------------------------------------- watching the daemons


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    """File descriptors of a daemon and of its libp2p daemon child."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return sum(len(os.listdir(f"/proc/{p}/fd")) for p in (pid, *map(int, children)))


SERVED = "shoal_microbatches_served_total"
WORKER_STATE = ("shoal_inner_step", "shoal_outer_epoch", "shoal_microbatches_in_flight",
                f'{SERVED}{{pass="forward"}}', f'{SERVED}{{pass="backward"}}')  # fmt: skip
DATA_STATE = ("shoal_inner_step", "shoal_microbatches_injected_total", "shoal_microbatches_completed_total",
              "shoal_microbatches_in_flight", "shoal_microbatches_resent_total")  # fmt: skip
NODE_ERRORS = ('shoal_errors_total{kind="rpc_internal"}', 'shoal_errors_total{kind="heartbeat"}',
               'shoal_errors_total{kind="training"}')  # fmt: skip


def state(samples: dict[str, float], names: tuple[str, ...]) -> dict[str, float]:
    return {name: samples.get(name, 0.0) for name in names}


def test_every_served_rpc_is_declared_by_a_service_this_file_fuzzes() -> None:
    """A class anywhere in shoal that declares RPCs (a `Service`) must be one of those fuzzed here."""
    found = set()
    for path in Path(shoal.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(getattr(base, "id", None) == "Service" for base in node.bases):
                found.add(node.name)
    assert found == {service.__name__ for service in NODE_SERVICES + BOOTSTRAP_SERVICES}, found
    assert {"ping", "forward", "backward", "rollouts"} <= set(RPCS)


@dataclasses.dataclass
class Daemon:
    """A fuzzed process: its launcher handle, the RPCs it serves and what it answered."""

    peer: Any
    rpcs: frozenset[str]
    peer_id: str = ""
    tally: Tally = dataclasses.field(default_factory=Tally)
    rss: list[int] = dataclasses.field(default_factory=list)
    fds: list[int] = dataclasses.field(default_factory=list)

    def measure(self) -> None:
        self.rss.append(rss_bytes(self.peer.pid))
        self.fds.append(open_fds(self.peer.pid))


def test_hostile_messages_to_every_rpc_change_nothing_and_break_nothing(swarm, tmp_path: Path) -> None:
    """Over 10,000 hostile streams to four live daemons; see the module docstring for what must hold."""
    fuzz_seed = int(os.environ.get("SHOAL_FUZZ_SEED", random.randrange(2**32)))
    where = f"(SHOAL_FUZZ_SEED={fuzz_seed})"
    started = time.monotonic()
    pipeline_file = write_tiny_run(tmp_path)
    pipeline = load_run_config(pipeline_file)
    grpo = run_config_from_dict({"name": "fuzz-grpo", "grpo": GRPO})
    grpo_file = tmp_path / "grpo.toml"
    grpo_file.write_text(grpo.to_toml())
    bootstrap = swarm.start_bootstrap("--run-config", str(pipeline_file))
    entry = bootstrap.maddrs[0]
    common = ("--metrics-port", "0")
    worker = swarm.start_node([entry], *common, "--role", "worker", "--stage", "1", "--max-inflight", str(MAX_INFLIGHT),
                              wait=False, name="worker")  # fmt: skip
    data = swarm.start_node([entry], *common, "--role", "data", wait=False, name="data")  # waits for stage 2
    rollout = swarm.start_node([entry], *common, "--run-config", str(grpo_file), "--role", "rollout",
                               "--policy-cache", str(tmp_path / "policies"), "--warmup-steps", "0",
                               wait=False, name="rollout")  # fmt: skip
    # Draw while the daemons start: hypothesis's engine, one seed for the whole run.
    generic = draw_cases(generic_case(), GENERIC_CASES, fuzz_seed)
    live = spoofs_of_the_live_microbatch() + draw_cases(live_case(), LIVE_CASES, fuzz_seed + 1)
    from_origin = draw_cases(origin_case(), ORIGIN_CASES, fuzz_seed + 2)
    spoofs = draw_cases(record_spoof(), RECORD_CASES, fuzz_seed + 3)
    drawn_s = time.monotonic() - started
    node_rpcs, bootstrap_rpcs = frozenset(served(NODE_SERVICES)), frozenset(served(BOOTSTRAP_SERVICES))
    daemons = {
        name: Daemon(peer, node_rpcs) for name, peer in (("worker", worker), ("data", data), ("rollout", rollout))
    }
    for daemon in daemons.values():
        daemon.peer_id = swarm.wait_ready(daemon.peer).peer_id
    daemons["bootstrap"] = Daemon(bootstrap, bootstrap_rpcs, entry.rsplit("/", 1)[1])
    ready_s = time.monotonic() - started
    ids = {WORKER: worker.peer_id, DATA: data.peer_id, ROLLOUT: rollout.peer_id, TASK: GRPO["task"],
           RUN: grpo.run_id, TOKENIZER: PolicySpec(task=GRPO["task"]).tokenizer().tokenizer_id}  # fmt: skip
    nodes = ("worker", "data", "rollout")

    async def scenario() -> dict[str, Any]:
        clients = {}
        for name, daemon in daemons.items():
            clients[name] = await SwarmDHT.create(load_identity(None), daemon.peer.maddrs, client_mode=True)
        origin, home = await SwarmDHT.create(load_identity(None), worker.maddrs, client_mode=True), Home()
        await serve(
            origin.transport, EngineRpcs, {EngineRpcs.forward: home.forward, EngineRpcs.backward: home.backward}
        )
        await announce_data_node(origin, pipeline.run_id)  # a listed data node: the worker takes its step close
        ids[ORIGIN] = origin.peer_id
        result: dict[str, Any] = {"before": {n: metrics(daemons[n].peer) for n in nodes}, "origin": origin.peer_id}
        try:
            for daemon in daemons.values():
                daemon.measure()

            # 1. Every case to every daemon that serves its RPC, each daemon fuzzed by its own client,
            # which no request names: nothing may be accepted.
            began = time.monotonic()
            names = {n: {**ids, TARGET: d.peer_id, SELF: clients[n].peer_id, MADDR: d.peer.maddrs[0], LIVE: "gone"}
                     for n, d in daemons.items()}  # fmt: skip
            lanes = []
            for name, d in daemons.items():
                cases = [case for case in generic if case.rpc in d.rpcs]
                lanes.append(fuzz(clients[name], d.peer_id, cases, names[name], d.tally, VARIANTS, fuzz_seed))
            await asyncio.gather(*lanes)
            result["generic_s"] = time.monotonic() - began
            result["middle"] = {n: metrics(daemons[n].peer) for n in nodes}

            # 2. One live microbatch on the worker, from its data node; then hostile requests about it,
            # from a stranger that may name itself anywhere, and from the data node itself.
            x = torch.randn(MICROBATCH)
            live_names = {**names["worker"], LIVE: "fuzz-live-" + os.urandom(16).hex()}
            first = resolve(M_FORWARD, live_names)
            assert (await send_with_tensor(origin, worker.peer_id, EngineRpcs.forward, first, x)).accepted
            await until(lambda: home.forwards == 1, 30, "the live microbatch's activation to come home")
            tally = daemons["worker"].tally
            await asyncio.gather(
                fuzz(clients["worker"], worker.peer_id, live, live_names, tally),
                fuzz(origin, worker.peer_id, from_origin, {**live_names, SELF: origin.peer_id}, tally),
            )
            held = state(metrics(worker), WORKER_STATE)  # the live microbatch alone: one forward, still held
            expected = {**state(result["before"]["worker"], WORKER_STATE), "shoal_microbatches_in_flight": 1}
            assert held == {**expected, f'{SERVED}{{pass="forward"}}': 1}, (held, where)

            # 3. Spoofed and replayed DHT records, from the worker's fuzzing client.
            result["records"] = await spoof_records(clients["worker"], pipeline, spoofs, ids)
            result["views"] = [
                sorted((n.peer_id, n.role, n.stage) for n in (await origin.read_view(run)).nodes)
                for run in (pipeline, grpo)
            ]
            for daemon in daemons.values():  # streams close asynchronously: wait, bounded, for their fds
                deadline = time.monotonic() + 15
                while open_fds(daemon.peer.pid) > daemon.fds[0] + MAX_FD_GROWTH and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                daemon.measure()

            # 4. Everything still works: pings, and the live microbatch's real gradient and step.
            for name in nodes:
                ping = Ping(sent_at=1.0, nonce=7)
                assert (await NodeRpcs(clients[name].transport).ping(daemons[name].peer_id, ping)).nonce == 7
            grad = resolve(M_BACKWARD, live_names)
            ack = await send_with_tensor(origin, worker.peer_id, EngineRpcs.backward, grad, torch.randn(MICROBATCH))
            assert ack.accepted, ack
            await until(lambda: home.backwards == 1, 30, "the gradient to reach the data node")
            close = StepClose(step=0, completed=1, abandoned=0)
            assert (await EngineRpcs(origin.transport).step_close(worker.peer_id, close)).accepted
            await until(lambda: metrics(worker)["shoal_inner_step"] == 1, 30, "the worker's inner step")
            after = dataclasses.replace(first, microbatch_id=first.microbatch_id + "-after", needs_backward=False)
            assert (await send_with_tensor(origin, worker.peer_id, EngineRpcs.forward, after, x)).accepted
            await until(lambda: home.forwards == 2, 30, "a forward after the fuzzing")
            result["final"] = {n: metrics(daemons[n].peer) for n in nodes}

            # 5. A stranger acting as a data node floods evaluation forwards towards a stage nobody
            # serves: each output waits for a replica that never comes; the worker keeps at most its bound.
            flood = [
                ForwardRequest(
                    microbatch_id=f"flood-{i}",
                    origin=SELF,
                    step=0,
                    hop=0,
                    needs_backward=False,
                    route=(Hop(1, TARGET), Hop(2, "QmNobody")),
                )
                for i in range(FLOOD)
            ]
            cases = [Case("forward", (request, *valid_tensor().frames), True) for request in flood]
            flooded = Tally()
            await fuzz(clients["worker"], worker.peer_id, cases, names["worker"], flooded)
            result["flood"] = flooded
            assert await NodeRpcs(clients["worker"].transport).ping(worker.peer_id, Ping(sent_at=1.0, nonce=8))
        finally:
            for client in (*clients.values(), origin):
                await client.shutdown()
        return result

    result = asyncio.run(scenario())
    flood: Tally = result["flood"]
    sent = sum(d.tally.sent for d in daemons.values()) + flood.sent + len(result["records"])
    print(f"\nfuzz {where}: {sent} messages; drawn in {drawn_s:.1f} s, daemons ready at {ready_s:.1f} s, "
          f"generic phase {result['generic_s']:.1f} s, total {time.monotonic() - started:.1f} s")  # fmt: skip
    for name, d in daemons.items():
        outcomes = Counter(outcome for (_, outcome), n in d.tally.outcomes.items() for _ in range(n))
        print(f"  {name}: {d.tally.sent} streams {dict(outcomes)}; RSS {d.rss[0] / 2**20:.0f} MiB "
              f"{(d.rss[1] - d.rss[0]) / 2**20:+.1f} MiB; fds {d.fds[0]} -> {d.fds[1]}")  # fmt: skip
    print(f"  records: {Counter(result['records'])}; flood: {flood.accepted['rpc_forward']} of {FLOOD} taken")
    print(f"  unanswered: { {n: dict(d.tally.silent) for n, d in daemons.items() if d.tally.silent} }")

    assert sent >= 10_000, f"{sent} messages {where}"
    for name, d in daemons.items():
        assert d.peer.alive, f"{name} died {where}:\n{d.peer.log()[-3000:]}"
        assert "Traceback" not in d.peer.log(), f"{name} {where}:\n{d.peer.log()[-5000:]}"
        assert not d.tally.internal, f"{name} answered internal {where}: {d.tally.internal[:5]}"
        assert {rpc for rpc, _ in d.tally.outcomes} == d.rpcs, f"{name} was not sent every RPC it serves"
        silent = d.tally.count("silent")
        assert silent <= d.tally.sent // 1000, f"{name}: {silent} streams unanswered {where}"
        assert d.rss[1] - d.rss[0] < MAX_RSS_GROWTH, f"{name} RSS {d.rss} {where}"
        assert d.fds[1] <= d.fds[0] + MAX_FD_GROWTH, f"{name} fds {d.fds} {where}"
    for name in nodes:
        for metric in NODE_ERRORS:
            assert result["final"][name].get(metric) == result["before"][name].get(metric), (name, metric, where)

    # Refused requests changed nothing: no pass, step or epoch on the worker from a stranger, the data
    # node's ledger empty, the rollout worker holding at most the bundles it may keep from one peer.
    before, middle, final = result["before"], result["middle"], result["final"]
    assert state(middle["worker"], WORKER_STATE) == state(before["worker"], WORKER_STATE), where
    assert state(final["data"], DATA_STATE) == dict.fromkeys(DATA_STATE, 0.0), where
    received = final["rollout"].get('shoal_rollout_bundles_total{kind="received"}', 0)
    assert received == daemons["rollout"].tally.accepted["rollouts"] <= MAX_PENDING_PER_PEER, where
    assert set(result["records"]) == {"refused"}, (Counter(result["records"]), where)
    taken = flood.accepted["forward"]
    assert 0 < taken <= MAX_INFLIGHT, f"{taken} of {FLOOD} flooding evaluation forwards taken {where}"
    pipeline_view, grpo_view = result["views"]
    listed = [(worker.peer_id, "worker", 1), (data.peer_id, "data", 0), (result["origin"], "data", 0)]
    assert pipeline_view == sorted(listed), where
    assert grpo_view == [(rollout.peer_id, "rollout", 0)], where
