"""``kernelcrew token``, ``kernelcrew serve`` and ``kernelcrew submit``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

token_app = typer.Typer(help="API tokens: create (shown once), list and revoke.", no_args_is_help=True)


@token_app.command("create")
def token_create(
    user: Annotated[str, typer.Option(help="The user the token acts as (created if new).")],
    scope: Annotated[
        list[str] | None, typer.Option(help="submit, read, admin (repeat); default submit+read.")
    ] = None,
) -> None:
    """Create a token; it is printed alone on the last line and never shown again."""
    from kernelcrew.knowledge_base.db import get_engine, transaction
    from kernelcrew.service import jobs

    try:
        with transaction(get_engine()) as session:
            tok, token = jobs.create_token(session, user, scope or ["submit", "read"])
            typer.echo(
                f"token {tok.id} (prefix {tok.prefix}) for {user}, scopes {', '.join(tok.scopes)}", err=True
            )
            typer.echo(f"webhook secret: {tok.webhook_secret}", err=True)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--scope") from exc
    typer.echo(token)


@token_app.command("list")
def token_list(
    user: Annotated[str | None, typer.Option(help="Only this user's tokens.")] = None,
) -> None:
    """The tokens: id, prefix, user, scopes, created, revoked (a token is never shown again)."""
    from kernelcrew.knowledge_base.db import get_engine, transaction
    from kernelcrew.service import jobs

    with transaction(get_engine()) as session:
        rows = jobs.list_tokens(session, user)
        if not rows:
            typer.echo("no tokens" + (f" for {user}" if user else ""), err=True)
        for tok, name in rows:
            revoked = tok.revoked_at.isoformat(timespec="seconds") if tok.revoked_at else "-"
            typer.echo(
                f"{tok.id}\t{tok.prefix}\t{name}\t{','.join(tok.scopes)}\t"
                f"{tok.created_at.isoformat(timespec='seconds')}\trevoked {revoked}"
            )


@token_app.command("revoke")
def token_revoke(
    prefix_or_id: Annotated[str, typer.Argument(help="The token's prefix, id, or the token.")],
) -> None:
    """Revoke a token: it is refused (401) from now on."""
    from kernelcrew.knowledge_base.db import get_engine, transaction
    from kernelcrew.service import jobs

    with transaction(get_engine()) as session:
        tok = jobs.revoke_token(session, prefix_or_id)
        if tok is None:
            typer.echo(f"no token {prefix_or_id}", err=True)
            raise typer.Exit(1)
        typer.echo(f"revoked token {tok.id} (prefix {tok.prefix})")


def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 8000,
    orchestrators: Annotated[int, typer.Option(min=0, help="Orchestrator child processes (0: none).")] = 1,
    local: Annotated[
        bool, typer.Option("--local", help="Orchestrators run GPU work here, not on workers.")
    ] = False,
) -> None:
    """The API (uvicorn) plus N orchestrator child processes: with `kernelcrew worker`, a whole service."""
    import uvicorn

    from kernelcrew.api.app import create_app
    from kernelcrew.knowledge_base.db import get_engine
    from kernelcrew.worker.supervisor import OrchestratorPool

    get_engine()  # migrate once before the children start
    cmd = [sys.executable, "-m", "kernelcrew", "orchestrator", *(["--local"] if local else [])]
    # The orchestrators get SIGTERM when `serve` exits by any means (uvicorn re-raises the SIGTERM
    # it handled, which ends the process before the pool could stop them); one that dies is restarted.
    with OrchestratorPool(cmd, orchestrators) as pool:
        app = create_app()
        app.state.orchestrators = pool if orchestrators else None  # what /readyz reports
        uvicorn.run(app, host=host, port=port, log_level="info")


def submit(
    task: Annotated[Path, typer.Argument(help="Task file.")],
    candidate: Annotated[Path | None, typer.Option(help="Candidate file: a verify job.")] = None,
    server: Annotated[
        str, typer.Option(envvar="KERNELCREW_SERVER", help="The service's URL.")
    ] = "http://127.0.0.1:8000",
    token: Annotated[str, typer.Option(envvar="KERNELCREW_TOKEN", help="An API token.")] = "",
    mode: Annotated[
        str | None, typer.Option(help="optimize or verify (default: verify with a candidate).")
    ] = None,
    options: Annotated[str, typer.Option(help="Job options as JSON.")] = "{}",
    wait: Annotated[
        bool, typer.Option(help="Wait for the end; exit 0 verified/improved, 1 not, 2 error.")
    ] = False,
) -> None:
    """Submit a job to a kernelcrew service (for CI)."""
    import httpx

    try:
        body = {
            "task": task.read_text(),
            "candidate": candidate.read_text() if candidate else None,
            "mode": mode or ("verify" if candidate else "optimize"),
            "options": json.loads(options),
        }
        headers = {"authorization": f"Bearer {token}"}
        with httpx.Client(base_url=server.rstrip("/"), headers=headers, timeout=30) as client:
            r = client.post("/api/v1/jobs", json=body)
            if r.status_code != 201:
                typer.echo(f"error {r.status_code}: {r.text}", err=True)
                raise typer.Exit(2)
            job = r.json()
            typer.echo(job["id"])
            if not wait:
                return
            while job["status"] not in ("succeeded", "failed", "cancelled"):
                time.sleep(2)
                job = client.get(f"/api/v1/jobs/{job['id']}").raise_for_status().json()
            res = client.get(f"/api/v1/jobs/{job['id']}/result").raise_for_status().json()
    except (OSError, ValueError, httpx.HTTPError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    result = res.get("result") or {}
    print(json.dumps({"status": res["status"], "error": res.get("error"), **result}, indent=2, default=str))
    if res["status"] != "succeeded":
        raise typer.Exit(2)
    ok = result.get("verdict") == "pass" or result.get("status") == "improved"
    raise typer.Exit(0 if ok else 1)
