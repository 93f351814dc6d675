"""The runtime contract: a small async interface every backend implements."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from edged.models.model_config import ModelConfig

Tensors = dict[str, np.ndarray]


class Steps(Protocol):
    """What a pipeline may do with the other models of the repository."""

    async def call(self, name: str, inputs: Tensors) -> Tensors:
        """Run the newest ready version of a model."""
        ...

    def config_of(self, name: str) -> ModelConfig:
        """The configuration of a model (to learn its tensor names and batch limit)."""
        ...

    def labels_of(self, name: str, output: str) -> list[str]:
        """The labels of a classification output (its label_filename), or []."""
        ...


class Runtime(Protocol):
    """A loaded model version."""

    async def load(self) -> None:
        """Load and warm up; raise ModelLoadError with the reason when that fails."""

    async def infer(self, inputs: Tensors, parameters: Mapping[str, Any]) -> Tensors:
        """Run one request; inputs were checked against the model's config."""
        ...

    async def unload(self) -> None:
        """Release what load() took."""

    def metadata(self) -> dict[str, Any]:
        """Facts about the runtime for model metadata (e.g. the execution providers in use)."""
        ...
