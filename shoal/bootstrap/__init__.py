"""The bootstrap peer: a DHT peer with a stable identity and address, holding no model."""
