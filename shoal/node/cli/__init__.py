"""The node's commands: `shoal node`, `shoal status`, `shoal health`, and the runtime that runs a daemon."""
