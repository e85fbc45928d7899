"""BM25 (Okapi) ranking over short texts: signatures, strategy names and descriptions.

Small on purpose: the knowledge base ranks at most a few thousand records per query, so an
in-memory index built per query is enough (no search engine). :func:`tokenize` is tuned to
signatures: besides words it keeps ``rows=4096``-style facts and op bigrams (``mul>add``), so two
tasks that chain the same ops in the same order score higher than two that merely share ops.

Scoring, for a query q and a document d with term frequency f(t, d), length |d| and average
length avgdl over N documents of which n(t) contain t::

    score(q, d) = sum over distinct t in q of
                  idf(t) * f(t, d) * (k1 + 1) / (f(t, d) + k1 * (1 - b + b * |d| / avgdl))
    idf(t)      = ln(1 + (N - n(t) + 0.5) / (n(t) + 0.5))     (never negative)

with the usual k1 = 1.5, b = 0.75. An embedding model can be blended in (:mod:`.embeddings`).
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Sequence

STOPWORDS = frozenset(
    {"a", "an", "and", "are", "as", "at", "be", "by", "for", "from", "in", "is", "it", "of", "on", "or"}
    | {"that", "the", "this", "to", "with", "x", "ops", "dtypes", "shape", "rows", "cols", "l2"}
)
_WORD = re.compile(r"[a-z0-9_]+")
_FACT = re.compile(r"\b(rows|cols)=(\d+)")
_CHAIN = re.compile(r"ops=([a-z0-9_>.+]+)")
_REGIME = re.compile(r"\((launch|<l2|>=l2)\)")
REGIMES = {"launch": "regime=launch", "<l2": "regime=l2", ">=l2": "regime=hbm"}


def tokenize(text: str) -> list[str]:
    """Words (lowercase; stopwords and bare numbers dropped), the shape facts of a signature
    (``rows=4096``, ``cols=4096``, ``regime=hbm``) and its op bigrams (``mul>add``)."""
    low = text.lower()
    tokens = []
    for word in _WORD.findall(low):
        if word not in STOPWORDS and not word.isdigit():
            tokens.append(word)
            if "_" in word.strip("_"):  # fused_pointwise also matches "fused" and "pointwise"
                tokens += [
                    p for p in word.split("_") if len(p) > 2 and not p.isdigit() and p not in STOPWORDS
                ]
    tokens += [f"{k}={v}" for k, v in _FACT.findall(low)]
    tokens += [REGIMES[r] for r in _REGIME.findall(low)]
    for chain in _CHAIN.findall(low):
        ops = [op for op in chain.split(">") if op and not op.startswith("...")]
        tokens += [f"{a}>{b}" for a, b in itertools.pairwise(ops)]
    return tokens


class BM25:
    """An index of tokenized documents; :meth:`scores` ranks them against a query."""

    def __init__(self, documents: Sequence[Sequence[str]], *, k1: float = 1.5, b: float = 0.75) -> None:
        if k1 < 0 or not 0 <= b <= 1:
            raise ValueError(f"BM25 needs k1 >= 0 and 0 <= b <= 1 (got k1={k1}, b={b})")
        self.k1, self.b = k1, b
        self.freqs = [Counter(doc) for doc in documents]
        self.lengths = [len(doc) for doc in documents]
        self.avgdl = (sum(self.lengths) / len(self.lengths)) if self.lengths else 0.0
        df: Counter[str] = Counter()
        for freq in self.freqs:
            df.update(freq.keys())
        n = len(self.freqs)
        self.idf = {t: math.log(1 + (n - c + 0.5) / (c + 0.5)) for t, c in df.items()}

    def score(self, query: Sequence[str], index: int) -> float:
        """The BM25 score of document ``index`` for ``query`` (0 when they share no term)."""
        freq = self.freqs[index]
        norm = self.k1 * (1 - self.b + self.b * self.lengths[index] / self.avgdl) if self.avgdl else 0.0
        total = 0.0
        for term in set(query):
            f = freq.get(term, 0)
            if f:
                total += self.idf[term] * f * (self.k1 + 1) / (f + norm)
        return total

    def scores(self, query: Sequence[str]) -> list[float]:
        """One score per document, in index order."""
        return [self.score(query, i) for i in range(len(self.freqs))]


__all__ = ["BM25", "tokenize"]
