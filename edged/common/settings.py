"""What both daemons' configs are made of (edged's and cloudsync's, and the fleet service's):
the strict section base, the sections they share (metrics, the egress ledger, the log format),
and reading a TOML file into a section with each bad key named."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from edged.common.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # JetPack 6 ships Python 3.10
    import tomli as tomllib

LogFormat = Literal["auto", "journal", "json", "text"]


class Section(BaseModel):
    """A config section: unknown keys are errors, values are checked on assignment too. A key
    of ``RENAMED`` (old name -> new name) is read as its new name for a release, and noted
    (``renamed``); both names at once are an error."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    RENAMED: ClassVar[dict[str, str]] = {}
    _renamed: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _old_names(cls, data: Any, handler: ModelWrapValidatorHandler[Section]) -> Section:
        notes = []
        if cls.RENAMED and isinstance(data, dict):
            data = dict(data)
            for old, new in cls.RENAMED.items():
                if old not in data:
                    continue
                if new in data:
                    raise PydanticCustomError(
                        "renamed",
                        "{old} and {new}: {old} is the old name of {new}; keep {new}",
                        {"old": old, "new": new},
                    )
                data[new] = data.pop(old)
                notes.append((old, new))
        section = handler(data)
        if notes:
            section._renamed = [
                f"{old} is now {new}: rename it (the old name is read in this release only)"
                for old, new in notes
            ]
        return section


def renamed(section: BaseModel, where: str = "") -> list[str]:
    """What a config file said by an old name (``Section.RENAMED``), in every section."""
    notes = [where + note for note in getattr(section, "_renamed", None) or []]
    for name, value in section:
        if isinstance(value, BaseModel):
            notes += renamed(value, f"{where}{name}.")
    return notes


class MetricsConfig(Section):
    """Prometheus metrics: always at GET /metrics on the socket; optionally on TCP."""

    port: int = Field(0, ge=0, le=65535, description="TCP port for /metrics (0: none)")
    address: str = Field("127.0.0.1", description="address of that port (loopback by default)")


class EgressConfig(Section):
    """The egress ledger (edged/egress.py): what left the device, recorded before it left."""

    enabled: bool = Field(
        True,
        description="record every call that sends data off the device; turning it off (only"
        " here) is itself recorded in the ledger",
    )
    directory: Path | None = Field(
        None, description="where the ledger's segments are (default: state_dir/egress)"
    )
    segment_mb: float = Field(16.0, gt=0, le=1024, description="a new segment past this size")
    max_mb: float = Field(
        256.0, gt=0, description="the oldest segments go past this size in all (recorded)"
    )
    fsync_s: float = Field(
        1.0, gt=0, le=60, description="entries are fsynced this often (a power cut loses that)"
    )

    @model_validator(mode="after")
    def _sizes(self) -> EgressConfig:
        if self.max_mb < 2 * self.segment_mb:
            raise ValueError("max_mb must be at least twice segment_mb")
        return self


def _describe(error: ValidationError, source: str) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"])
        message = "unknown key" if item["type"] == "extra_forbidden" else item["msg"]
        lines.append(f"{source}: {key}: {message}" if key else f"{source}: {message}")
    return "\n".join(lines)


S = TypeVar("S", bound=BaseModel)


def validate(cls: type[S], data: dict[str, Any], source: str = "config") -> S:
    """Validate a config mapping as ``cls``; ConfigError names each bad key."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file as a mapping; ConfigError says why it cannot be read."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None


def load_file(cls: type[S], path: Path | None, default_path: Path) -> S:
    """The config file as ``cls``: an explicit ``path`` must exist; else ``default_path`` is
    read when present; else the embedded defaults."""
    if path is None:
        if not default_path.is_file():
            return cls()
        path = default_path
    return validate(cls, read_toml(path), str(path))


def section_in(annotation: Any) -> tuple[type[Section] | None, bool]:
    """The Section a field holds (and whether a list of them), or (None, False)."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation, False
    args = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
    if getattr(annotation, "__origin__", None) is list and args:
        inner, _ = section_in(args[0])
        return inner, inner is not None
    if len(args) == 1:  # Optional[Section]
        return section_in(args[0])
    return None, False


def _shown(value: Any) -> str:
    if value is None:
        return "(none)"
    try:
        return json.dumps(str(value) if isinstance(value, Path) else value)
    except (TypeError, ValueError):
        return repr(value)


def keys_help(section: type[Section], where: str = "") -> list[str]:
    """Every key of a config, section by section, as TOML would name it: its default and
    what it does (the text of ``--help``)."""
    lines: list[str] = []
    nested: list[tuple[str, type[Section], bool]] = []
    for name, info in section.model_fields.items():
        key = info.alias or name
        inner, many = section_in(info.annotation)
        if inner is not None:
            nested.append((f"{where}.{key}" if where else key, inner, many))
            continue
        shown = (
            "(required)"
            if info.is_required()
            else _shown(info.get_default(call_default_factory=True))
        )
        lines.append(f"  {key} = {shown}" + (f": {info.description}" if info.description else ""))
    for path, inner, many in nested:
        lines += ["", f"[[{path}]]" if many else f"[{path}]", *keys_help(inner, path)]
    return lines
