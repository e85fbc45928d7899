"""The workers online, their GPUs, queues and current tasks (the live inventory in Redis)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from kernelcrew.api.deps import Reader, SettingsDep
from kernelcrew.api.schemas import AUTH_ERRORS, WorkerPublic, WorkersPublic, errors

router = APIRouter(prefix="/workers", tags=["workers"])


@router.get(
    "", response_model=WorkersPublic, responses=errors(*AUTH_ERRORS, 503, e503="The broker is not reachable.")
)
def read_workers(who: Reader, settings: SettingsDep) -> WorkersPublic:
    """The workers online now, sorted by hostname."""
    import redis

    from kernelcrew.worker.inventory import list_workers

    try:
        online = list_workers(settings)
    except redis.RedisError as exc:
        raise HTTPException(503, f"the broker is not reachable: {exc}") from exc
    return WorkersPublic(items=[WorkerPublic.model_validate(w.to_dict()) for w in online])
