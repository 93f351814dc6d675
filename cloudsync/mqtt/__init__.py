"""The MQTT contract: topics and the envelope (docs/PROTOCOL.md)."""
