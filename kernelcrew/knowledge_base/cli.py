"""``kernelcrew kb``: search, show and export the knowledge base from the command line.

``kb import`` is added by ``kernelcrew/cli.py``: it checks imported sources with the verifier's
static rules, which live above this package.

Acts as ``KERNELCREW_KB_OWNER`` (default: the OS user) of ``KERNELCREW_KB_TEAM`` on the database
of ``KERNELCREW_DATABASE_URL`` (default: ``<data dir>/kernelcrew.db``). Exit codes: 0 done, 1 not
found, 2 bad input (a bad import file changes nothing) or a database that cannot be opened.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from kernelcrew.knowledge_base.handle import KnowledgeBase

app = typer.Typer(
    help="The knowledge base of verified wins: search, show, export, import.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True, soft_wrap=True)  # messages stay one line (logs, CI)


class Visibility(StrEnum):
    private = "private"
    team = "team"
    public = "public"


def open_kb() -> KnowledgeBase:
    from kernelcrew.knowledge_base.db import DatabaseError
    from kernelcrew.knowledge_base.handle import KnowledgeBase

    try:
        return KnowledgeBase.open()
    except DatabaseError as exc:
        err.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from exc


def fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


def _gain(hit: dict[str, Any]) -> str:
    if hit.get("speedup_eager") is None:
        return "advice"
    text = f"{hit['speedup_eager']:.2f}x"
    return text + (" (CPU)" if hit.get("clock") == "cpu-wall" else "")


@app.command()
def search(
    query: Annotated[str, typer.Argument(help='Words: ops, strategy, pattern ("online softmax sm_90").')],
    arch: Annotated[str | None, typer.Option(help="Rank for this architecture (sm_90, cpu, ...).")] = None,
    gpu: Annotated[str | None, typer.Option(help="Rank for this GPU model slug (h100-sxm, ...).")] = None,
    limit: Annotated[int, typer.Option(min=1, max=200, help="Most records shown.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print the hits as JSON.")] = False,
) -> None:
    """Find records by BM25 over signatures, strategies and descriptions (tiered by --gpu/--arch)."""
    kb = open_kb()
    try:
        hits = kb.search(query, arch=arch, gpu_model=gpu, k=limit)
    except ValueError as exc:
        raise fail(str(exc)) from exc
    if as_json:
        print(json.dumps(hits, indent=2))
        return
    if not hits:
        err.print(f"no record matches {query!r} for {kb.reader.owner}")
        return
    table = Table("id", "kind", "strategy", "where", "gain", "why")
    for h in hits:
        where = h["arch"] if h["source"] == "seed" else f"{h['gpu_model']} ({h['arch']})"
        table.add_row(h["id"], h["source"], h["strategy"], where, _gain(h), h["why"])
    Console().print(table)


@app.command()
def show(
    record_id: Annotated[str, typer.Argument(metavar="ID", help="A record id (from search).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the record as JSON.")] = False,
) -> None:
    """One record with its evidence and candidate source."""
    kb = open_kb()
    try:
        record = kb.get(record_id)
    except ValueError as exc:
        raise fail(str(exc)) from exc
    if record is None:
        raise fail(f"no record {record_id} visible to {kb.reader.owner}", code=1)
    if as_json:
        print(json.dumps(record, indent=2))
        return
    out = Console()
    out.print(f"[bold]{record['strategy']}[/] ({record['source']}) {record['id']}")
    for key in ("gpu_model", "arch", "signature", "pattern_kinds", "params", "tags", "clock", "before_ms"):
        out.print(f"  {key}: {record[key]}")
    for key in ("after_ms", "speedup_eager", "speedup_compile", "sol_fraction", "source_kind", "bottleneck"):
        out.print(f"  {key}: {record[key]}")
    for key in ("confirmations", "owner", "visibility", "team", "job_id", "created_at"):
        out.print(f"  {key}: {record[key]}")
    out.print(f"  description: {record['description']}")
    if record.get("candidate_source"):
        out.print("candidate source:")
        print(record["candidate_source"])


@app.command("export")
def export_(
    file: Annotated[Path, typer.Argument(help="The JSON file to write.")],
) -> None:
    """Write every verified win you can see to FILE (seeds ship with kernelcrew: left out)."""
    kb = open_kb()
    doc = kb.export()
    try:
        file.write_text(json.dumps(doc, indent=2) + "\n")
    except OSError as exc:
        raise fail(f"cannot write {file}: {exc}") from exc
    err.print(f"exported {len(doc['records'])} record(s) to {file}")
