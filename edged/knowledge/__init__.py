"""The knowledge store (Milvus Lite by default): chunks of text with their embeddings. Import
the modules (``edged.knowledge.store``, ``edged.knowledge.text``...): this package loads
nothing, so that the client-side tools, which split text, do not load the store."""
