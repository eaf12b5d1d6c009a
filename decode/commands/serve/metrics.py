"""What ``GET /metrics`` exports (Prometheus text format, one registry per server so tests can run several).

Counters only grow; rates (tokens/s, acceptance) are derived from them by Prometheus, and the gauges below
give the same at a glance: MAT and acceptance per draft position over the server's life, the last request's
decoding tokens/s, the queue length.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ...core.draft import RoundRecord

PREFIX = "adaspec"


class ServerMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_requests", "requests answered, by endpoint and outcome "
                                "(ok, stop, cancelled, timeout, or the HTTP status of an error)",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens of decoded requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "tokens generated", registry=r)
        self.target_forwards = Counter(f"{PREFIX}_target_forwards", "target forwards (verification rounds plus "
                                       "those arms ran)", registry=r)
        self.decode_seconds = Counter(f"{PREFIX}_decode_seconds", "seconds spent decoding (prefill + rounds)",
                                      registry=r)
        self.mat = Gauge(f"{PREFIX}_mean_accepted_tokens", "MAT: tokens per target forward over the server's life",
                         registry=r)
        self.drafted = Counter(f"{PREFIX}_drafted_at_position", "rounds whose draft reached position i",
                               ["position"], registry=r)
        self.accepted = Counter(f"{PREFIX}_accepted_at_position", "rounds whose draft token at position i was "
                                "accepted", ["position"], registry=r)
        self.acceptance = Gauge(f"{PREFIX}_acceptance_rate", "P(draft token i accepted | drafted) over the "
                                "server's life", ["position"], registry=r)
        self.pulls = Counter(f"{PREFIX}_arm_pulls", "rounds each arm was played", ["arm"], registry=r)
        self.tokens_per_s = Gauge(f"{PREFIX}_tokens_per_second", "decoding tokens/s of the last finished request",
                                  registry=r)
        self.queue = Gauge(f"{PREFIX}_queue_length", "requests waiting for the engine", registry=r)
        self.running = Gauge(f"{PREFIX}_running", "requests being decoded (0 or 1)", registry=r)
        self.latency = Histogram(f"{PREFIX}_request_seconds", "arrival to last token", registry=r,
                                 buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.first_token = Histogram(f"{PREFIX}_time_to_first_token_seconds", "arrival to first token",
                                     registry=r, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self._tokens = self._forwards = 0
        self._drafted: dict[int, int] = {}
        self._accepted: dict[int, int] = {}

    def round(self, rec: RoundRecord, label: str) -> None:
        """One round the engine played."""
        self.pulls.labels(label).inc()
        for i in range(1, rec.positions + 1):  # a tree's depth, not its node count
            self._drafted[i] = self._drafted.get(i, 0) + 1
            self.drafted.labels(str(i)).inc()
            if i <= rec.accepted:
                self._accepted[i] = self._accepted.get(i, 0) + 1
                self.accepted.labels(str(i)).inc()
            self.acceptance.labels(str(i)).set(self._accepted.get(i, 0) / self._drafted[i])

    def generation(self, prompt_tokens: int, tokens: int, forwards: int, seconds: float) -> None:
        """One request's decoding finished (or stopped early)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(tokens)
        self.target_forwards.inc(forwards)
        self.decode_seconds.inc(seconds)
        self._tokens += tokens
        self._forwards += forwards
        if self._forwards:
            self.mat.set(self._tokens / self._forwards)
        if seconds > 0:
            self.tokens_per_s.set(tokens / seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
