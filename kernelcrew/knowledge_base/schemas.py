"""Validated shapes of what enters the knowledge base: a win's description, export files, seed files.

Everything from outside (an export file, a seed file, the crew's record of a win) is checked here
before any row is written: unknown fields are refused, types are strict (no "3" for 3), strings
and JSON blobs have size limits, and a candidate source is at most as large as a task file may be.
"""

from __future__ import annotations

import functools
import json
import math
import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from kernelcrew.task import MAX_SOURCE_BYTES

EXPORT_FORMAT = "kernelcrew-kb"
EXPORT_VERSION = 1
MAX_RECORDS = 10_000
MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_JSON_BYTES = 16 * 1024
MAX_JSON_DEPTH = 8

PatternKind = Literal["attention", "matmul", "conv", "reduction", "pointwise", "other", "any"]
Visibility = Literal["private", "team", "public"]
Clock = Literal["cuda-event", "cpu-wall"]
Bottleneck = Literal["memory", "compute", "latency", "launch"]
SourceKind = Literal["kernel", "hybrid", "library", "compiler"]


def _text(value: str, *, lines: bool = True) -> str:
    """``value`` if every database takes it: valid UTF-8 (no lone surrogates), no NUL, and no other
    control character but tab and newlines (where ``lines``)."""
    try:
        value.encode()
    except UnicodeEncodeError:
        raise ValueError("not valid UTF-8 text (a lone surrogate)") from None
    allowed = "\t\n\r" if lines else ""
    bad = next((c for c in value if (ord(c) < 32 or ord(c) == 127) and c not in allowed), None)
    if bad is not None:
        raise ValueError(f"contains the control character {bad!r}")
    return value


def _plain_json(value: Any, depth: int = 0) -> None:
    """Only JSON's own values, nested at most :data:`MAX_JSON_DEPTH` deep, numbers finite."""
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, dict):
        for key, item in value.items():
            _text(key, lines=False)
            _plain_json(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _plain_json(item, depth + 1)
    elif isinstance(value, str):
        _text(value)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError("numbers must be finite (no NaN or infinity)")
    elif value is not None and not isinstance(value, bool | int | float):
        raise ValueError(f"{type(value).__name__} is not a JSON value")


def _json_limited(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is None:
        return value
    _plain_json(value)
    size = len(json.dumps(value))
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{size} bytes of JSON; the limit is {MAX_JSON_BYTES}")
    return value


def _source_limited(value: str | None) -> str | None:
    if value is None:
        return value
    size = len(value.encode(errors="surrogatepass"))
    if size > MAX_SOURCE_BYTES:
        raise ValueError(f"the candidate source is {size} bytes; the limit is {MAX_SOURCE_BYTES}")
    if "\x00" in value:
        raise ValueError("the candidate source contains NUL bytes")
    return _text(value)


def _finite(value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


JsonDict = Annotated[dict[str, Any], AfterValidator(_json_limited)]
Source = Annotated[str, AfterValidator(_source_limited)]
Text = Annotated[str, AfterValidator(_text)]
Line = Annotated[str, AfterValidator(functools.partial(_text, lines=False))]
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[\w.@+-][\w .@+-]*$")]
GpuModel = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9.-]*$")]
Arch = Annotated[str, Field(pattern=r"^(sm_\d{2,3}[a-z]?|cpu)$")]
Strategy = Annotated[str, Field(min_length=1, max_length=80, pattern=r"^[\w:.+-][\w:.+ -]*$")]
Tag = Annotated[
    str, Field(min_length=1, max_length=40), AfterValidator(functools.partial(_text, lines=False))
]
Millis = Annotated[float, Field(gt=0), AfterValidator(_finite)]
Ratio = Annotated[float, Field(gt=0), AfterValidator(_finite)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class WinIn(_Strict):
    """What the crew knows of a win besides the verifier's evidence (timings come from the verdict)."""

    gpu_model: GpuModel
    arch: Arch
    signature: Line = Field(min_length=1, max_length=4000)
    pattern_kinds: list[PatternKind] = Field(min_length=1, max_length=7)
    strategy: Strategy
    candidate_source: Source
    description: Text = Field("", max_length=4000)
    tags: list[Tag] = Field(default_factory=list, max_length=16)
    params: JsonDict = Field(default_factory=dict)
    versions: JsonDict = Field(default_factory=dict)
    bottleneck: Bottleneck | None = None
    source_kind: SourceKind | None = None
    sol_fraction: Annotated[float, Field(ge=0, le=2), AfterValidator(_finite)] | None = None
    ncu_summary: JsonDict | None = None
    job_id: Line | None = Field(None, min_length=1, max_length=64)


class ExportRecord(WinIn):
    """One verified win in an export file: the description, the evidence and who shared it."""

    id: uuid.UUID
    source: Literal["verified"] = "verified"
    clock: Clock
    before_ms: Millis
    after_ms: Millis
    speedup_eager: Ratio
    speedup_compile: Ratio | None = None
    owner: Name
    visibility: Visibility
    team: Name | None = None
    confirmations: int = Field(1, ge=1, le=1_000_000)
    created_at: datetime

    @model_validator(mode="after")
    def _consistent(self) -> ExportRecord:
        if self.visibility == "team" and not self.team:
            raise ValueError("visibility 'team' needs a team")
        if (self.clock == "cpu-wall") != (self.arch == "cpu"):
            raise ValueError(f"clock {self.clock} does not fit arch {self.arch} (cpu-wall is for cpu only)")
        if self.clock == "cuda-event" and not self.after_ms < self.before_ms:
            raise ValueError("a GPU win must be faster than eager (after_ms < before_ms)")
        return self


class ExportFile(_Strict):
    """``kernelcrew kb export`` output: the verified wins a reader may see (never the seeds)."""

    format: Literal["kernelcrew-kb"]
    version: Literal[1]
    exported_at: datetime
    records: list[ExportRecord] = Field(max_length=MAX_RECORDS)


class SeedEntry(_Strict):
    """One curated strategy for an architecture."""

    name: str = Field(min_length=1, max_length=60, pattern=r"^[a-z0-9_]+$")
    strategy: Strategy
    applies_to: list[PatternKind] = Field(min_length=1)
    tags: list[Tag] = Field(default_factory=list, max_length=16)
    params: JsonDict = Field(default_factory=dict)
    """Starting values or lists of values worth trying (``{"num_warps": [4, 8]}``)."""
    advice: str = Field(min_length=20, max_length=2000)


class SeedFile(_Strict):
    """``knowledge_base/seed/<arch>.json``."""

    arch: Arch
    about: str = Field(min_length=1, max_length=1000)
    entries: list[SeedEntry] = Field(min_length=1)


def describe_errors(exc: ValidationError, *, limit: int = 8) -> str:
    """A pydantic error as short lines: where (``records[3].candidate_source``) and what."""
    lines = []
    for err in exc.errors()[:limit]:
        where = ""
        for part in err["loc"]:
            where += f"[{part}]" if isinstance(part, int) else (f".{part}" if where else str(part))
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown field"
        lines.append(f"{where or 'file'}: {message}")
    more = len(exc.errors()) - limit
    if more > 0:
        lines.append(f"... and {more} more problem(s)")
    return "; ".join(lines)


__all__ = [
    "EXPORT_FORMAT",
    "EXPORT_VERSION",
    "MAX_FILE_BYTES",
    "ExportFile",
    "ExportRecord",
    "SeedEntry",
    "SeedFile",
    "WinIn",
    "describe_errors",
]
