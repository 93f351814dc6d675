#!/usr/bin/env python3
"""``make mutation`` (issue 32): mutation testing of the pure core with mutmut, and what it
says per module.

mutmut (``[tool.mutmut]`` in pyproject.toml) copies ``edged/`` and ``cloudsync/`` into
``mutants/``, makes every mutant of the modules in ``only_mutate``, and runs each against the
unit tests that cover the function it changes (hypothesis with the ``mutation`` profile of
tests/conftest.py: fewer examples, the same each run). This script runs it, then prints a table
per module (mutants, killed, survived, equivalent, score) and every survivor with its diff. A
survivor listed in tests/mutation/equivalent.toml (its function, the lines it changes, and why
no test can tell it from the original) counts as equivalent, not as a miss, and so does one
that only changes the case of an SQL text (case_of_sql); the score is the killed share of the
rest. Log calls are not mutated (pyproject's do_not_mutate_patterns). Exit 1 when a module
scores under ``--floor`` (85%).

    .venv/bin/python tests/mutation/run.py                 # all of them (make mutation)
    .venv/bin/python tests/mutation/run.py --module edged/routing/decide.py --keep
    .venv/bin/python tests/mutation/run.py --no-run          # the last run's table again
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = Path(__file__).with_name("equivalent.toml")
KILLED = {1, 3, 36, 24, -24, 152, 255, 37}  # test failures, timeouts (an endless loop is caught)
# Where a module is more than its pure core, the functions that are (mutmut's names less the
# module: x_function, xǁClassǁmethod); the rest of it is neither run nor counted.
SCOPE = {
    # admission: queue policies, priority levels, deadlines, the wait estimate, refusals and
    # expiry (forming batches and running them is the runtime's part, tested end to end)
    "edged/scheduler.py": [
        "xǁSettingsǁfrom_config",
        "xǁSchedulerǁ_wait_estimate",
        "xǁSchedulerǁ_retry_after",
        "xǁSchedulerǁ_level",
        "xǁSchedulerǁ_deadline",
        "xǁSchedulerǁsubmit",
        "xǁSchedulerǁ_remove",
        "xǁSchedulerǁ_expire",
        "xǁSchedulerǁ_expire_due",
        "xǁSchedulerǁdepth",
        "xǁSchedulerǁ_at",
        "xǁ_Estimateǁadd",
    ],
    # the gates (the figures are the rollouts' SQL: cloudsync/fleet/rollouts.py, all of it)
    "cloudsync/fleet/gates.py": ["x_breached", "x_pick"],
}


@dataclass
class Module:
    path: str
    killed: int = 0
    survived: list[str] = field(default_factory=list)
    equivalent: list[str] = field(default_factory=list)
    unchecked: int = 0

    @property
    def total(self) -> int:
        return self.killed + len(self.survived) + len(self.equivalent)

    @property
    def score(self) -> float:
        judged = self.killed + len(self.survived)
        return self.killed / judged if judged else 1.0


def modules() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    return list(config["only_mutate"])


def dotted(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def function_of(mutant: str) -> str:
    """The mutated function's name: the mutant's less its number."""
    return re.sub(r"__mutmut_\d+$", "", mutant)


def changed(diff: str) -> tuple[str, str]:
    """The lines a mutant removes and adds, each stripped and joined: how the allow-list names
    it (the same when mutmut numbers its mutants otherwise)."""
    lines = diff.splitlines()[2:]  # after the --- and +++ header
    removed = " / ".join(x[1:].strip() for x in lines if x.startswith("-"))
    added = " / ".join(x[1:].strip() for x in lines if x.startswith("+"))
    return removed, added


SQL_WORDS = (
    "SELECT|INSERT|UPDATE|DELETE|WITH|CREATE|ON CONFLICT|FROM|WHERE|ORDER BY|LEFT JOIN"
    "|JOIN|AND|OR|SET|VALUES|LIMIT|GROUP BY|CASE|WHEN|THEN|ELSE|END"
)
SQL = re.compile(rf"^\W*({SQL_WORDS})\b", re.I)


def case_of_sql(removed: str, added: str) -> bool:
    """A mutant that changes only the case of an SQL text with no quoted value in it: SQL's
    keywords and (unquoted) names are case-insensitive in SQLite and PostgreSQL alike."""
    if removed == added or removed.lower() != added.lower() or "'" in removed:
        return False
    strings = re.findall(r'"([^"]*)"', removed)
    return bool(strings) and all(SQL.match(x) for x in strings if x.lower() != x.upper())


def allowed() -> dict[tuple[str, str, str], str]:
    entries = tomllib.loads(ALLOWED.read_text()).get("equivalent", [])
    return {(e["function"], e["removed"], e["added"]): e["why"] for e in entries}


def patterns(path: str) -> list[str]:
    """mutmut's names of the mutants of ``path`` that count."""
    scope = SCOPE.get(path)
    if scope is None:
        return [f"{dotted(path)}.*"]
    return [f"{dotted(path)}.{function}__mutmut_*" for function in scope]


def counts(path: str, name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns(path))


def run(patterns: list[str], workers: int) -> float:
    started = time.monotonic()
    command = [sys.executable, "-m", "mutmut", "run", f"--max-children={workers}", *patterns]
    subprocess.run(command, cwd=ROOT, check=False, env={**os.environ, "EDGED_MUTATION": "1"})
    return time.monotonic() - started


def results(paths: list[str]) -> dict[str, Module]:
    """Every mutant of ``paths`` as the last run left it, judged against the allow-list."""
    os.chdir(ROOT)  # mutmut's own paths are relative to the repository
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    known = allowed()
    used: set[tuple[str, str, str]] = set()
    found: dict[str, Module] = {}
    for path in paths:
        module = found[path] = Module(path)
        meta = ROOT / "mutants" / f"{path}.meta"
        if not meta.exists():
            continue
        codes: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"]
        for name, code in sorted(codes.items()):
            if not counts(path, name):
                continue
            if code is None:
                module.unchecked += 1
            elif code in KILLED:
                module.killed += 1
            else:  # survived (0), no test covers it (33), or anything else
                key = (function_of(name), *changed(get_diff_for_mutant(name, path=path)))
                if case_of_sql(key[1], key[2]):
                    module.equivalent.append(name)
                elif key in known:
                    used.add(key)
                    module.equivalent.append(name)
                else:
                    module.survived.append(name)
    stale = [k for k in known if k not in used and any(k[0].startswith(dotted(p)) for p in paths)]
    for key in stale:
        print(f"allow-list entry that matched no survivor (remove it): {key}", file=sys.stderr)
    return found


def report(found: dict[str, Module], floor: float, seconds: float | None) -> bool:
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    print(f"\n{'MODULE':34} {'MUTANTS':>7} {'KILLED':>6} {'SURVIVED':>8} {'EQUIV':>5} {'SCORE':>6}")
    ok = True
    for module in found.values():
        low = module.score < floor
        ok = ok and not low and module.unchecked == 0
        unchecked = f"  ({module.unchecked} not checked)" if module.unchecked else ""
        print(
            f"{module.path:34} {module.total:7d} {module.killed:6d} {len(module.survived):8d}"
            f" {len(module.equivalent):5d} {module.score:6.1%}{'  < floor' if low else ''}"
            f"{unchecked}"
        )
    if seconds is not None:
        print(f"mutmut run: {seconds / 60:.1f} min")
    for module in found.values():
        for name in module.survived:
            print(f"\nSURVIVED {name}")
            print("\n".join(get_diff_for_mutant(name, path=module.path).splitlines()[2:]))
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", help="only this module (repeat)")
    parser.add_argument("--no-run", action="store_true", help="report the last run only")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep mutants/ from the last run"
        " (faster; mutmut may keep a survivor's old result after tests change)",
    )
    parser.add_argument("--floor", type=float, default=0.85)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args(argv)
    paths = args.module or modules()
    unknown = set(paths) - set(modules())
    if unknown:
        parser.error(f"not in [tool.mutmut] only_mutate: {', '.join(sorted(unknown))}")
    seconds = None
    if not args.no_run:
        if not args.keep:
            shutil.rmtree(ROOT / "mutants", ignore_errors=True)
        seconds = run([p for path in paths for p in patterns(path)], args.workers)
    return 0 if report(results(paths), args.floor, seconds) else 1


if __name__ == "__main__":
    sys.exit(main())
