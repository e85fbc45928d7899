"""The knowledge base: search what the caller may see, and import an export file as the caller's."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query, Request
from starlette.concurrency import run_in_threadpool

from kernelcrew.api.deps import EngineDep, Reader, SettingsDep, Submitter
from kernelcrew.api.kb import source_problems
from kernelcrew.api.schemas import AUTH_ERRORS, KbHit, KbHits, KbImported, errors
from kernelcrew.knowledge_base.db import transaction

router = APIRouter(prefix="/kb", tags=["knowledge base"])


@router.get("", response_model=KbHits, responses=errors(*AUTH_ERRORS))
def search_kb(
    request: Request,
    who: Reader,
    engine: EngineDep,
    settings: SettingsDep,
    q: str = "",
    arch: str | None = None,
    gpu_model: str | None = None,
    k: Annotated[int, Query(ge=1, le=100)] = 10,
) -> KbHits:
    """Records the caller may see (theirs, their team's, public ones, the seeds), best match first.

    ``arch`` is ``sm_XY`` or ``cpu`` (422 otherwise)."""
    from kernelcrew.knowledge_base import KnowledgeBase
    from kernelcrew.knowledge_base import Reader as KbReader
    from kernelcrew.knowledge_base.embeddings import Embedder
    from kernelcrew.knowledge_base.seeds import ensure_seeds

    if not request.app.state.kb_seeded:
        with transaction(engine) as session:
            ensure_seeds(session)
        request.app.state.kb_seeded = True
    kb = KnowledgeBase(engine, KbReader(who.user, who.team), embedder=Embedder.from_settings(settings))
    try:
        hits = kb.search(q, arch=arch, gpu_model=gpu_model, k=k)
    except ValueError as exc:  # an architecture that is not sm_XY or cpu
        raise HTTPException(422, str(exc)) from exc
    return KbHits(items=[KbHit.model_validate(hit) for hit in hits])


@router.post(
    "/import",
    response_model=KbImported,
    responses=errors(
        *AUTH_ERRORS,
        413,
        e403="The token lacks the submit scope, or public records were asked for without admin.",
        e422="Not a valid export file, or a record or source failed its checks; nothing was imported.",
    ),
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}}
    },
)
async def import_kb(
    request: Request,
    who: Submitter,
    engine: EngineDep,
    settings: SettingsDep,
    visibility: Literal["private", "team", "public"] = "private",
) -> KbImported:
    """Import a `kernelcrew kb export` file as the caller's records (private unless shared): all or none.

    The file is data: every field is checked and every candidate source must pass the static
    rules; nothing in it runs. Sharing with everyone (public) needs the admin scope."""
    from kernelcrew.knowledge_base import KnowledgeBase
    from kernelcrew.knowledge_base import Reader as KbReader
    from kernelcrew.knowledge_base.store import ImportRefused

    if visibility == "public" and "admin" not in who.scopes:
        raise HTTPException(403, "importing public records needs the 'admin' scope")
    limit = settings.api_max_kb_import_bytes
    length = request.headers.get("content-length") or "0"
    if length.isdigit() and int(length) > limit:
        raise HTTPException(413, f"an import file is at most {limit} bytes")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise HTTPException(413, f"an import file is at most {limit} bytes")
    kb = KnowledgeBase(engine, KbReader(who.user, who.team))

    def work() -> dict[str, int]:
        return kb.import_file(bytes(raw), check_source=source_problems, visibility=visibility)

    try:
        counts = await run_in_threadpool(work)
    except ImportRefused as exc:
        raise HTTPException(422, f"{exc}; nothing was imported") from exc
    return KbImported(**counts, visibility=visibility)
