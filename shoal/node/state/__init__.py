"""A node's state on disk (--state-dir): the format and its checks, and the keeper that saves and resumes."""
