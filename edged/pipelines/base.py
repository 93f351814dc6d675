"""The pipeline backend: a model whose config says ``backend: "pipeline"``.

A pipeline turns what a client has (text, an encoded image, a WAV file) into tensors, calls the
repository's tensor models by name (its ``*_model`` parameters), and turns their outputs back
into answers. Its version directory holds its assets (tokenizer, character dictionary).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from edged.common.errors import EdgedError, InvalidRequest, ModelLoadError, PayloadTooLarge
from edged.common.live import Live
from edged.config import ModelsConfig
from edged.models.model_config import ModelConfig
from edged.request import RESPONSES, Sequence
from edged.runtimes.base import Steps, Tensors

T = TypeVar("T")
# Elements per request of a pipeline that takes many (texts), unless `max_items` says otherwise.
MAX_ITEMS = 256


class Pipeline:
    """Base class: subclasses implement ``prepare`` (load assets), ``run`` and ``sample``; those
    that can be decoupled ``stream``; the stateful ones (``sequence_batching`` in their
    config, a ``stateful`` class) keep a sequence's state between requests."""

    stateful = False

    def __init__(
        self,
        config: ModelConfig,
        version_dir: Path,
        steps: Steps,
        executor: Executor,
        settings: Live[ModelsConfig],  # as a reload leaves them
    ) -> None:
        self.config = config
        self.version_dir = version_dir
        self.steps = steps
        self.executor = executor
        self.settings = settings

    def step(self, key: str) -> str:
        """The model named by a ``*_model`` parameter."""
        name = self.config.parameters.get(key)
        if not name:
            raise ModelLoadError(f"pipeline '{self.config.name}' needs parameter '{key}'")
        return name

    def limit(self, key: str, default: int, most: int | None = None, least: int = 1) -> int:
        """A positive integer parameter of the model's config (a per-request limit), at least
        ``least``, at most ``most`` where a larger one would take what the device does not
        have."""
        raw = self.config.parameters.get(key, str(default))
        if not raw.isascii() or not raw.isdigit() or not least <= int(raw) <= (most or int(raw)):
            bound = f"between {least} and {most}" if most else f">= {least}"
            raise ModelLoadError(f"model '{self.config.name}': parameter {key} must be {bound}")
        return int(raw)

    def texts(self, inputs: Tensors, name: str = "text") -> list[str]:
        """The strings of a BYTES input, at most ``max_items`` of them."""
        texts = texts_of(name, inputs[name])
        limit = self.limit("max_items", MAX_ITEMS)
        if len(texts) > limit:
            raise InvalidRequest(
                f"input '{name}' has {len(texts)} elements; model '{self.config.name}' takes at"
                f" most {limit} per request (its max_items parameter)"
            )
        return texts

    def asset(self, filename: str) -> Path:
        """A file of this version's directory, which must exist."""
        path = self.version_dir / filename
        if not path.is_file():
            raise ModelLoadError(f"pipeline '{self.config.name}' needs {path}")
        return path

    async def offload(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run CPU-bound pre/post-processing in the executor, off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    async def load(self) -> None:
        """Load the assets, then warm up with a real sample so the first request is not slow;
        on a failure, what was loaded is released (``unload``: the repository will not call
        it for a pipeline that never loaded)."""
        try:
            await self._load()
        except BaseException:
            await self.unload()
            raise

    async def _load(self) -> None:
        try:
            await self.offload(self.prepare)
        except EdgedError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"pipeline '{self.config.name}': {exc}") from None
        sample = self.sample()
        if sample is not None:
            try:
                if self.config.decoupled:
                    await self.stream(sample, {}, _discard, self.warm_sequence())
                else:
                    await self.run(sample, {})
            except EdgedError as exc:
                raise ModelLoadError(f"warm-up failed: {exc.message}") from None

    def prepare(self) -> None:
        """Load assets (runs in the executor)."""

    def sample(self) -> Tensors | None:
        """A request used to warm up, or None."""
        return None

    async def infer(self, inputs: Tensors, parameters: Mapping[str, Any]) -> Tensors:
        """Run one request. A decoupled model sends its responses to the stream that called
        it and answers with no outputs of its own; called otherwise, it is refused."""
        if not self.config.decoupled:
            return await self.run(inputs, parameters)
        sink = RESPONSES.get()
        if sink is None or sink.model != self.config.name:
            raise InvalidRequest(
                f"model '{self.config.name}' is decoupled (zero or many responses per"
                " request): call it on a stream, gRPC ModelStreamInfer"
            )
        sink.taken = True
        version = self.version_dir.name
        sequence = None
        idle_s = self.config.sequence_idle_s
        if idle_s is not None:
            if sink.sequences is None:
                raise InvalidRequest(f"model '{self.config.name}' is stateful: call it on a stream")
            sequence = sink.sequences.take(self.config.name, parameters, idle_s)

        async def send(outputs: Tensors) -> None:
            await sink.send(version, outputs)

        token = RESPONSES.set(None)  # the models it calls answer it, not the stream
        try:
            await self.stream(inputs, parameters, send, sequence)
        finally:
            RESPONSES.reset(token)
        return {}

    async def run(self, inputs: Tensors, parameters: Mapping[str, Any]) -> Tensors:
        """Subclasses: the pipeline itself."""
        raise NotImplementedError

    async def stream(
        self,
        inputs: Tensors,
        parameters: Mapping[str, Any],
        send: Callable[[Tensors], Awaitable[None]],
        sequence: Sequence | None,
    ) -> None:
        """Subclasses that can be decoupled: the pipeline, sending each response as it is
        ready. A stateful one (``sequence_batching``) keeps what it needs between the requests
        of a sequence in ``sequence.state``; ``sequence.end`` says this request is the last."""
        raise NotImplementedError

    def warm_sequence(self) -> Sequence | None:
        """The sequence a stateful pipeline warms up in: one that starts and ends."""
        if self.config.sequence_idle_s is None:
            return None
        return Sequence(0, end=True)

    async def unload(self) -> None:
        """Pipelines hold only small assets; nothing to release."""

    def metadata(self) -> dict[str, Any]:
        """The models this pipeline calls."""
        return {"steps": {k: v for k, v in self.config.parameters.items() if k.endswith("_model")}}


class LiveAudio(Pipeline):
    """What the stateful audio pipelines share: a chunk of live 16 kHz mono 16-bit samples
    per request of a sequence (``pcm`` INT16 [-1]), at most ``max_chunk_seconds`` long."""

    stateful = True
    RATE = 16000
    MAX_CHUNK_SECONDS = 10

    def sample(self) -> Tensors:
        """Half a second of silence."""
        return {"pcm": np.zeros(self.RATE // 2, dtype=np.int16)}

    def chunk(self, inputs: Tensors) -> np.ndarray:
        """The request's samples; PayloadTooLarge over ``max_chunk_seconds``."""
        pcm = inputs["pcm"].reshape(-1)
        limit = self.limit("max_chunk_seconds", self.MAX_CHUNK_SECONDS)
        if pcm.size > limit * self.RATE:
            raise PayloadTooLarge(
                f"input 'pcm' holds {pcm.size} samples; at most {limit * self.RATE} ({limit} s"
                f" at {self.RATE} Hz) per request: send shorter chunks"
            )
        return pcm


async def _discard(outputs: Tensors) -> None:
    """A warm-up's responses go nowhere."""


def texts_of(name: str, array: np.ndarray) -> list[str]:
    """Decode a BYTES tensor of UTF-8 strings."""
    out = []
    for i, item in enumerate(array.reshape(-1)):
        try:
            out.append(item.decode("utf-8") if isinstance(item, bytes) else str(item))
        except UnicodeDecodeError:
            raise InvalidRequest(f"input '{name}' element {i} is not valid UTF-8") from None
    return out


def single_blob(name: str, array: np.ndarray) -> bytes:
    """The one element of a BYTES tensor of shape [1] (an encoded file)."""
    flat = array.reshape(-1)
    if flat.size != 1:
        raise InvalidRequest(f"input '{name}' must hold exactly one element, got {flat.size}")
    item = flat[0]
    return item if isinstance(item, bytes) else str(item).encode("utf-8")


def parameter(
    parameters: Mapping[str, Any], key: str, default: float, low: float, high: float
) -> float:
    """A numeric request parameter within bounds, or InvalidRequest naming it."""
    value = parameters.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise InvalidRequest(f"parameter '{key}' must be a number from {low} to {high}")
    return float(value)
