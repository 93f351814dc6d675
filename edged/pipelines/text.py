"""Text pipelines: sentence embeddings (tokenizer + encoder) and intent (embedding + classifier)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from edged.pipelines.base import Pipeline
from edged.runtimes.base import Tensors

# Longest input in tokens; MiniLM was trained on 256 word pieces.
MAX_TOKENS = 256
# A text is tokenized from its head: the first HEAD_CHARS characters (cut at a space), more
# only when they hold fewer than MAX_TOKENS tokens. The tokenizer reads a text whole before it
# truncates, keeping the rest as overflow: 256 texts of 16 KB held hundreds of MiB for tokens
# that are thrown away (issue 44).
HEAD_CHARS = 8 * MAX_TOKENS
# Tokens in one call of the encoder: its attention is rows x heads x tokens^2 floats, so 64 rows
# of 256 tokens took 1.5 GiB, which ONNX Runtime's arena kept. Rows per call shrink as texts
# grow (64 of 32 tokens, 16 of 256).
TOKENS_PER_CALL = 4096


def _sample_text() -> Tensors:
    return {"text": np.array([b"edged warms up this model."], dtype=object)}


async def _batched(
    pipeline: Pipeline, model: str, feeds: Tensors, output: str, most: int = 0
) -> np.ndarray:
    """Call ``model`` in slices no larger than its max_batch_size (and ``most`` rows, if
    given) and stack the results."""
    rows = len(next(iter(feeds.values())))
    limit = min(pipeline.steps.config_of(model).max_batch_size or rows, most or rows)
    parts = []
    for start in range(0, rows, limit):
        part = {k: v[start : start + limit] for k, v in feeds.items()}
        parts.append((await pipeline.steps.call(model, part))[output])
    return np.concatenate(parts)


class TextEmbedding(Pipeline):
    """Text in, L2-normalised sentence embeddings out."""

    tokenizer: Tokenizer

    def prepare(self) -> None:
        """Load the tokenizer; pad to the longest text of a request (rounded up to the
        ``pad_to_multiple_of`` parameter, so that requests batch together), not to a fixed
        length."""
        self.tokenizer = Tokenizer.from_file(str(self.asset("tokenizer.json")))
        # The shipped tokenizer.json pads every input to 128 tokens: 5x slower for short texts.
        multiple = self.limit("pad_to_multiple_of", 1)
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]", pad_to_multiple_of=multiple)
        self.tokenizer.enable_truncation(MAX_TOKENS)

    def sample(self) -> Tensors:
        """One short sentence."""
        return _sample_text()

    def head(self, text: str) -> str:
        """The start of ``text`` that holds its first MAX_TOKENS tokens: cut after a whole
        word, so that its tokens are the text's own first ones."""
        size = HEAD_CHARS
        while len(text) > size:
            cut = text[:size]
            space = cut.rfind(" ", size // 2)
            cut = cut[:space] if space > 0 else cut
            if len(self.tokenizer.encode(cut).ids) >= MAX_TOKENS:
                return cut
            size *= 4
        return text

    def tokenize(self, texts: list[str]) -> Tensors:
        """Token ids, attention mask and token types as int64 [batch, tokens]."""
        encodings = self.tokenizer.encode_batch([self.head(t) for t in texts])
        return {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }

    async def run(self, inputs: Tensors, parameters: Mapping[str, Any]) -> Tensors:
        """Embed each text of the ``text`` input."""
        encoder = self.step("encoder_model")
        texts = self.texts(inputs)
        if not texts:
            dim = self.config.outputs[0].dims[-1] if self.config.outputs else 0
            return {"embedding": np.zeros((0, max(dim, 0)), dtype=np.float32)}
        feeds = await self.offload(self.tokenize, texts)
        output = self.steps.config_of(encoder).outputs[0].name
        most = max(1, TOKENS_PER_CALL // feeds["input_ids"].shape[1])
        return {"embedding": await _batched(self, encoder, feeds, output, most)}


class Intent(Pipeline):
    """Text in, the most likely intent label and its probability out."""

    def sample(self) -> Tensors:
        """One short sentence."""
        return _sample_text()

    async def run(self, inputs: Tensors, parameters: Mapping[str, Any]) -> Tensors:
        """Classify each text of the ``text`` input."""
        embedder = self.step("embedding_model")
        classifier = self.step("classifier_model")
        texts = self.texts(inputs)
        if not texts:
            return {"intent": np.zeros(0, dtype=object), "score": np.zeros(0, dtype=np.float32)}
        embedding = (await self.steps.call(embedder, {"text": inputs["text"]}))["embedding"]
        spec = self.steps.config_of(classifier)
        output = spec.outputs[0].name
        scores = await _batched(self, classifier, {spec.inputs[0].name: embedding}, output)
        labels = self.steps.labels_of(classifier, output)
        best = scores.argmax(axis=1)
        names = np.empty(len(best), dtype=object)
        names[:] = [(labels[i] if i < len(labels) else str(i)).encode() for i in best]
        return {"intent": names, "score": scores.max(axis=1).astype(np.float32)}
