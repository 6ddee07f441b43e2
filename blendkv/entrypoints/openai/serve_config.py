"""The OpenAI-compatible server's own options (:class:`ServeConfig`); the engine's are the
``LLM``'s."""

from __future__ import annotations

from dataclasses import dataclass

from blendkv.guards.audit import DEFAULT_WARN_KL


@dataclass(frozen=True)
class ServeConfig:
    """Server options (the engine's are the ``LLM``'s).

    store_dir: a chunk store (``blendkv ingest``) for ``rag`` requests. Created when missing.
    store_max_bytes: that store's size limit on disk (its LMDB file stays within it; None: the
        one saved in it, if any).
    request_cache_bytes: the bound on disk of the cache that keeps the K/V of documents sent
        in requests (never in the store): its LMDB file stays within it. None: min(2 GiB, 10 %
        of the temporary directory's free disk).
    max_waiting: requests waiting for a place in the batch before new ones get 429 (at least
        1: with 0 every request would be refused; None: no limit).
    max_body_bytes: larger request bodies get 413 (at least 1 KiB, or no request fits).
    shutdown_timeout: on SIGTERM / Ctrl-C, seconds in-flight requests may take to finish
        (new ones get 503, ``/health`` too) before the rest are aborted.
    max_request_documents, max_document_tokens: per-request limits on chat ``documents``
        (None: 1024 documents, max_model_len tokens; :mod:`.request_limits`).
    blend_audit_warn_kl: with ``blend_audit_rate`` > 0, warn when the mean first-token KL of
        the recent audits passes it (nats; :mod:`blendkv.guards.audit`).
    replica_name: this server's name among replicas (``blendkv serve --replicas N``): every
        response says it in ``x-blendkv-replica`` and blend stats in ``replica``. None: alone.
    """

    api_key: str | None = None
    served_model_name: str | None = None
    store_dir: str | None = None
    store_max_bytes: int | None = None
    request_cache_bytes: int | None = None
    max_waiting: int | None = 256
    max_body_bytes: int = 16 << 20
    shutdown_timeout: float = 30.0
    max_request_documents: int | None = None
    max_document_tokens: int | None = None
    blend_audit_warn_kl: float = DEFAULT_WARN_KL
    replica_name: str | None = None

    def __post_init__(self) -> None:
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ValueError(
                f"max_waiting must be >= 1 (a request waits before it runs), got {self.max_waiting}"
            )
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        for name in (
            "store_max_bytes",
            "request_cache_bytes",
            "max_request_documents",
            "max_document_tokens",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
