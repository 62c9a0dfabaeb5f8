"""vLLM's sleep-mode routes, served when the engine runs with --enable-sleep-mode (absent, they
are 404): `POST /sleep?level=1|2`, `POST /wake_up`, `GET /is_sleeping`. While the engine
sleeps, generation routes answer 503 (routes.py: EngineSleepingError); /health stays 200 and
says so. Sleeping while requests are in flight is refused (400)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from tokenmill.server.routes import check_api_key

router = APIRouter(dependencies=[Depends(check_api_key)])


@router.post("/sleep", response_class=Response)
async def sleep(raw: Request, level: int = Query(1)) -> Response:
    await raw.app.state.server.async_llm.sleep(level)
    return Response(status_code=200)


@router.post("/wake_up", response_class=Response)
async def wake_up(raw: Request) -> Response:
    await raw.app.state.server.async_llm.wake_up()
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(raw: Request) -> dict[str, bool]:
    return {"is_sleeping": raw.app.state.server.async_llm.is_sleeping}
