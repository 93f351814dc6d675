"""The fleet protocol, which the device agent and the fleet side both import (and nothing else
of cloudsync): topics, the envelope, the MQTT client setup, signed commands, model manifests and
the telemetry records made of edged's metrics (docs/PROTOCOL.md)."""
