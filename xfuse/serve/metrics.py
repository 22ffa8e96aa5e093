"""The Prometheus metrics of ``xfuse serve`` (one registry per service; rank 0 exports every rank's numbers, which
the workers send with their heartbeat answers)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

# Seconds: from a few tiny-model steps on a CPU to a large image on a slow link.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)


class ServeMetrics:
    """Counters, histograms and gauges of one service; `exposition` renders them as Prometheus text."""

    def __init__(self, *, world_size: int, info: dict[str, str]):
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            "xfuse_requests", "Image requests answered, by HTTP status", ["status"], registry=reg
        )  # exported as xfuse_requests_total
        self.images = Counter("xfuse_images_generated", "Images returned to clients", registry=reg)
        self.queue_wait = Histogram(
            "xfuse_queue_wait_seconds",
            "Time a request waited before its generation began",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.generation = Histogram(
            "xfuse_generation_seconds", "Time every rank spent on one request", buckets=LATENCY_BUCKETS, registry=reg
        )
        self.queue_depth = Gauge("xfuse_queue_depth", "Requests waiting behind the running one", registry=reg)
        self.queued_work = Gauge(
            "xfuse_queued_work",
            "Megapixel-steps waiting behind the running request (serve.max_queued_work)",
            registry=reg,
        )
        self.running = Gauge(
            "xfuse_requests_running", "Requests being generated (a batch of up to serve.max_batch)", registry=reg
        )
        self.ready = Gauge("xfuse_ready", "1 while /health answers 200", registry=reg)
        self.cancelled = Counter(
            "xfuse_cancelled_requests",
            "Requests stopped between two denoising steps on every rank because their clients went away",
            registry=reg,
        )  # exported as xfuse_cancelled_requests_total
        self.sent_bytes = Counter(
            "xfuse_sent_bytes", "Bytes a rank sent to other ranks for requests", ["rank"], registry=reg
        )
        self.cache_steps = Counter(
            "xfuse_cache_steps",
            "Denoising steps of requests by step caching's decision (every patch of a step takes its branch; "
            "summed over CFG groups, each deciding on its half)",
            ["decision"],
            registry=reg,
        )  # exported as xfuse_cache_steps_total{decision="computed"|"skipped"}
        self.heartbeat_age = Gauge(
            "xfuse_heartbeat_age_seconds", "Seconds since the rank last answered", ["rank"], registry=reg
        )
        self.peak_rss = Gauge(
            "xfuse_peak_rss_bytes", "Peak resident memory of the rank's process", ["rank"], registry=reg
        )
        Info("xfuse", "The served model and parallel layout", registry=reg).info(info)
        self._answered = [time.monotonic()] * world_size
        for decision in ("computed", "skipped"):
            self.cache_steps.labels(decision)
        for rank in range(world_size):
            self.sent_bytes.labels(str(rank))
            self.heartbeat_age.labels(str(rank)).set_function(lambda r=rank: time.monotonic() - self._answered[r])

    def answered(self, rank: int, at: float, peak_rss_bytes: int) -> None:
        """Rank ``rank`` answered (a heartbeat or the end of a request) at monotonic time ``at``."""
        self._answered[rank] = at
        self.peak_rss.labels(str(rank)).set(peak_rss_bytes)

    def reset_heartbeats(self) -> None:
        """Every rank counts as just answered (the world has formed: the service is ready)."""
        self._answered = [time.monotonic()] * len(self._answered)

    def heartbeat_ages(self) -> list[float]:
        now = time.monotonic()
        return [now - at for at in self._answered]

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
