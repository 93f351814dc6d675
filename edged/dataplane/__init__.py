"""The data plane, below every transport: health, metadata, inference, repository control and
the default models' plain-JSON calls. The REST and gRPC adapters (``edged.server``) and the task
graphs (``edged.tasks``) sit above it; it knows nothing of them."""
