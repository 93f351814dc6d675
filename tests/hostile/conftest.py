"""The fleet's fixtures for the adversaries of cloudsync: a real Mosquitto with the fleet's PKI,
and cloudsync as a process (tests/integration/test_cloudsync.py defines them)."""

from tests.integration.test_cloudsync import agent, broker, pki  # noqa: F401
