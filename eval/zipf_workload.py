"""A RAG workload whose documents follow a Zipf popularity: what ``blendkv bench replicas``
sends to live replicas and ``blendkv bench route-sim`` replays against 2..64 simulated ones.

    corpus      ``num_documents`` passages, deterministic from the seed; each one distinct
                (a title with its number, then sentences of a fixed vocabulary), about
                ``document_words`` words: short enough to be one chunk when ingested
    topics      consecutive runs of ``topic_size`` documents (1: every document its own
                topic): similar questions retrieve overlapping chunks, so a request draws
                its documents from one topic
    popularity  a random permutation ranks the topics; the topic of rank r (1-based) is
                drawn with probability proportional to 1 / r**zipf_s (s = 1: the classic
                Zipf law; larger s, a hotter head); a document's popularity is its topic's
    a request   a topic drawn by popularity, then ``documents_per_request`` distinct
                documents of it (uniformly; with topics of one document, distinct topics),
                in draw order, and a question naming the first one
    arrivals    open loop, Poisson: exponential gaps of mean 1 / ``rate`` seconds (rate None:
                all at t = 0, for a closed loop)

The same :class:`ZipfWorkload` (seed included) gives the same corpus and the same requests, so
routers compared in one run see exactly the same traffic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORDS = (
    "harbour lighthouse copper bridge river valley orchard museum tram station archive "
    "ledger winter summer festival granite quarry mill canal lock keeper ferry market guild "
    "tower bell clock garden meadow forest cliff island road north south east west old new "
    "stone timber glass iron salt wool grain fish honey wine bread lamp map coin"
).split()


@dataclass(frozen=True)
class WorkloadRequest:
    """One request: its documents (indices into the corpus), its question, when it arrives."""

    documents: tuple[int, ...]
    question: str
    arrival_s: float


@dataclass(frozen=True)
class ZipfWorkload:
    num_documents: int = 48
    documents_per_request: int = 4
    topic_size: int = 1
    zipf_s: float = 1.0
    num_requests: int = 64
    document_words: int = 140
    rate: float | None = None  # requests per second (Poisson); None: all at once
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_documents < self.documents_per_request or self.documents_per_request < 1:
            raise ValueError(
                f"need 1 <= documents_per_request ({self.documents_per_request}) <= "
                f"num_documents ({self.num_documents})"
            )
        if self.topic_size < 1 or self.num_documents % self.topic_size:
            raise ValueError(
                f"topic_size ({self.topic_size}) must divide num_documents ({self.num_documents})"
            )
        if 1 < self.topic_size < self.documents_per_request:
            raise ValueError("a topic must hold documents_per_request documents")
        if self.zipf_s < 0 or self.num_requests < 1 or self.document_words < 8:
            raise ValueError("zipf_s >= 0, num_requests >= 1 and document_words >= 8")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")

    def corpus(self) -> list[str]:
        """The passages, by document index."""
        rng = random.Random(f"corpus-{self.seed}")
        out = []
        for i in range(self.num_documents):
            words = [rng.choice(_WORDS) for _ in range(self.document_words)]
            sentences = [" ".join(words[j : j + 10]) for j in range(0, len(words), 10)]
            out.append(f"Passage {i}. " + ". ".join(s.capitalize() for s in sentences) + ".")
        return out

    @property
    def num_topics(self) -> int:
        return self.num_documents // self.topic_size

    def weights(self) -> list[float]:
        """Each topic's draw probability, by topic index (they sum to 1)."""
        order = list(range(self.num_topics))
        random.Random(f"ranks-{self.seed}").shuffle(order)
        raw = [0.0] * self.num_topics
        for rank, topic in enumerate(order, start=1):
            raw[topic] = 1.0 / rank**self.zipf_s
        total = sum(raw)
        return [w / total for w in raw]

    def requests(self) -> list[WorkloadRequest]:
        rng = random.Random(f"requests-{self.seed}")
        weights = self.weights()
        topics = list(range(self.num_topics))
        size = self.topic_size
        out, t = [], 0.0
        for _ in range(self.num_requests):
            if size == 1:  # distinct documents, each drawn by popularity
                chosen: list[int] = []
                while len(chosen) < self.documents_per_request:
                    d = rng.choices(topics, weights)[0]
                    if d not in chosen:
                        chosen.append(d)
            else:
                topic = rng.choices(topics, weights)[0]
                members = range(topic * size, (topic + 1) * size)
                chosen = rng.sample(members, self.documents_per_request)
            if self.rate is not None:
                t += rng.expovariate(self.rate)
            out.append(WorkloadRequest(tuple(chosen), f"What does passage {chosen[0]} say?", t))
        return out
