"""Prometheus text exposition (format 0.0.4) for the server, hand-rolled.

A dependency on ``prometheus_client`` would buy a global registry we do not want (tests start several
servers in one process); the text format is small, so each ``Metrics`` object owns its own families and
renders them itself. Every method is thread-safe: the engine worker thread observes latencies while the
event loop counts requests and renders ``/metrics``.
"""
from __future__ import annotations

import math
import threading
from bisect import bisect_left

# Bucket edges. TTFT spans a few ms (GPU, short prompt) to tens of seconds (CPU reference, long prompt);
# inter-token latency spans sub-ms (monokernel) to ~1 s (CPU); tok/s spans ~1 (CPU) to >3000 (TP GPU).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TOKS_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 1500, 2000, 3000, 5000)


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    esc = lambda s: str(s).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in pairs) + "}"


class Histogram:
    """Cumulative-bucket histogram without labels."""

    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_, tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)  # last slot: above the top edge (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, v: float) -> None:
        if v is None or not math.isfinite(v):
            return
        with self._lock:
            # bisect_left: a value equal to an edge belongs to that bucket (Prometheus "le" = less or equal)
            self._counts[bisect_left(self.buckets, v)] += 1
            self._sum += v

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def render(self) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cum = 0
        for edge, c in zip(self.buckets + (math.inf,), counts):
            cum += c
            out.append(f'{self.name}_bucket{{le="{_fmt(edge)}"}} {cum}')
        out += [f"{self.name}_sum {_fmt(total)}", f"{self.name}_count {cum}"]
        return out


class Counter:
    """Monotonic counter with an optional fixed label set."""

    def __init__(self, name: str, help_: str, labelnames: tuple[str, ...] = ()):
        self.name, self.help, self.labelnames = name, help_, labelnames
        self._values: dict[tuple[tuple[str, str], ...], float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name}: labels {sorted(labels)} != {sorted(self.labelnames)}")
        key = tuple((k, str(labels[k])) for k in self.labelnames)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        key = tuple((k, str(labels[k])) for k in self.labelnames)
        with self._lock:
            return self._values.get(key, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        if not items and not self.labelnames:
            items = [((), 0.0)]
        out += [f"{self.name}{_labels(k)} {_fmt(v)}" for k, v in items]
        return out


class Gauge:
    """A value read at render time from a callable (queue depth lives in the queue, not here)."""

    def __init__(self, name: str, help_: str, read):
        self.name, self.help, self._read = name, help_, read

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge", f"{self.name} {_fmt(self._read())}"]


class Metrics:
    """The server's metric families. ``queue_depth`` and ``running`` are callables owned by the server."""

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, queue_depth=lambda: 0, running=lambda: 0):
        p = "hipengine_"
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "Time from request arrival to the first generated text (queue wait included).",
                              TTFT_BUCKETS)
        self.itl = Histogram(p + "inter_token_latency_seconds",
                             "Time between consecutive streamed text pieces of one request.", ITL_BUCKETS)
        self.decode_tok_s = Histogram(p + "decode_tokens_per_second",
                                      "Decode speed of each finished request, as measured by the engine.",
                                      TOKS_BUCKETS)
        self.queue_wait = Histogram(p + "queue_wait_seconds", "Time a request waited for the engine.",
                                    TTFT_BUCKETS)
        self.requests = Counter(p + "requests_total", "Generation requests by endpoint and HTTP status.",
                                ("endpoint", "status"))
        self.finished = Counter(p + "requests_finished_total",
                                "Requests that reached the engine, by finish reason (stop, length, cancelled, error).",
                                ("reason",))
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens processed.")
        self.output_tokens = Counter(p + "generation_tokens_total", "Tokens generated.")
        self._gauges = [Gauge(p + "queue_depth", "Requests waiting for the engine (the running one excluded).",
                              queue_depth),
                        Gauge(p + "requests_running", "Requests the engine is decoding now (0 or 1).", running)]

    def render(self) -> str:
        lines: list[str] = []
        for fam in (self.ttft, self.itl, self.decode_tok_s, self.queue_wait, self.requests, self.finished,
                    self.prompt_tokens, self.output_tokens, *self._gauges):
            lines += fam.render()
        return "\n".join(lines) + "\n"
