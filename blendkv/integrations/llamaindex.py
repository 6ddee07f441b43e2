"""LlamaIndex adapters over a :class:`~blendkv.rag.RAGPipeline`: a retriever and a query engine.

    engine = BlendKVQueryEngine(rag, similarity_top_k=3)
    response = engine.query("Who created Python?")   # Response; .source_nodes: the chunks
    nodes = BlendKVLlamaIndexRetriever(rag, similarity_top_k=4).retrieve("Who created Python?")

The query engine answers from the retrieved chunks' stored K/V (``RAGPipeline.query``: the
chunks blended behind the pipeline's instruction, which their K/V was precomputed behind),
greedy by default. LlamaIndex's own ``RetrieverQueryEngine`` over the retriever would format the
nodes' text into one flat prompt for its LLM: the chunk boundaries, and so the stored K/V, are
lost (:mod:`blendkv.integrations.llamaindex_llm` is the LLM for that use).

Node metadata is the chunk's :meth:`~blendkv.rag.types.RetrievedChunk.retriever_metadata`
(``chunk_id``, ``doc_id``, ``score``, ``kv_cached``, the document's metadata). Needs
``pip install llama-index-core``. Thread-safe, as the pipeline is: queries from several threads
(or ``asyncio.gather`` of ``aquery``, which runs each query on a worker thread) are batched in
the one engine loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.response.schema import (
    RESPONSE_TYPE,
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.callbacks import CallbackManager
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from blendkv.rag.types import RAGAnswer, RetrievedChunk
from blendkv.sampling_params import SamplingParams

_END = object()  # the end of a stream, as a value a worker thread can hand back


def chunk_to_node(chunk: RetrievedChunk) -> NodeWithScore:
    """A retrieved chunk as a scored LlamaIndex node (id ``blendkv-chunk-<chunk_id>``)."""
    node = TextNode(
        id_=f"blendkv-chunk-{chunk.chunk_id}", text=chunk.text, metadata=chunk.retriever_metadata()
    )
    return NodeWithScore(node=node, score=chunk.score)


class BlendKVLlamaIndexRetriever(BaseRetriever):
    """The top ``similarity_top_k`` chunks of the pipeline's store as nodes, best first."""

    def __init__(self, pipeline, similarity_top_k: int = 6, **kwargs) -> None:
        self._pipeline = pipeline
        self._similarity_top_k = similarity_top_k
        super().__init__(**kwargs)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        chunks = self._pipeline.retrieve(query_bundle.query_str, self._similarity_top_k)
        return [chunk_to_node(c) for c in chunks]


class BlendKVQueryEngine(BaseQueryEngine):
    """Answers a question from the stored K/V of the chunks the pipeline retrieves for it.

    Args:
        pipeline: the :class:`~blendkv.rag.RAGPipeline` (its instruction and store).
        similarity_top_k: how many chunks to retrieve and blend.
        sampling_params: default greedy (temperature 0) with ``max_tokens=128``: a small
            model sampled at temperature 1 wanders off the passages.
        blend: a :class:`~blendkv.blend.config.BlendConfig`; None: the pipeline's default.
        system: a system message for the chat template, or None.
        streaming: ``query`` returns a ``StreamingResponse`` (``aquery`` an
            ``AsyncStreamingResponse``) whose generator yields the answer's text pieces.
        query_options: further keywords for ``RAGPipeline.query``/``stream_query``.

    ``Response.source_nodes`` are the chunks in prompt order; ``Response.metadata`` holds
    ``blend_stats`` (a dict), ``ttft_s`` and ``finish_reason``. A streaming response fills its
    ``source_nodes`` and ``metadata`` in when its stream ends (the pipeline hands the sources
    back with the finished answer); ``query`` returns once the first text piece is there, so
    an empty question or an empty store raises from ``query`` itself.
    """

    def __init__(
        self,
        pipeline,
        similarity_top_k: int = 6,
        sampling_params: SamplingParams | None = None,
        blend=None,
        system: str | None = None,
        streaming: bool = False,
        callback_manager: CallbackManager | None = None,
        **query_options: Any,
    ) -> None:
        self._pipeline = pipeline
        self._similarity_top_k = similarity_top_k
        self._sampling_params = sampling_params or SamplingParams(temperature=0.0, max_tokens=128)
        self._blend = blend
        self._system = system
        self._streaming = streaming
        self._query_options = query_options
        super().__init__(callback_manager=callback_manager)

    def _args(self, question: str) -> tuple:
        return (question, self._similarity_top_k, self._sampling_params, self._blend, self._system)

    def retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        """The chunks a query would be answered from, best first (``filter`` applied)."""
        k, options = self._similarity_top_k, self._query_options
        filters = {"filter": options["filter"]} if "filter" in options else {}
        chunks = self._pipeline.retrieve(query_bundle.query_str, k, **filters)
        return [chunk_to_node(c) for c in chunks]

    def _query(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        question = query_bundle.query_str
        if self._streaming:
            return self._stream(question)
        answer = self._pipeline.query(*self._args(question), **self._query_options)
        return Response(
            answer.answer, [chunk_to_node(c) for c in answer.sources], answer_metadata(answer)
        )

    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        # On a worker thread: the event loop keeps running, and concurrent queries batch.
        if not self._streaming:
            return await asyncio.to_thread(self._query, query_bundle)
        streamed = await asyncio.to_thread(self._stream, query_bundle.query_str)
        response = AsyncStreamingResponse(_in_thread(streamed.response_gen))
        response.source_nodes = streamed.source_nodes  # the same list and dict: filled at the end
        response.metadata = streamed.metadata
        return response

    def _stream(self, question: str) -> StreamingResponse:
        response = StreamingResponse(response_gen=iter(()), source_nodes=[], metadata={})
        items = self._pipeline.stream_query(*self._args(question), **self._query_options)

        def pieces() -> Iterator[str]:
            try:
                started = False
                for item in items:
                    if isinstance(item, RAGAnswer):
                        response.source_nodes.extend(chunk_to_node(c) for c in item.sources)
                        response.metadata.update(answer_metadata(item))
                        continue
                    if not started:  # the answer is stripped, so is the stream's start
                        item = item.lstrip()
                        started = bool(item)
                    if item:
                        yield item
            finally:
                items.close()  # abandoning the stream aborts the request

        gen = pieces()
        first = next(gen, None)  # retrieval errors raise here, in query()
        response.response_gen = _prepend(first, gen)
        return response

    def _get_prompt_modules(self) -> dict:
        return {}


def answer_metadata(answer: RAGAnswer) -> dict[str, Any]:
    """What a Response's metadata says about how the answer was made."""
    stats = answer.blend_stats.to_dict() if answer.blend_stats is not None else None
    return {"blend_stats": stats, "ttft_s": answer.ttft, "finish_reason": answer.finish_reason}


def _prepend(first: str | None, rest: Generator[str, None, None]) -> Iterator[str]:
    try:
        if first is not None:
            yield first
        yield from rest
    finally:
        rest.close()


async def _in_thread(gen: Iterator[str]) -> AsyncIterator[str]:
    """``gen``'s items, each pulled on a worker thread (the engine steps off the event loop)."""
    try:
        while (item := await asyncio.to_thread(next, gen, _END)) is not _END:
            yield item
    finally:
        close = getattr(gen, "close", None)
        if close is not None:
            await asyncio.to_thread(close)
