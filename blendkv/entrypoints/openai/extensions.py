"""blendkv's own routes beside OpenAI's, under ``/v1/blendkv/``: what the ``/ui`` page shows, for
any client.

    GET    /v1/blendkv/info                  the model, the store, what the server offers
    GET    /v1/blendkv/documents             the store's documents, one page at a time
    GET    /v1/blendkv/documents/{ref}       a document (doc id or source) and its chunks' text
    DELETE /v1/blendkv/documents/{ref}       delete it: only on a server with --api-key
    GET    /v1/blendkv/health                recent TTFT, chunk hits by tier, blend audits

The per-token map is not a route of its own: a chat completion with ``"token_map": true``
returns it in its ``blendkv`` field (:mod:`.responses`). Every route needs the API key when
the server has one (:class:`~.middleware.APIKeyMiddleware`); deleting needs one to exist, so a
server open to anyone on its port never deletes.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse

from blendkv.entrypoints.openai.errors import APIError
from blendkv.rag.errors import UnknownDocumentError
from blendkv.rag.listing import MAX_PAGE

PREFIX = "/v1/blendkv"
ROUTES = {f"{PREFIX}/info", f"{PREFIX}/documents", f"{PREFIX}/health"}  # counted by name


def add_extension_routes(app: FastAPI, state) -> None:
    """``state``: the server's :class:`~.api_server.ServerState`."""
    _add_info_route(app, state)
    _add_document_routes(app, state)
    _add_health_route(app, state)


def _add_info_route(app: FastAPI, state) -> None:
    @app.get(f"{PREFIX}/info")
    async def info() -> JSONResponse:
        from blendkv import __version__

        served = state.require()
        llm = served.engine.llm
        guards = llm.engine.config.guards
        rag = served.rag
        return JSONResponse(
            {
                "object": "blendkv.info",
                "version": __version__,
                "model": served.model_name,
                "max_model_len": served.max_model_len,
                "store": None if rag is None else {"name": _store_name(rag)},
                "api_key": bool(state.config.api_key),
                "can_delete": bool(state.config.api_key) and rag is not None,
                "blend_audit_rate": guards.blend_audit_rate,
                "blend_audit_warn_kl": state.config.blend_audit_warn_kl,
                "blend_cost_check": guards.blend_cost_check,
            }
        )


def _add_document_routes(app: FastAPI, state) -> None:
    """List, show and delete the store's documents."""

    @app.get(f"{PREFIX}/documents")
    async def documents(
        offset: int = Query(0, ge=0),
        limit: int = Query(50, ge=1, le=MAX_PAGE),
        q: str | None = Query(None, max_length=200),
    ) -> JSONResponse:
        rag = _store(state)
        page, total = await asyncio.to_thread(rag.document_page, offset, limit, q or None)
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "total": total,
                "offset": offset,
                "limit": limit,
                "has_more": offset + len(page) < total,
            }
        )

    @app.get(f"{PREFIX}/documents/{{ref:path}}")
    async def document(ref: str) -> JSONResponse:
        docs = await _details(_store(state), ref)
        return JSONResponse({"object": "list", "data": docs})

    @app.delete(f"{PREFIX}/documents/{{ref:path}}")
    async def delete(ref: str) -> JSONResponse:
        if not state.config.api_key:
            raise APIError(
                403,
                "deleting documents needs a server started with --api-key (anyone who can "
                "reach a server without one could delete them)",
                "permission_error",
                code="api_key_required",
            )
        rag = _store(state)
        docs = await _details(rag, ref)
        removed = await asyncio.to_thread(rag.delete_document, ref)
        return JSONResponse(
            {
                "object": "blendkv.deleted",
                "deleted": [{"doc_id": d["doc_id"], "source": d["source"]} for d in docs],
                "chunks_removed": removed,
            }
        )


def _add_health_route(app: FastAPI, state) -> None:
    @app.get(f"{PREFIX}/health")
    async def health() -> JSONResponse:
        served = state.require()
        snapshot = state.metrics.health.snapshot()
        s = served.engine.stats
        snapshot["engine"] = {
            "running": s.num_running,
            "waiting": s.num_waiting,
            "kv_blocks_used": s.num_kv_blocks_used,
            "kv_blocks_total": s.num_kv_blocks,
        }
        snapshot["audit"]["rate"] = served.engine.llm.engine.config.guards.blend_audit_rate
        snapshot["audit"]["warn_kl"] = state.config.blend_audit_warn_kl
        return JSONResponse({"object": "blendkv.health", **snapshot})


async def _details(rag, ref: str) -> list[dict]:
    """The document ``ref`` and its chunks (404 if the store has no such document)."""
    try:
        return await asyncio.to_thread(rag.document_details, ref)
    except UnknownDocumentError as exc:
        raise APIError(404, str(exc), "not_found_error", param="ref") from exc


def _store(state):
    served = state.require()
    if served.rag is None:
        raise APIError(
            404,
            "this server has no document store; start it with --store DIR",
            "not_found_error",
            code="no_store",
        )
    return served.rag


def _store_name(rag) -> str:
    """The store's folder name (not its whole path) or, for Redis, its URL without a password."""
    location = str(rag.store_dir)
    if "://" in location:
        scheme, rest = location.split("://", 1)
        return f"{scheme}://{rest.rsplit('@', 1)[-1]}"
    return rag.store_dir.name
