"""The fleet's PKI for every cloudsync integration test (test_cloudsync.py defines it)."""

from tests.integration.cloudsync.test_cloudsync import pki  # noqa: F401
