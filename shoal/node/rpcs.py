"""The RPCs a node's engine answers, each declared once (shoal/p2p/rpc.py).

An engine names the ones it serves (`Engine.handlers()`, keyed by these declarations); the node serves
every one and answers the rest with the declaration's `refusal`, so a node between engines (joining,
moving stage) refuses everything as the declaration says. Callers write `ctx.rpc.abandon(peer, notice)`.
"""

from __future__ import annotations

from shoal.p2p.rpc import Rpc, Service
from shoal.protocol.pipeline import (
    AbandonNotice,
    Ack,
    BackupPull,
    BackwardRequest,
    ForwardRequest,
    GossipRequest,
    GradientShare,
    OutputRequest,
    RecomputeRequest,
    RecoverRequest,
    RedoOutputRequest,
    ResumeForward,
    RouteNote,
    StageCopyRequest,
    StepClose,
    StepTranscriptRequest,
)
from shoal.protocol.rollout import RolloutBundle


class EngineRpcs(Service):
    # a hop: the request, then its activation (or gradient); the hot path keeps its stream
    forward = Rpc(ForwardRequest, Ack, streamed=True, keep_alive=True, refusal="not ready")
    backward = Rpc(BackwardRequest, Ack, streamed=True, keep_alive=True, refusal="not ready")
    recompute = Rpc(RecomputeRequest, Ack, streamed=True, refusal="this node redoes no block stage")
    fetch_output = Rpc(OutputRequest, Ack, streamed=True, refusal="not ready")  # an Ack, then the tensor
    redo_output = Rpc(RedoOutputRequest, Ack, streamed=True, refusal="this node redoes no block stage")  # as fetch
    step_close = Rpc(StepClose, Ack, keep_alive=True)
    # a data node's notes and its recovery of a lost hop
    abandon = Rpc(AbandonNotice, Ack, refusal="not ready")
    route_note = Rpc(RouteNote, Ack, refusal="this node sends no forwards")
    recover = Rpc(RecoverRequest, Ack)
    resume_forward = Rpc(ResumeForward, Ack, refusal="this node keeps no forward outputs")
    # replicas of one stage: averaging, stage-0 gradients, copies to joiners, transcripts for audits
    gossip = Rpc(GossipRequest, Ack, streamed=True, refusal="this node averages no stage")
    gradient_share = Rpc(GradientShare, Ack, streamed=True, refusal="this node shares no stage-0 gradients")
    copy_stage = Rpc(StageCopyRequest, Ack, streamed=True, refusal="this node serves no stage copies")
    backup_pull = Rpc(BackupPull, Ack, streamed=True, refusal="this node keeps no stage backups")
    step_transcript = Rpc(StepTranscriptRequest, Ack, streamed=True, refusal="this node keeps no step transcripts")
    # GRPO's rollout workers
    rollouts = Rpc(RolloutBundle, Ack, refusal="this node runs no rollouts")
