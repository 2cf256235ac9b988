"""Bundled run configs (TOML), loadable by name: `shoal train --local --run tiny`."""
