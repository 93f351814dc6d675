"""edged: hybrid edge/cloud inference daemon."""

__version__ = "0.1.0"
