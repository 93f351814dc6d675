"""The knowledge store (Milvus Lite by default): chunks of text with their embeddings."""

from edged.knowledge.store import Chunk, Hit, KnowledgeStore, chunk_text, content_id

__all__ = ["Chunk", "Hit", "KnowledgeStore", "chunk_text", "content_id"]
