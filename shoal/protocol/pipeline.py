"""Pipeline messages: a microbatch's activation going forward, its gradient coming back.

A request is one of these headers followed by one tensor (a ``TensorHeader`` and raw chunks).
The route travels with the microbatch, so every hop knows where to send its output and where the
gradient must go back, and can re-route a hop to another replica without asking anyone.
"""

from __future__ import annotations

from .errors import MalformedMessage
from .registry import message
from .schema import FieldOptions, wire_field

MAX_ROUTE_HOPS = 64
MAX_ID_CHARS = 96
MAX_STAGE_TENSORS = 4096
# A microbatch's token ids, which a Subspace Network's stages need beside its coefficients
# (torch_tensors.pack_tokens), within the request's 64 KiB: 24,576 tokens at 2 bytes a token
MAX_TOKEN_BYTES = 48 * 1024


def token_id_bytes(vocab_size: int) -> int:
    """Bytes a token id takes on the wire (little-endian, unsigned): 2 up to 65,536 ids, else 4."""
    return 2 if vocab_size <= 1 << 16 else 4


@message("hop")
class Hop:
    stage: int
    peer_id: str = wire_field(max_len=MAX_ID_CHARS, token=True)


@message("fwd")
class ForwardRequest:
    """Run your blocks on the attached activation; `hop` is your position in `route`.

    `hop == len(route)` means the activation has come home to the data node that sent it.
    """

    microbatch_id: str = wire_field(max_len=MAX_ID_CHARS, token=True)
    origin: str = wire_field(max_len=MAX_ID_CHARS, token=True)  # the data node's peer id
    step: int
    hop: int
    route: tuple[Hop, ...] = wire_field(max_len=MAX_ROUTE_HOPS)
    needs_backward: bool = True  # False: evaluation, keep nothing
    # SkipPipe's timetable: each hop's planned start (DHT time, seconds), which a hop waits for (a
    # bounded while) so as not to take its node before a microbatch planned there earlier; () = none
    starts: tuple[float, ...] = wire_field(max_len=MAX_ROUTE_HOPS, default=())
    # A Subspace Network's (model.subspace_rank > 0) token ids of the microbatch, which every stage
    # needs to rebuild the stream from the attached coefficients; b"" in any other run
    tokens: bytes = wire_field(max_len=MAX_TOKEN_BYTES, default=b"")


@message("bwd")
class BackwardRequest:
    """Backpropagate the attached gradient of your output; `hop == -1` means: back at the data node."""

    microbatch_id: str = wire_field(max_len=MAX_ID_CHARS, token=True)
    origin: str = wire_field(max_len=MAX_ID_CHARS, token=True)
    step: int
    hop: int
    route: tuple[Hop, ...] = wire_field(max_len=MAX_ROUTE_HOPS)
    starts: tuple[float, ...] = wire_field(max_len=MAX_ROUTE_HOPS, default=())  # each hop's planned backward


@message("recompute")
class RecomputeRequest:
    """Redo hop `hop` of a microbatch whose holder is gone: fetch that hop's input from the hop before
    it (which kept what it sent), run forward again, and backpropagate the attached gradient of its
    output. `route` already names this peer at `hop`; backward then continues upstream as usual."""

    microbatch_id: str = wire_field(max_len=MAX_ID_CHARS, token=True)
    origin: str = wire_field(max_len=MAX_ID_CHARS, token=True)
    step: int
    hop: int
    route: tuple[Hop, ...] = wire_field(max_len=MAX_ROUTE_HOPS)
    tokens: bytes = wire_field(max_len=MAX_TOKEN_BYTES, default=b"")  # as ForwardRequest.tokens


@message("fetch_out")
class OutputRequest:
    """Send me again what you sent hop `hop + 1` of this microbatch (the input of a hop being redone).
    The reply is an Ack, then (if accepted) the tensor."""

    microbatch_id: str = wire_field(max_len=MAX_ID_CHARS, token=True)
    hop: int


@message("redo_out")
class RedoOutputRequest:
    """Compute again what hop `hop` of a microbatch sent on, whose holder is gone with it: asked by the
    replica redoing the hop after it, which needs that as its input. Its own input is fetched as a
    recompute's is, and where that hop's holder is gone too, redone the same way further upstream (the
    data node's embedding output ends every walk). `route` names this peer at `hop` and the asker at
    `hop + 1`. The reply is an Ack, then (if accepted) the tensor; nothing is kept."""

    microbatch_id: str = wire_field(max_len=MAX_ID_CHARS, token=True)
    origin: str = wire_field(max_len=MAX_ID_CHARS, token=True)
    step: int
    hop: int
    route: tuple[Hop, ...] = wire_field(max_len=MAX_ROUTE_HOPS)
    tokens: bytes = wire_field(max_len=MAX_TOKEN_BYTES, default=b"")  # as ForwardRequest.tokens


@message("recover")
class RecoverRequest:
    """From the data node: `lost_peer` held this microbatch in backward and left; if you sent it a
    gradient, have its hop redone by another replica."""

    microbatch_id: str = wire_field(max_len=MAX_ID_CHARS, token=True)
    lost_peer: str = wire_field(max_len=MAX_ID_CHARS, token=True)


@message("resume_fwd")
class ResumeForward:
    """From the data node: the hop after yours took this microbatch's activation and was lost before it
    came home. Send the output you keep for its backward on along `route`, which names you at `hop` and
    replaces the lost hops after you (GWTF: re-send from the nearest upstream hop that kept the input)."""

    microbatch_id: str = wire_field(max_len=MAX_ID_CHARS, token=True)
    hop: int
    route: tuple[Hop, ...] = wire_field(max_len=MAX_ROUTE_HOPS)


@message("step_close")
class StepClose:
    """From a data node: its step `step` is over, with these microbatches completed. A worker steps its
    inner optimizer once every data node it took gradient from since its last step has closed one."""

    step: int
    completed: int
    abandoned: int


@message("abandon")
class AbandonNotice:
    """Tells a data node that one of its microbatches cannot finish, and why."""

    microbatch_id: str = wire_field(max_len=MAX_ID_CHARS, token=True)
    reason: str = wire_field(max_len=200)  # for people: logged, never parsed
    # what kind of loss (shoal.node.engine.AbandonReason's values; one the receiver does not know
    # counts as "other"): "stage_lost" when a stage on its way had no live replica for the whole wait
    kind: str = wire_field(max_len=16, token=True, default="other")


@message("route_note")
class RouteNote:
    """Tells a data node which peer took hop `hop` of its microbatch, where that is not the peer the
    route named when it left the data node. In forward: a sender that picks the next hop itself (GWTF,
    SWARM) or re-routed a failed one; without it a data node that loses that peer cannot find the hop
    to resume the forward from, and sends the whole forward again. In backward: the hop after a lost
    one had another replica redo it (a recompute); without it a data node that loses that stand-in
    too never has the hop redone again, and the microbatch times out."""

    microbatch_id: str = wire_field(max_len=MAX_ID_CHARS, token=True)
    hop: int = wire_field(ge=0, le=MAX_ROUTE_HOPS)
    stage: int = wire_field(ge=0, le=MAX_ROUTE_HOPS)
    peer_id: str = wire_field(max_len=MAX_ID_CHARS, token=True)


@message("ack")
class Ack:
    """The receiver took the work (or refused it: busy, wrong stage, unknown microbatch)."""

    accepted: bool
    reason: str = wire_field(max_len=200, default="")
    # GWTF (planning/gwtf.py): a worker taking a forward says how many microbatches it now holds and
    # what getting one home from it costs, which is all a sender knows of it; None: not said
    load: int | None = wire_field(ge=0, le=1_000_000, default=None)
    onward_s: float | None = wire_field(ge=0.0, le=1e6, default=None)


def check_hop(request: ForwardRequest | BackwardRequest | RecomputeRequest | RedoOutputRequest) -> None:
    """Refuse a hop index outside its route (forward: 0..len, backward: -1..len-1, recompute and redo:
    0..len-1)."""
    if isinstance(request, ForwardRequest):
        low, high = 0, len(request.route)
    elif isinstance(request, BackwardRequest):
        low, high = -1, len(request.route) - 1
    else:
        low, high = 0, len(request.route) - 1
    if not low <= request.hop <= high:
        raise MalformedMessage(f"hop {request.hop} outside a route of {len(request.route)} hops")
    starts = getattr(request, "starts", ())
    if starts and len(starts) != len(request.route):
        raise MalformedMessage(f"{len(starts)} planned starts for a route of {len(request.route)} hops")


@message("gossip")
class GossipRequest:
    """NoLoCo: exchange slow weights φ and pseudo-gradients θ − φ for outer epoch `epoch` of `stage`.

    The reply is an Ack refusing, or a GossipAccept with the partner's digest of its φ. Then the caller
    sends its `tensors` tensors of φ, unless the two digests are the same (the replicas' φ are equal
    to the bit, and the pull between them is zero), then `tensors` of θ − φ; the partner answers
    with its own in the same order and on the same rule. Both sides then apply the same pair update.
    """

    stage: int
    epoch: int
    tensors: int
    phi_digest: str = wire_field(max_len=64, pattern=r"[0-9a-f]{64}")  # SHA-256 of the φ it would send


@message("gossip_ok")
class GossipAccept:
    """Yes to a GossipRequest, with the digest of the φ this replica would send (see GossipRequest)."""

    phi_digest: str = wire_field(max_len=64, pattern=r"[0-9a-f]{64}")


@message("grad_share")
class GradientShare:
    """Between data nodes, before each one's optimizer step `step`: stage 0's gradients, to step on their
    mean (shoal/node/pipeline/data/gradients.py). Followed by the run's outer codec's pieces of
    `tensors` gradients; the reply is an Ack, then (if accepted) the partner's in the same form."""

    step: int = wire_field(ge=0)
    tensors: int = wire_field(ge=0, le=MAX_STAGE_TENSORS)


@message("copy_stage")
class StageCopyRequest:
    """A node joining `stage` asks a live replica for its weights before it serves; a node rebuilding
    a lost stage asks the neighbouring stages' replicas for theirs (CheckFree). `moments`: AdamW's
    moments too (a data node joining others that step stage 0 on one mean gradient, in lockstep)."""

    stage: int
    moments: bool = False


@message("stage_copy")
class StageCopy:
    """The answer to a StageCopyRequest: the replica's counters and last gradient norms (unclipped and
    clipped; None before its first step), then `tensors` tensors of θ and the same number of φ (its
    slow weights), then (if asked) as many of AdamW's first moments and as many second."""

    inner_step: int
    outer_epoch: int
    tensors: int
    grad_norm: float | None = None
    grad_norm_clipped: float | None = None
    # asked for moments: AdamW's step per tensor, and after φ, `tensors` first and second moments each
    adam_steps: tuple[float, ...] = wire_field(
        max_len=MAX_STAGE_TENSORS, item=FieldOptions(ge=0.0, le=1e12), default=()
    )


MAX_BACKUP_CHANGES = 8


@message("backup_pull")
class BackupPull:
    """A keeper of `stage`'s backup (or a node restoring it) asks for the latest snapshot
    (shoal/train/backup_stream.py). `have`: the digest of the snapshot the asker holds of this
    replica's chain ("" for none): a replica whose previous snapshot that is sends only the change."""

    stage: int = wire_field(ge=0, le=MAX_STAGE_TENSORS)
    have: str = wire_field(max_len=64, pattern=r"([0-9a-f]{64})?", default="")


@message("backup")
class BackupSnapshot:
    """The answer to a BackupPull, after an Ack: whose chain the snapshot is of (`source`: the replica
    that took it, which a keeper names when it hands its copy on), its counters, version and digest,
    then `tensors` float32 tensors (`changes` 0: the snapshot whole) or `changes` changes in order,
    each two int8-block pieces a tensor (from the asker's snapshot, a few versions back at most)."""

    source: str = wire_field(max_len=MAX_ID_CHARS, token=True)
    inner_step: int = wire_field(ge=0)
    outer_epoch: int = wire_field(ge=0)
    version: int = wire_field(ge=1)
    digest: str = wire_field(max_len=64, pattern=r"[0-9a-f]{64}")
    tensors: int = wire_field(ge=0, le=MAX_STAGE_TENSORS)
    changes: int = wire_field(ge=0, le=MAX_BACKUP_CHANGES)


MAX_TRANSCRIPT_MICROBATCHES = 1024


@message("transcript_req")
class StepTranscriptRequest:
    """From a data node, after its step: the transcript of your inner step that took this microbatch of
    ours (shoal.train.step_audit). The reply is an Ack (refused with `pending` while that step is not
    taken yet), then a StepTranscriptHeader and its tensors."""

    microbatch_id: str = wire_field(max_len=MAX_ID_CHARS, token=True)


@message("transcript")
class StepTranscriptHeader:
    """One inner step as the replica reports it. Followed by `tensors` tensors each of θ before the
    step, AdamW's first and second moments before it, and θ after it (float32, in the stage's parameter
    order), then per microbatch its input and its output's gradient (float32, `rows[k]` x `seq_lens[k]`
    x the model's residual width), and in a Subspace Network's run its token ids (int64, `rows[k]` x
    `seq_lens[k]`)."""

    step: int = wire_field(ge=0)
    step_count: int = wire_field(ge=0)
    lr_scale: float = wire_field(ge=0.0, le=100.0)
    tensors: int = wire_field(ge=1, le=MAX_STAGE_TENSORS)
    adam_steps: tuple[float, ...] = wire_field(max_len=MAX_STAGE_TENSORS, item=FieldOptions(ge=0.0, le=1e12))
    microbatch_ids: tuple[str, ...] = wire_field(
        max_len=MAX_TRANSCRIPT_MICROBATCHES, item=FieldOptions(max_len=MAX_ID_CHARS, token=True)
    )
    rows: tuple[int, ...] = wire_field(max_len=MAX_TRANSCRIPT_MICROBATCHES, item=FieldOptions(ge=1, le=1 << 16))
    seq_lens: tuple[int, ...] = wire_field(max_len=MAX_TRANSCRIPT_MICROBATCHES, item=FieldOptions(ge=1, le=1 << 20))
    # where the step ran, as `device type:dtype` (e.g. `cpu:float32`): a replay elsewhere
    # differs by more than float noise, so an auditor replays only steps that ran as it would
    compute: str = wire_field(max_len=32, token=True, default="")
