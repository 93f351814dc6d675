"""The services the REST adapter offers beside the data plane, handed to it by the composition
root (edged.app): the knowledge store (/v1/kb) and the task graphs (/v1/tasks). Both answer only
once edged is ready (their work needs the models)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from edged.common.errors import Unavailable
from edged.knowledge.service import KnowledgeService
from edged.tasks.run import TaskRunner


@dataclass
class Services:
    check_ready: Callable[[], None]  # the data plane's: Unavailable while starting or stopping
    knowledge: KnowledgeService | None = None
    tasks: TaskRunner | None = None  # replaced whole when a reload changes the templates

    def kb(self) -> KnowledgeService:
        """The knowledge service, once edged is ready (its embeddings need the models)."""
        self.check_ready()
        if self.knowledge is None:
            raise Unavailable("this edged has no knowledge store")
        return self.knowledge

    def task_runner(self) -> TaskRunner:
        """The task graphs' runner, once edged is ready."""
        self.check_ready()
        if self.tasks is None:
            raise Unavailable("this edged runs no task graphs")
        return self.tasks
