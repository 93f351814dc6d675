"""Pipelines: pre/post-processing around the repository's tensor models (text, image, audio in)."""
