"""The knowledge store (Milvus Lite by default): chunks of text with their embeddings."""

from edged.knowledge.store import Chunk, Hit, KnowledgeStore, content_id
from edged.knowledge.text import chunk_markdown, chunk_text

__all__ = ["Chunk", "Hit", "KnowledgeStore", "chunk_markdown", "chunk_text", "content_id"]
