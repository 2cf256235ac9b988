"""Microbatches through the pipeline: the hop layer both kinds of pipeline engine share."""
