"""Who calls the fleet service, and what the API and the console both do on a caller's behalf.

Both adapters (``api.py``, JSON; ``console.py``, HTML pages) find the caller in the same
``[api] tokens`` and act through the same functions here: each action checked, done and
audited, or refused with a status and the reason (``Refused``, audited too), which each adapter
answers in its own form. The database is called from the thread pool (``db``), never from the
event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from aiohttp import web

from cloudsync.fleet.audit import AuditLog
from cloudsync.fleet.config import Token
from cloudsync.fleet.enrolment import Decision, Enrolments
from cloudsync.fleet.registry import Registry
from cloudsync.fleet.rollouts import Conflict, Rollout, Rollouts
from cloudsync.protocol.labels import LabelError, check_labels
from cloudsync.protocol.topics import NAME

ROLES = {"viewer": 0, "operator": 1, "admin": 2}
WHO = web.RequestKey("who", Token)  # the caller, where both adapters' guards put it
ROLLOUT_ACTIONS = ("pause", "resume", "promote", "abort")


class Refused(Exception):
    """An action or a request refused: the status to answer and what was wrong."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


async def db(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` on the thread pool (the database never blocks the event loop)."""
    return await asyncio.get_running_loop().run_in_executor(None, partial(fn, *args, **kwargs))


class Actions:
    """Over the ``[api] tokens``, the audit log, the registry (labels) and the rollouts; with
    the runner's ``reconcile`` (some nodes at its next turn) and ``wake`` (a turn now)."""

    def __init__(
        self,
        tokens: Iterable[Token],
        audit: AuditLog,
        registry: Registry,
        rollouts: Rollouts,
        reconcile: Callable[[set[str]], None],
        wake: Callable[[], None],
    ) -> None:
        self.tokens: dict[str, Token] = {t.sha256: t for t in tokens}
        self.audit_log, self.registry, self.rollouts = audit, registry, rollouts
        self.reconcile, self.wake = reconcile, wake

    # ---- who calls -------------------------------------------------------------------------

    def holder(self, token: str) -> Token | None:
        """Whose token this is (a bearer's, or the one signed in to the console), or None."""
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        for known, who in self.tokens.items():  # constant time, whichever matches
            if hmac.compare_digest(known, digest):
                return who
        return None

    def named(self, name: str) -> Token | None:
        """The ``[api] tokens`` entry of ``name`` (a console session's holder), or None."""
        return next((who for who in self.tokens.values() if who.name == name), None)

    async def audit(
        self, who: Token, action: str, target: str, outcome: str, detail: Any = None
    ) -> None:
        await db(self.audit_log.add, who, action, target, outcome, detail)

    async def refuse(
        self, who: Token, action: str, target: str, status: int, message: str
    ) -> Refused:
        """The refusal, audited (the caller raises it)."""
        await self.audit(who, action, target, f"refused: {message}")
        return Refused(status, message)

    # ---- actions ---------------------------------------------------------------------------

    async def set_labels(self, who: Token, node: str, given: Any) -> dict[str, str]:
        """The operators' labels of ``node`` set (all of them), audited."""
        action = "set labels"
        try:
            labels = check_labels(given)
        except LabelError as exc:
            raise await self.refuse(who, action, node, 422, str(exc)) from None
        if not await db(self.registry.set_labels, node, labels):
            raise await self.refuse(who, action, node, 404, "no such node")
        await self.audit(who, action, node, "done", labels)
        self.reconcile({node})
        return labels

    async def act_on_rollout(self, who: Token, ident: str, action: str) -> Rollout:
        """A rollout paused, resumed, promoted or aborted, audited."""
        if action not in ROLLOUT_ACTIONS:
            raise await self.refuse(
                who,
                f"{action[:32]} rollout",
                ident,
                404,
                "an action: pause, resume, promote or abort",
            )
        try:
            done: Rollout = await db(self.rollouts.act, ident, action, who.name)
        except KeyError:
            raise await self.refuse(
                who, f"{action} rollout", ident, 404, "no such rollout"
            ) from None
        except Conflict as exc:
            raise await self.refuse(who, f"{action} rollout", ident, 409, str(exc)) from None
        await self.audit(who, f"{action} rollout", ident, "done")
        self.wake()
        return done


class EnrolmentActions:
    """New devices' requests decided, a node revoked and reinstated: what the API's enrolment
    routes and the console's pages both do, each checked, done and audited here (or refused,
    audited). ``answer`` tells a device its decision, ``write_broker_files`` writes the
    broker's CRL and ACL again (never raises: the files not written), ``kick`` takes over a
    revoked node's open session."""

    def __init__(
        self,
        actions: Actions,
        enrolments: Enrolments,
        clock: Callable[[], int],
        answer: Callable[[Decision], bool],
        write_broker_files: Callable[[], list[str]],
        kick: Callable[[str], None],
    ) -> None:
        self.actions, self.enrolments, self.clock, self.answer = actions, enrolments, clock, answer
        self.write_broker_files, self.kick = write_broker_files, kick

    async def decide(self, who: Token, rid: str, decision: str) -> str:
        """A pending request approved or refused: its state after."""
        if decision not in ("approve", "refuse"):
            raise await self.actions.refuse(
                who, f"{decision[:32]} enrolment", rid, 404, "a decision: approve or refuse"
            )
        action = f"{decision} enrolment"
        if self.enrolments.issuer is None:
            why = "no [enrolment] ca_cert and ca_key: nothing can be issued"
            raise await self.actions.refuse(who, action, rid, 409, why)
        done = await db(self.enrolments.decide, rid, decision == "approve", who.name, self.clock())
        if done is None:
            raise await self.actions.refuse(who, action, rid, 404, "no such request pending")
        self.answer(done)
        await self.actions.audit(who, action, rid, "done")
        return str(done.answer.state)

    async def revoke(
        self, who: Token, node: str | None, serial: str | None, target: str
    ) -> dict[str, Any]:
        """A node's certificates (or one, by serial) into the CRL at once, its name barred
        (by name), its open session taken over."""
        action = "revoke certificate"
        if node is not None and not NAME.match(node):  # it is written into the broker's ACL
            raise await self.actions.refuse(
                who, action, target[:64], 404, "node: not a node's name"
            )
        if self.enrolments.issuer is None:
            why = "no [enrolment] ca_cert and ca_key: no CRL can be signed"
            raise await self.actions.refuse(who, action, target, 409, why)
        done = await db(self.enrolments.revoke, who.name, self.clock(), node, serial)
        unwritten = await db(self.write_broker_files)  # each file tried; never raises
        if node:  # an open session goes at once (the service takes it over)
            self.kick(node)
        await self.actions.audit(
            who, action, target, "done", {"serials": done, "unwritten": unwritten}
        )
        return {"revoked": done, "unwritten": unwritten}

    async def reinstate(self, who: Token, node: str) -> dict[str, Any]:
        """The bar a revocation by name put on ``node`` lifted: it may enrol again."""
        action = "reinstate node"
        if not NAME.match(node):
            raise await self.actions.refuse(who, action, node[:64], 404, "node: not a node's name")
        if not await db(self.enrolments.reinstate, node):
            raise await self.actions.refuse(who, action, node, 404, "node: not revoked")
        unwritten = await db(self.write_broker_files)  # each file tried; never raises
        await self.actions.audit(who, action, node, "done", {"unwritten": unwritten})
        return {"node": node, "barred": False, "unwritten": unwritten}
