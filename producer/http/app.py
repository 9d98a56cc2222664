"""The FastAPI app of ``vqueue serve``: OpenAI's Files and Batches routes, authentication,
errors in OpenAI's shape, the request size bound, the background mover."""

# No postponed annotations (``from __future__ import annotations``) here: FastAPI reads each
# route's parameter types at runtime, and ``Request`` and the rest are imported in create_app.

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from protocol.store import refused_for_memory
from schemas import (
    Settings,
    get_settings,
)
from schemas.api import (
    FINAL_STATES,
    BatchCreate,
    BatchList,
    BatchObject,
    ExpiresAfter,
    FileDeleted,
    FileList,
    FileObject,
    ModelList,
    ModelObject,
)

from .batches import Batches, canary_share
from .store import ApiStore, TooLarge

log = logging.getLogger(__name__)

# a request body other than an upload: a batch's create call is a few hundred bytes
MAX_REQUEST_BYTES = 1 << 20


def _expires_after(form: Any) -> int | str | None:
    """An upload's ``expires_after[anchor]``/``expires_after[seconds]`` form fields, as the
    ``openai`` SDK sends them: the seconds to keep the file, None to keep it until deleted, or
    what is wrong with them."""
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    try:
        return ExpiresAfter.model_validate({"anchor": anchor, "seconds": seconds}).seconds
    except ValidationError:
        return ("expires_after needs anchor 'created_at' and seconds from 3600 to 2592000, "
                f"not {str(anchor)[:40]!r} and {str(seconds)[:40]!r}")  # fmt: skip


# ------------------------------------------------------------------------------ the app


def create_app(settings: Settings | None = None) -> Any:
    from fastapi import FastAPI, Header, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import Response
    from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

    s = settings or get_settings()
    store = ApiStore(s)
    batches = Batches(store)
    requests_total = Counter(
        "vqueue_api_requests_total", "HTTP API requests", ["method", "route", "status"]
    )
    batch_states = Counter(
        "vqueue_api_batches_total", "Batches by the state they ended in", ["status"]
    )

    async def mover() -> None:
        """Moves every open batch along (counts, deadlines, the end) and deletes expired files."""
        while True:
            await asyncio.sleep(s.api_poll_s)
            try:
                await run_in_threadpool(store.expire)
                for bid in await run_in_threadpool(store.active):
                    before = await run_in_threadpool(store.batch, None, bid, False)
                    b = await run_in_threadpool(batches.advance, bid)
                    if b and before and b.status != before[1].status and b.status in FINAL_STATES:
                        batch_states.labels(b.status).inc()
            except Exception:  # Redis away for a moment: try again next round
                log.exception("moving batches along")

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        task = asyncio.create_task(mover())
        yield
        task.cancel()

    app = FastAPI(title="vqueue", version="0.1.0", lifespan=lifespan)
    upload_limit = s.max_file_bytes + 65536  # the file, and the form around it
    app.add_middleware(
        BodyLimit, limit=lambda path: upload_limit if path == "/v1/files" else MAX_REQUEST_BYTES
    )

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.middleware("http")
    async def count(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "other")
        requests_total.labels(request.method, path, str(response.status_code)).inc()
        return response

    def tenant(authorization: str | None = Header(default=None)) -> str:
        if not authorization or not authorization.lower().startswith("bearer "):
            raise fail(401, "missing bearer API key (Authorization: Bearer ...)", "invalid_api_key")
        t = store.tenant_of(authorization[7:].strip())
        if t is None:
            raise fail(401, "invalid API key", "invalid_api_key")
        return t

    _openai_errors(app)
    _fleet_routes(app, store, tenant)
    _file_routes(app, s, store, tenant)
    _batch_routes(app, s, store, batches, tenant)
    return app


def fail(status: int, message: str, code: str | None = None) -> Any:
    """An error as OpenAI's API answers it (``_openai_errors`` shapes it)."""
    from fastapi import HTTPException

    return HTTPException(status, {"message": message, "type": "invalid_request_error",
                                  "param": None, "code": code})  # fmt: skip


def _openai_errors(app: Any) -> None:
    from fastapi import HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    @app.exception_handler(HTTPException)
    async def openai_errors(_request: Request, exc: HTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, dict) else {"message": str(exc.detail)}
        detail.setdefault("type", "invalid_request_error")
        return JSONResponse({"error": detail}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def openai_validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        """A bad request body as OpenAI answers it: 400, the first problem, the field named."""
        first = exc.errors()[0] if exc.errors() else {}
        where = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        param = ".".join(where) or None
        error = {"message": f"{param}: {message}" if param else message, "param": param,
                 "type": "invalid_request_error", "code": "invalid_request"}  # fmt: skip
        return JSONResponse({"error": error}, status_code=400)


def _fleet_routes(app: Any, store: ApiStore, tenant: Any) -> None:
    """Health and the models the live workers serve."""
    from fastapi import Depends

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        """Ready when Redis takes a write: a full Redis answers PING but refuses every batch."""
        try:
            store.r.set(f"{store.p}:healthz", str(time.time()), ex=60)
        except Exception as exc:
            if refused_for_memory(exc):
                raise fail(503, "redis is full (maxmemory): it refuses writes") from None
            raise fail(503, f"redis: {type(exc).__name__}") from None
        return {"status": "ok", "workers": len(store.batches.workers())}

    @app.get("/v1/models", response_model=ModelList)
    def models(_who: str = Depends(tenant)) -> ModelList:
        """The models live workers serve, by every name they answer to (``served_names``), each
        once, with when its first worker started."""
        since: dict[str, int] = {}
        for w in store.batches.workers():
            started = int(w.get("started_at") or time.time())
            names = w.get("models") or ([w["model"]] if w.get("model") else [])
            for model in names:
                since[model] = min(since.get(model, started), started)
        return ModelList(data=[ModelObject(id=m, created=t) for m, t in sorted(since.items())])


def _file_routes(app: Any, s: Settings, store: ApiStore, tenant: Any) -> None:
    """OpenAI's Files API: a tenant's uploads, their contents, their deletion."""
    from fastapi import Depends, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import FileResponse

    @app.post("/v1/files", response_model=FileObject)
    async def upload(request: Request, who: str = Depends(tenant)) -> FileObject:
        files, held, _ = await run_in_threadpool(store.usage, who)
        if files >= s.api_max_files:
            raise fail(429, f"this tenant keeps {files} files, its quota; delete some first",
                       "quota_exceeded")  # fmt: skip
        room = s.api_max_stored_bytes - held
        if room <= 0:
            raise fail(429, "this tenant's files fill its storage quota; delete some first",
                       "quota_exceeded")  # fmt: skip
        limit = min(s.max_file_bytes, room)  # the body as it arrives is bounded by ``BodyLimit``
        # Starlette spools each file part to disk past 1 MiB: the upload is never held whole
        form = await request.form(max_files=1, max_fields=8)
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise fail(400, "purpose must be 'batch'", "invalid_purpose")
        if upload is None or isinstance(upload, str):
            raise fail(400, "no file part named 'file'")
        ttl = _expires_after(form)
        if isinstance(ttl, str):
            raise fail(400, ttl, "invalid_expires_after")
        try:
            return await run_in_threadpool(
                store.add_file, who, upload.file, upload.filename or "upload.jsonl", "batch",
                limit, ttl,
            )  # fmt: skip
        except TooLarge:
            if limit < s.max_file_bytes:
                raise fail(429, f"the file is larger than the {room} bytes left of this "
                           "tenant's storage quota", "quota_exceeded") from None  # fmt: skip
            raise fail(413, f"the file is over the {limit}-byte limit (VQUEUE_MAX_FILE_BYTES)",
                       "file_too_large") from None  # fmt: skip
        finally:
            await form.close()

    @app.get("/v1/files", response_model=FileList)
    def list_files(who: str = Depends(tenant)) -> FileList:
        data = store.files(who)
        return FileList(data=data, first_id=data[0].id if data else None,
                        last_id=data[-1].id if data else None)  # fmt: skip

    @app.get("/v1/files/{fid}", response_model=FileObject)
    def get_file(fid: str, who: str = Depends(tenant)) -> FileObject:
        f = store.file(who, fid)
        if f is None:
            raise fail(404, f"no file {fid!r}")
        return f

    @app.get("/v1/files/{fid}/content")
    def file_content(fid: str, who: str = Depends(tenant)) -> Any:
        f = store.file(who, fid)
        if f is None or not store.path(fid).exists():
            raise fail(404, f"no file {fid!r}")
        return FileResponse(store.path(fid), media_type="application/jsonl", filename=f.filename)

    @app.delete("/v1/files/{fid}", response_model=FileDeleted)
    def delete_file(fid: str, who: str = Depends(tenant)) -> FileDeleted:
        if not store.delete_file(who, fid):
            raise fail(404, f"no file {fid!r}")
        return FileDeleted(id=fid, deleted=True)


def _batch_routes(app: Any, s: Settings, store: ApiStore, batches: Batches, tenant: Any) -> None:
    """OpenAI's Batches API: create, read, list, cancel."""
    from fastapi import Depends, HTTPException
    from fastapi.concurrency import run_in_threadpool

    @app.post("/v1/batches", response_model=BatchObject)
    async def create_batch(req: BatchCreate, who: str = Depends(tenant)) -> BatchObject:
        f = await run_in_threadpool(store.file, who, req.input_file_id)
        if f is None:
            raise fail(404, f"no file {req.input_file_id!r}")
        if f.purpose != "batch":
            raise fail(400, "the input file's purpose must be 'batch'")
        limit = s.api_max_batch_requests
        if await run_in_threadpool(store.lines_over, req.input_file_id, limit):
            raise HTTPException(400, {
                "message": f"the input file has more than {limit} requests, the most one batch "
                "takes (VQUEUE_API_MAX_BATCH_REQUESTS); split it",
                "type": "invalid_request_error", "param": "input_file_id",
                "code": "too_many_requests",
            })  # fmt: skip
        try:
            canary_share(req.metadata)
        except ValueError as exc:
            raise fail(400, f"metadata canary: {exc}") from None
        open_batches = (await run_in_threadpool(store.usage, who))[2]
        if open_batches >= s.api_max_open_batches:
            raise fail(429, f"this tenant has {open_batches} batches not ended, its quota",
                       "quota_exceeded")  # fmt: skip
        b = await run_in_threadpool(batches.create, who, req)
        batches.feeder.feed(who, b.id)  # checked and submitted off the request, in turn
        return b

    @app.get("/v1/batches/{bid}", response_model=BatchObject)
    def get_batch(bid: str, who: str = Depends(tenant)) -> BatchObject:
        if store.batch(who, bid, live=False) is None:
            raise fail(404, f"no batch {bid!r}")
        b = batches.advance(bid)
        assert b is not None
        return b

    @app.get("/v1/batches", response_model=BatchList)
    def list_batches(
        after: str | None = None, limit: int = 20, who: str = Depends(tenant)
    ) -> BatchList:
        limit = max(1, min(limit, 100))
        ids = store.batch_ids(who)
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        page = [found[1] for i in ids[: limit + 1] if (found := store.batch(who, i))]
        more = len(page) > limit
        page = page[:limit]
        return BatchList(data=page, first_id=page[0].id if page else None,
                         last_id=page[-1].id if page else None, has_more=more)  # fmt: skip

    @app.post("/v1/batches/{bid}/cancel", response_model=BatchObject)
    def cancel_batch(bid: str, who: str = Depends(tenant)) -> BatchObject:
        b = batches.cancel(who, bid)
        if b is None:
            raise fail(404, f"no batch {bid!r}")
        return b


class BodyLimit:
    """Refuses a request body past ``limit(path)`` bytes with 413, counted as it arrives, so a
    chunked upload (no Content-Length) is bounded like any other. The app sees the request end
    where the limit passed, and whatever it answers to that is replaced by the 413."""

    def __init__(self, app: Any, limit: Any) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit(scope["path"])
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            await self._refuse(send, limit)
            return
        seen, over = 0, False

        async def counted() -> Any:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def unless_over(message: Any) -> None:
            if not over:
                await send(message)

        try:
            await self.app(scope, counted, unless_over)
        except Exception:
            if not over:
                raise
        if over:
            await self._refuse(send, limit)

    @staticmethod
    async def _refuse(send: Any, limit: int) -> None:
        body = json.dumps({"error": {
            "message": f"the request body is over its {limit}-byte limit",
            "type": "invalid_request_error", "param": None, "code": "request_too_large",
        }}).encode()  # fmt: skip
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


def serve(host: str, port: int, settings: Settings | None = None) -> None:
    """One server process: its request handlers share the GIL with the feeder threads that
    parse and check tenants' files, so it hands the GIL on as often as a worker does
    (``gil_switch_ms``): a tenant's small request gets in between another's lines
    (docs/benchmarks.md, one tenant beside another's flood)."""
    import uvicorn

    s = settings or get_settings()
    sys.setswitchinterval(s.gil_switch_ms / 1000)
    uvicorn.run(create_app(s), host=host, port=port, log_level="warning")
