"""LangChain adapters: a retriever over a :class:`~blendkv.rag.RAGPipeline` and a generator that
hands retrieved ``Document``s to blendkv *as separate chunks*, so their stored K/V is blended.

    retriever = BlendKVRetriever(pipeline=rag, k=4)
    chain = {"question": RunnablePassthrough(), "documents": retriever} | BlendKVGenerator(rag)
    chain.invoke("Who created Python?")   # AIMessage; blend stats in .response_metadata

Joining the documents into one string (the usual ``format_docs`` step) would defeat reuse: the
chunk boundaries, and so the stored K/V, would be lost. Needs ``pip install langchain-core``.

Both are thread-safe (the pipeline and its ``LLM`` are): ``chain.batch([q1, q2])`` runs the
questions on LangChain's threads and the engine batches them; ``.abatch`` and ``.astream`` run
``invoke`` in the event loop's executor, which is the same.
"""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import AIMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableConfig
from pydantic import ConfigDict

from blendkv import SamplingParams
from blendkv.errors import InvalidRequestError
from blendkv.rag.chunk_order import check_chunk_order, order_chunks, source_key


def chunk_to_document(chunk) -> Document:
    """A RetrievedChunk as a Document (metadata: the document's own, then ``source`` (its
    file path or title, LangChain's key), chunk_id, doc_id, position, score, kv_cached)."""
    return Document(page_content=chunk.text, metadata=chunk.retriever_metadata())


def _source_key(doc: Document) -> tuple:
    """The ``source`` chunk order's key of a retrieved document (its retriever metadata)."""
    m = doc.metadata
    return source_key(m.get("source"), m.get("doc_id"), int(m.get("position") or 0))


class BlendKVRetriever(BaseRetriever):
    """Top-``k`` chunks of a RAGPipeline's store as ``Document``s (metadata:
    :func:`chunk_to_document`).

    ``k`` and ``filter`` may also be passed per call (``retriever.invoke(q, k=3, filter=...)``).

    Attributes:
        pipeline: the :class:`~blendkv.rag.RAGPipeline` whose store is searched.
        k: how many chunks to return.
        filter: searches only the documents it selects (e.g. ``{"source": "docs/a.md"}``;
            see :meth:`~blendkv.rag.RAGPipeline.retrieve`); None: all.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    pipeline: Any
    k: int = 6
    filter: Any = None

    def _get_relevant_documents(
        self,
        query: str,
        *,
        run_manager: CallbackManagerForRetrieverRun,
        k: int | None = None,
        filter: Any = None,
    ) -> list[Document]:
        k = self.k if k is None else k
        chunks = self.pipeline.retrieve(query, k, self.filter if filter is None else filter)
        return [chunk_to_document(c) for c in chunks]


class BlendKVGenerator(Runnable[dict, AIMessage]):
    """``{"question": str, "documents": list[Document]}`` -> ``AIMessage`` answer.

    Documents carrying a ``chunk_id`` of the pipeline's store are served from their stored K/V;
    others are tokenised, computed and written back (a cache miss). The documents are taken
    best first (as retrievers return them) and put in ``chunk_order``.
    ``response_metadata`` holds ``blend_stats`` (a dict), ``ttft_s`` and ``finish_reason``.

    Args:
        pipeline: the :class:`~blendkv.rag.RAGPipeline` (its store, template and model).
        sampling_params: None: greedy, at most 128 tokens.
        blend: a :class:`~blendkv.blend.config.BlendConfig`; None: the engine's default.
        system: a system message for the chat template, or None.
        chunk_order: the documents' order in the prompt (:mod:`blendkv.rag.chunk_order`);
            None: the pipeline's.
    """

    def __init__(
        self,
        pipeline,
        sampling_params=None,
        blend=None,
        system: str | None = None,
        chunk_order: str | None = None,
    ):
        self.pipeline = pipeline
        self.chunk_order = pipeline.chunk_order if chunk_order is None else chunk_order
        check_chunk_order(self.chunk_order)
        self.sampling_params = sampling_params
        self.blend = blend
        self.system = system

    def invoke(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> AIMessage:
        """Answer ``input["question"]`` from ``input["documents"]``, blended."""
        if not isinstance(input, dict) or "question" not in input or "documents" not in input:
            raise InvalidRequestError(
                "BlendKVGenerator takes {'question': str, 'documents': [...]}"
            )
        question, docs = input["question"], list(input["documents"])
        if not docs:
            raise InvalidRequestError("BlendKVGenerator got no documents to answer from")
        prompt = self.pipeline.blended_prompt(question, [], self.system)
        del prompt["chunk_ids"]
        docs = order_chunks(docs, self.chunk_order, key=_source_key)
        prompt["chunks"] = [self._token_ids(d) for d in docs]
        params = self.sampling_params or SamplingParams(max_tokens=128, temperature=0.0)
        [out] = self.pipeline.llm.generate([prompt], params, blend=self.blend)
        stats = out.blend_stats.to_dict() if out.blend_stats is not None else None
        return AIMessage(
            content=out.text.strip(),
            response_metadata={
                "blend_stats": stats,
                "ttft_s": out.metrics.ttft,
                "finish_reason": out.outputs[0].finish_reason,
            },
        )

    def _token_ids(self, doc: Document) -> list[int]:
        cid = doc.metadata.get("chunk_id")
        if cid is not None:
            meta = self.pipeline.store.kv.meta_for_id(int(cid))
            if meta is not None and meta.text == doc.page_content:
                return list(meta.token_ids)  # exactly the ids its K/V was stored under
        return self.pipeline.manager.builder.encode(doc.page_content)
