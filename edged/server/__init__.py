"""The local API: a transport-agnostic data plane and the transports over it."""
