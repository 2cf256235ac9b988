"""The engine RPCs every node serves, handed to whatever engine the node runs now.

An engine names the requests it answers (`Engine.handlers()`: `forward`, `backward`, `rollouts`, ...);
the rest are refused with a reason, so the service never needs to know which kind of engine it
talks to, and a node between engines (joining, moving stage) refuses everything as "not ready".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from hivemind.p2p import PeerID

from shoal.node.net.transport import FramedStream
from shoal.protocol.pipeline import (
    AbandonNotice,
    Ack,
    BackwardRequest,
    ForwardRequest,
    GossipRequest,
    GradientShare,
    OutputRequest,
    RecomputeRequest,
    RecoverRequest,
    ResumeForward,
    RouteNote,
    StageCopyRequest,
    StepClose,
    StepTranscriptRequest,
)
from shoal.protocol.rollout import RolloutBundle

Handlers = Mapping[str, Callable[..., Awaitable[Any]]]


class EngineService:
    """`heard(peer_id)` runs on every call: a peer that asks us something is alive (net/suspects.py)."""

    def __init__(self, handlers: Callable[[], Handlers], heard: Callable[[str], Any] = lambda peer_id: None):
        self.handlers = handlers  # the current engine's handlers (none before it is built)
        self.heard = heard

    def _handler(self, name: str, peer: PeerID) -> Callable[..., Awaitable[Any]] | None:
        self.heard(peer.to_base58())
        return self.handlers().get(name)

    async def rpc_forward(self, request: ForwardRequest, stream: FramedStream, peer: PeerID) -> Ack:
        handler = self._handler("forward", peer)
        if handler is None:
            return Ack(accepted=False, reason="not ready")
        return await handler(request, stream, peer.to_base58())

    async def rpc_backward(self, request: BackwardRequest, stream: FramedStream, peer: PeerID) -> Ack:
        handler = self._handler("backward", peer)
        if handler is None:
            return Ack(accepted=False, reason="not ready")
        return await handler(request, stream, peer.to_base58())

    async def rpc_recompute(self, request: RecomputeRequest, stream: FramedStream, peer: PeerID) -> Ack:
        handler = self._handler("recompute", peer)
        if handler is None:
            return Ack(accepted=False, reason="this node redoes no block stage")
        return await handler(request, stream, peer.to_base58())

    async def rpc_fetch_output(self, request: OutputRequest, stream: FramedStream, peer: PeerID) -> Ack | None:
        handler = self._handler("fetch_output", peer)
        if handler is None:
            return Ack(accepted=False, reason="not ready")
        await handler(request, stream, peer.to_base58())
        return None

    async def rpc_abandon(self, notice: AbandonNotice, stream: FramedStream, peer: PeerID) -> Ack:
        handler = self._handler("abandon", peer)
        return Ack(accepted=False, reason="not ready") if handler is None else await handler(notice, peer.to_base58())

    async def rpc_route_note(self, note: RouteNote, stream: FramedStream, peer: PeerID) -> Ack:
        handler = self._handler("route_note", peer)
        return (
            Ack(accepted=False, reason="this node sends no forwards")
            if handler is None
            else await handler(note, peer.to_base58())
        )

    async def rpc_recover(self, request: RecoverRequest, stream: FramedStream, peer: PeerID) -> Ack:
        handler = self._handler("recover", peer)
        if handler is None:
            return Ack(accepted=False, reason="not served here")
        return await handler(request, peer.to_base58())

    async def rpc_resume_forward(self, request: ResumeForward, stream: FramedStream, peer: PeerID) -> Ack:
        handler = self._handler("resume_forward", peer)
        if handler is None:
            return Ack(accepted=False, reason="this node keeps no forward outputs")
        return await handler(request, peer.to_base58())

    async def rpc_step_close(self, close: StepClose, stream: FramedStream, peer: PeerID) -> Ack:
        handler = self._handler("step_close", peer)
        if handler is None:
            return Ack(accepted=False, reason="not served here")
        return await handler(close, peer.to_base58())

    async def rpc_gossip(self, request: GossipRequest, stream: FramedStream, peer: PeerID) -> Ack | None:
        handler = self._handler("gossip", peer)
        if handler is None:
            return Ack(accepted=False, reason="this node averages no stage")
        return await handler(request, stream, peer.to_base58())

    async def rpc_gradient_share(self, request: GradientShare, stream: FramedStream, peer: PeerID) -> Ack | None:
        handler = self._handler("gradient_share", peer)
        if handler is None:
            return Ack(accepted=False, reason="this node shares no stage-0 gradients")
        return await handler(request, stream, peer.to_base58())

    async def rpc_copy_stage(self, request: StageCopyRequest, stream: FramedStream, peer: PeerID) -> Ack | None:
        handler = self._handler("copy_stage", peer)
        if handler is None:
            return Ack(accepted=False, reason="this node serves no stage copies")
        await handler(request, stream, peer.to_base58())
        return None

    async def rpc_step_transcript(
        self, request: StepTranscriptRequest, stream: FramedStream, peer: PeerID
    ) -> Ack | None:
        handler = self._handler("step_transcript", peer)
        if handler is None:
            return Ack(accepted=False, reason="this node keeps no step transcripts")
        await handler(request, stream, peer.to_base58())
        return None

    async def rpc_rollouts(self, bundle: RolloutBundle, stream: FramedStream, peer: PeerID) -> Ack:
        handler = self._handler("rollouts", peer)
        if handler is None:
            return Ack(accepted=False, reason="this node runs no rollouts")
        return await handler(bundle, peer.to_base58())
