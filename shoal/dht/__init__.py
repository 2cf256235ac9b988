"""The swarm's DHT: keys, signed and schema-checked records, and reading a SwarmView."""
