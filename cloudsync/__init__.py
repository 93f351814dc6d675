"""cloudsync: the agent that keeps an edged device in its fleet over MQTT (docs/PROTOCOL.md)."""

__version__ = "0.1.0"
