"""Shared test helpers: tiny configs, in-process text, process launchers."""
