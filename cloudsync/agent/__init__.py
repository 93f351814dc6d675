"""The device agent (``cloudsync``): runs on every node beside edged. Its MQTT session, edged's
reader, the command handlers, the outbox, model delivery, the local API and its own metrics
and alerts. It imports the protocol and edged's client, never the fleet side."""
