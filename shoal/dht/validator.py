"""The DHT record validator every shoal peer runs.

It runs after hivemind's RSASignatureValidator (which checks that a value stored under a subkey
`[owner:<key>]` is signed by that key) and checks what the signature cannot:
  - the value is a shoal record that passes its strict schema;
  - the record sits under the key its content names (a node record of run R under R's nodes key,
    a run config under its own name), so nobody can plant records under someone else's key name;
  - a run config's `run_id` is the hash of the config it carries, and the config itself is valid;
  - the subkey carries an owner key, so every shoal value is signed.
Anything else is refused: this DHT holds shoal records only.
"""

from __future__ import annotations

import logging

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from shoal.config import ConfigError, parse_run_config
from shoal.dht.keys import DEFAULT_RUN_KEY, key_id, nodes_key, run_key
from shoal.dht.records import NodeRecord, RunRecord, check_exact

logger = logging.getLogger(__name__)

_OWNER_MARKER = RSASignatureValidator.PUBLIC_KEY_FORMAT.split(b"_key_")[0]


class ShoalRecordValidator(RecordValidatorBase):
    def validate(self, record: DHTRecord) -> bool:
        try:
            self._check(record)
        except Exception as e:  # every failure, whatever its type, is a refusal and a log line
            logger.info("refused DHT record: %s", e)
            return False
        return True

    def _check(self, record: DHTRecord) -> None:
        if not record.subkey or _OWNER_MARKER not in record.subkey:
            raise ValueError("record has no owner subkey")
        value = MSGPackSerializer.loads(record.value)
        kind = value.get("kind") if isinstance(value, dict) else None
        if kind == "node":
            node = check_exact(NodeRecord, value)
            if record.key != key_id(nodes_key(node.run_id)):
                raise ValueError(f"node record of run {node.run_id} under a foreign key")
        elif kind == "run":
            run = check_exact(RunRecord, value)
            if record.key not in (key_id(run_key(run.name)), key_id(DEFAULT_RUN_KEY)):
                raise ValueError(f"run record {run.name!r} under a foreign key")
            try:
                config = parse_run_config(run.toml, source="published run config")
            except ConfigError as e:
                raise ValueError(f"invalid run config: {e}") from None
            if config.run_id != run.run_id or config.name != run.name:
                raise ValueError(f"run config does not hash to its run id {run.run_id}")
        else:
            raise ValueError(f"not a shoal record (kind={kind!r})")

    @property
    def priority(self) -> int:
        return 0  # after the signature check (priority 10), which strips the signature for us
