"""Knowledge-base retrieval with an embedding model (KERNELCREW_KB_EMBEDDING_MODEL).

The model is served over HTTP by a small OpenAI-compatible server in this process: its vectors
count concepts, with a few synonyms folded together, so "standardize" lands near "norm" as a
real embedding model's would, while BM25 sees no common token.
"""

from __future__ import annotations

import json
import re
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kernelcrew.config import Settings
from kernelcrew.knowledge_base import KnowledgeBase
from kernelcrew.knowledge_base.embeddings import Embedder, cosine

SYNONYMS = {"standardize": "norm", "standardization": "norm", "layernorm": "norm", "rmsnorm": "norm"}
DIM = 512


def concept_vector(text: str) -> list[float]:
    vector = [0.0] * DIM
    for word in re.findall(r"[a-z]+", text.lower()):
        vector[zlib.crc32(SYNONYMS.get(word, word).encode()) % DIM] += 1.0
    return vector


class EmbeddingServer:
    """``POST /v1/embeddings`` as OpenAI answers it; ``fail`` makes it answer 500."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail = False
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(body)
                if owner.fail or self.path != "/v1/embeddings":
                    self.send_response(500)
                    self.end_headers()
                    return
                data = [
                    {"object": "embedding", "index": i, "embedding": concept_vector(text)}
                    for i, text in enumerate(body["input"])
                ]
                usage = {"prompt_tokens": 1, "total_tokens": 1}
                payload = json.dumps(
                    {"object": "list", "model": body["model"], "data": data, "usage": usage}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server() -> Iterator[EmbeddingServer]:
    s = EmbeddingServer()
    yield s
    s.close()


def open_kb(tmp_path, server: EmbeddingServer | None, model: str = "concept-embed") -> KnowledgeBase:
    settings = Settings(
        data_dir=tmp_path / "data",
        kb_embedding_model=model if server else "",
        llm_base_url=server.url if server else "",
        llm_max_retries=0,
    )
    return KnowledgeBase.open(settings, owner="alice")


def test_a_query_in_other_words_finds_the_record_bm25_alone_misses(tmp_path, server):
    query = "standardize"
    assert open_kb(tmp_path, None).search(query, arch="sm_90") == [], "no token in common with a record"
    hits = open_kb(tmp_path, server).search(query, arch="sm_90")
    assert "row_reduction" in [h["strategy"] for h in hits], "its description says norm"
    assert all("BM25 + concept-embed" in h["why"] and h["score"] > 0 for h in hits)
    assert server.requests and server.requests[0]["model"] == "concept-embed"
    assert server.requests[0]["input"][0] == query


def test_vectors_are_asked_for_once_per_text(tmp_path, server):
    kb = open_kb(tmp_path, server)
    first = kb.search("online softmax welford", arch="sm_90")
    asked = sum(len(r["input"]) for r in server.requests)
    assert kb.search("online softmax welford", arch="sm_90") == first
    assert sum(len(r["input"]) for r in server.requests) == asked, "the second query was answered from memory"


def test_a_failing_model_leaves_the_ranking_to_bm25_and_says_why(tmp_path, server):
    server.fail = True
    bm25 = open_kb(tmp_path, None).search("online softmax welford", arch="sm_90")
    hits = open_kb(tmp_path, server, model="failing-embed").search("online softmax welford", arch="sm_90")
    assert [h["id"] for h in hits] == [h["id"] for h in bm25]
    assert all("embeddings failed" in h["why"] for h in hits)


def test_the_crew_gets_blended_hits_for_a_task(tmp_path, server):
    sig = "ops=layer_norm | dtypes=float32 | shape=2d rows=4096 x cols=4096 (>=L2)"
    hits = open_kb(tmp_path, server).hits_for_task(sig, "h100-sxm", "sm_90")
    assert hits and all(h["arch"] == "sm_90" for h in hits)
    assert any("BM25 + concept-embed" in h["why"] for h in hits)


def test_one_embedder_per_configuration_and_none_without_a_model(tmp_path, server):
    on = Settings(data_dir=tmp_path, kb_embedding_model="m", llm_base_url=server.url)
    assert Embedder.from_settings(on) is Embedder.from_settings(on)
    assert Embedder.from_settings(Settings(data_dir=tmp_path)) is None
    assert cosine([1.0, 0.0], [0.0, 1.0]) == 0.0 and cosine([1.0], [1.0, 2.0]) == 0.0
    assert cosine([0.0, 0.0], [1.0, 1.0]) == 0.0 and cosine([2.0, 0.0], [3.0, 0.0]) == pytest.approx(1.0)
