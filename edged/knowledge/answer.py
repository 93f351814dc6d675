"""An answer model behind an OpenAI-compatible chat completions endpoint (``knowledge.answer_url``).

vLLM, llama.cpp's server, Ollama, TGI, LiteLLM and the hosted APIs all serve
``POST {base}/chat/completions``. The question and its passages go as one user message after a
system message that asks for an answer from the passages only; ``temperature`` 0. The call has
the request's deadline; any failure is ``Unavailable`` with the endpoint's own words, and the
knowledge service then answers with its best passage. Privacy is decided before this is called
(a private question or passage never reaches it), and checked again here: a call whose routing
context is private is refused.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from edged.common.egress import Ledger, digest
from edged.common.errors import Unavailable
from edged.request import RouteContext, current_route

SYSTEM = (
    "Answer the question from the numbered passages only, in a few sentences. If they do not"
    " hold the answer, say that you do not know."
)
DEFAULT_TIMEOUT_S = 30.0


def chat_messages(question: str, passages: list[str]) -> list[dict[str, str]]:
    """The messages of one question: the instruction, then the passages and the question."""
    numbered = "\n\n".join(f"[{i}] {p}" for i, p in enumerate(passages, start=1))
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Passages:\n{numbered}\n\nQuestion: {question}"},
    ]


class ChatAnswer:
    """Answers from ``{url}/chat/completions`` with ``model``; callable as the service's
    ``Answer``: (question, passages) -> (answer, route, reason)."""

    def __init__(
        self, url: str, model: str, token: str | None = None, ledger: Ledger | None = None
    ) -> None:
        self.url = url.rstrip("/") + "/chat/completions"
        self.model = model
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session: aiohttp.ClientSession | None = None
        self.ledger = ledger  # every question sent, recorded first

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __call__(self, question: str, passages: list[str]) -> tuple[str, str, str]:
        ctx = current_route()
        if ctx is not None and ctx.private:  # the last guard: this endpoint is off the device
            raise Unavailable(
                f"the input is private: nothing is sent to the answer endpoint {self.url}"
            )
        left = ctx.deadline - time.monotonic() if ctx is not None else DEFAULT_TIMEOUT_S
        if left <= 0:
            raise Unavailable("no time is left for the answer model")
        if self._session is None:
            self._session = aiohttp.ClientSession()
        body = {
            "model": self.model,
            "messages": chat_messages(question, passages),
            "temperature": 0,
        }
        data = json.dumps(body).encode()
        entry = self._record(ctx, data)
        started = time.perf_counter()
        try:
            async with self._session.post(
                self.url,
                data=data,
                headers={**self.headers, "Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=left),
            ) as response:
                reply: Any = await response.json(content_type=None)
                if response.status != 200:
                    raise Unavailable(f"{self.url} answered {response.status}: {_error(reply)}")
            answer = reply["choices"][0]["message"]["content"]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise Unavailable(f"{self.url}: {exc or type(exc).__name__}") from None
        except (KeyError, IndexError, TypeError):
            raise Unavailable(f"{self.url} gave no choices[0].message.content") from None
        if not isinstance(answer, str):
            raise Unavailable(f"{self.url} gave an answer that is not text")
        ms = 1000 * (time.perf_counter() - started)
        sent = f" (egress ledger entry {entry})" if entry else ""
        return answer.strip(), "cloud", f"{self.model} at {self.url} in {ms:.0f} ms{sent}"

    def _record(self, ctx: RouteContext | None, data: bytes) -> int | None:
        """The question's bytes in the egress ledger before they leave: the entry's seq (None:
        no ledger; none recorded: not sent)."""
        if self.ledger is None:
            return None
        try:
            head = self.ledger.record(
                "answer-model",
                request_id=ctx.request_id if ctx else "",
                uid=ctx.uid if ctx else None,
                model=self.model,
                endpoint=self.url,
                route="cloud",
                reason="knowledge ask: the answer model",
                labels={"question": "public", "passages": "public"},
                protocol="openai-chat",
                bytes=len(data),
                sha256=digest(data),
            )
        except (OSError, ValueError) as exc:
            raise Unavailable(
                f"the egress ledger cannot record the question ({exc}): it is not sent"
            ) from None
        return head.seq


def _error(reply: Any) -> str:
    """The error message of an OpenAI-style error body, or the body."""
    if isinstance(reply, dict) and isinstance(reply.get("error"), dict):
        return str(reply["error"].get("message", reply["error"]))
    return str(reply)[:200]
