"""The DHT record validator every shoal peer runs.

It runs after hivemind's RSASignatureValidator (which checks that a value stored under a subkey
`[owner:<key>]` is signed by that key) and checks what the signature cannot:
  - the value is a shoal record that passes its strict schema;
  - the record sits under the key its content names (a node record of run R under R's nodes key,
    a run config under its own name), so nobody can plant records under someone else's key name;
  - a run config's `run_id` is the hash of the config it carries, and the config itself is valid;
  - the subkey carries an owner key, so every shoal value is signed;
  - a node record names the peer that signed it: its `peer_id` is the libp2p peer id of the owner
    key (one key is both, see identity.py), so nobody can announce a record for another peer;
  - a run record carries a valid claim by its publisher's key (runs.py), whoever republishes it.
Anything else is refused: this DHT holds shoal records only.
"""

from __future__ import annotations

import functools
import logging
import re

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from shoal.config import ConfigError, parse_run_config
from shoal.dht.identity import peer_id_of
from shoal.dht.keys import DEFAULT_RUN_KEY, key_id, nodes_key, run_key
from shoal.dht.records import NodeRecord, RunRecord, load_record
from shoal.dht.runs import verify_claim

logger = logging.getLogger(__name__)

_OWNER_KEY = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)  # the pattern the signature check reads


def owner_key(subkey: bytes | None) -> bytes:
    """The one owner public key in a (serialized) subkey: the key whose signature hivemind checked."""
    keys = set(_OWNER_KEY.findall(subkey or b""))
    if len(keys) != 1:
        raise ValueError("record has no single owner subkey")
    return keys.pop()


class ShoalRecordValidator(RecordValidatorBase):
    def validate(self, record: DHTRecord) -> bool:
        try:
            self._check(record)
        except Exception as e:  # every failure, whatever its type, is a refusal and a log line
            logger.info("refused DHT record: %s", e)
            return False
        return True

    def _check(self, record: DHTRecord) -> None:
        owner = owner_key(record.subkey)
        value = MSGPackSerializer.loads(record.value)
        kind = value.get("kind") if isinstance(value, dict) else None
        if kind == "node":
            node = load_record(NodeRecord, value)
            if record.key != key_id(nodes_key(node.run_id)):
                raise ValueError(f"node record of run {node.run_id} under a foreign key")
            signer = peer_id_of(owner)
            if node.peer_id != signer:
                raise ValueError(f"node record names peer {node.peer_id} but is signed by peer {signer}")
        elif kind == "run":
            check_run_record(record.key, record.value)
        else:
            raise ValueError(f"not a shoal record (kind={kind!r})")

    @property
    def priority(self) -> int:
        return 0  # after the signature check (priority 10), which strips the signature for us


@functools.lru_cache(maxsize=64)
def check_run_record(key: bytes, value: bytes) -> None:
    """A run record is read on every view refresh, by every peer, and checking one parses its whole
    run config and verifies a signature: the verdict on the same bytes under the same key is kept
    (a refusal raises, so only records that passed are)."""
    record = MSGPackSerializer.loads(value)
    run = load_record(RunRecord, record)
    if key not in (key_id(run_key(run.name)), key_id(DEFAULT_RUN_KEY)):
        raise ValueError(f"run record {run.name!r} under a foreign key")
    try:
        config = parse_run_config(run.toml, source="published run config")
    except ConfigError as e:
        raise ValueError(f"invalid run config: {e}") from None
    if config.run_id != run.run_id or config.name != run.name:
        raise ValueError(f"run config does not hash to its run id {run.run_id}")
    verify_claim(record)
