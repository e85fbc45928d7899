"""Optional semantic ranking of knowledge-base records by an embedding model.

Off by default: retrieval is BM25 (:mod:`.bm25`), which needs no server. With
``KERNELCREW_KB_EMBEDDING_MODEL`` set (``text-embedding-3-small``, or any model an
OpenAI-compatible server at ``KERNELCREW_LLM_BASE_URL`` serves: vLLM, Ollama, TEI...), the records
that pass retrieval's filters are ranked within their tier by a blend of the two:

    similarity = (BM25 / best BM25 of the query + cosine(query, record)) / 2

so a record that says the same thing in other words (``layer norm`` and ``LayerNorm``,
``attention`` and ``sdpa``) can rank above one that merely shares tokens. Vectors are kept in
memory per text (records repeat from query to query in a worker), at most :data:`MAX_TEXTS` texts
are embedded per query (the best by BM25; the rest keep their BM25 score), and a model or server
that fails leaves the ranking to BM25 and says why: retrieval never fails because of it.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence

from kernelcrew.config import Settings, openai_endpoint

MAX_TEXTS = 256
"""Texts embedded per query at most (the query and the best records by BM25)."""
CACHE_SIZE = 20_000
"""Vectors kept in memory (least recently used first out)."""


_SHARED: dict[tuple[str, str, str], Embedder] = {}


class Embedder:
    """Embeds texts with ``model`` through the OpenAI embeddings API (or a compatible server)."""

    def __init__(
        self, model: str, *, base_url: str = "", api_key: str = "", timeout_s: float = 30.0, retries: int = 2
    ) -> None:
        import openai

        self.model = model
        self.client = openai.OpenAI(
            api_key=api_key or "EMPTY",
            base_url=base_url or "https://api.openai.com/v1",  # not the SDK's OPENAI_BASE_URL
            timeout=timeout_s,
            max_retries=retries,
        )
        self._cache: OrderedDict[str, list[float]] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> Embedder | None:
        """The configured embedder, or None when ``kb_embedding_model`` is empty; one per model,
        server and key in a process, so its vectors are reused from request to request."""
        model = settings.kb_embedding_model.strip()
        if not model:
            return None
        base_url, key = openai_endpoint(settings)
        config = (model, base_url, key)
        if config not in _SHARED:
            _SHARED[config] = cls(
                model,
                base_url=config[1],
                api_key=key,
                timeout_s=min(settings.llm_timeout_s, 30.0),
                retries=min(settings.llm_max_retries, 2),
            )
        return _SHARED[config]

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """One vector per text (cached ones are not asked for again); raises on any failure."""
        with self._lock:
            found = {t: self._cache[t] for t in texts if t in self._cache}
        missing = list(dict.fromkeys(t for t in texts if t not in found))
        if missing:  # asked outside the lock: other threads' queries go on meanwhile
            reply = self.client.embeddings.create(model=self.model, input=missing)
            vectors = [item.embedding for item in sorted(reply.data, key=lambda d: d.index)]
            if len(vectors) != len(missing) or any(not v for v in vectors):
                raise ValueError(f"the model returned {len(vectors)} vectors for {len(missing)} texts")
            found.update((t, [float(x) for x in v]) for t, v in zip(missing, vectors, strict=True))
        with self._lock:
            for text, vector in found.items():
                self._cache[text] = vector
                self._cache.move_to_end(text)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return [found[t] for t in texts]

    def blend(
        self, query: str, documents: Sequence[str], bm25: Sequence[float]
    ) -> tuple[list[float] | None, str]:
        """``(similarities, "")``: the blended similarity of each document to ``query`` (see the
        module doc); ``(None, error)`` when the model could not be used (the caller keeps BM25)."""
        if not documents:
            return [], ""
        top = sorted(range(len(documents)), key=lambda i: -bm25[i])[: MAX_TEXTS - 1]
        try:
            vectors = self.embed([query, *(documents[i] for i in top)])
        except Exception as exc:  # any failure of a remote model: BM25 decides, and the hit says why
            return None, f"{type(exc).__name__}: {exc}"
        best = max(bm25) if max(bm25) > 0 else 1.0
        blended = [score / best / 2 for score in bm25]
        for i, vector in zip(top, vectors[1:], strict=True):
            blended[i] += cosine(vectors[0], vector) / 2
        return blended, ""


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity; 0 for a zero vector or vectors of different lengths."""
    if len(a) != len(b):
        return 0.0
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b, strict=True)) / norm if norm else 0.0
