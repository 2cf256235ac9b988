"""The wire protocol version, and the rule that says which peers can talk to each other.

Only one number travels: the envelope's ``"v"`` is the major version. Decoders refuse unknown fields,
so any change to an existing message (a field added, removed, retyped or re-bounded) breaks older
peers and must bump ``PROTOCOL_VERSION``. Adding a *new* message type does not: an older peer answers
``UnknownMessageType`` for a tag it has never seen, which the sender can handle.
"""

from __future__ import annotations

# 16: node records announce a block-stage replica's latest backup snapshot (version, counters, digest);
# stage backups travel as snapshots and int8 changes (backup_pull / backup messages);
# 15: node records list the relays a node is reached through and whether it relays for others;
# 14: a node record's repair may name the rule `checkpoint` (an imported run's stage from its checkpoint);
# 13: a node record's repair may name the rule `backup` (a stage restored from a neighbour's backup);
# 12: a worker's Ack to a forward may carry its load and onward cost (GWTF's hop-by-hop routing);
# 11: forward and recompute requests may carry the microbatch's token ids (a Subspace Network's run);
# 10: forward and backward requests carry each hop's planned start (SkipPipe's shared timetable);
# 9: node records carry their device (kind, name, memory, tokens/s, precision) and a placement note;
# 8: the decoder's rotary layout is Hugging Face's LLaMA one (channels i and i + hd/2 rotate
# together): a peer of 7 computes another function of the same weights;
# 7: an abandon notice carries its kind (`stage_lost`, `backward`, ...) beside its text;
# 6: rollout bundles may carry the sender's claimed rewards (never read by a defended receiver);
# 5: records are signed by the libp2p key (a node record's peer id must be its signer's), run records
# carry their publisher's claim, pipeline ids are tokens (ASCII letters, digits and . _ : # @ -);
# 4: node records declare a model id (GRPO rollout workers); 3: stage copies carry gradient norms,
# node records a repair; 2: `waiting_for`, recompute, step close
PROTOCOL_VERSION = 16


def is_compatible(version: object) -> bool:
    """Same major version = compatible. ``True`` is not the version 1 (bool is not int on the wire)."""
    return type(version) is int and version == PROTOCOL_VERSION
