"""The server's Prometheus metrics, in a registry of their own (``/metrics`` renders it): requests by
outcome, the queue and the live sequences, tokens in and out, step time, time to first token,
inter-token latency, and a draft's proposals and acceptances (the engine's, in its process); whether the engine
process is up and how often it was restarted (the server process's own)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: from a millisecond (a tiny model's decode step) to a minute (a long prompt queued behind others)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OUTCOMES = ("stop", "length", "cancelled", "timeout", "error", "rejected")


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pipeline_requests", "Requests by outcome: finish_reason stop or length, cancelled "
                                "(the client went away), timeout, error, rejected (queue full, before any work)",
                                ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)
        self.queue_depth = Gauge("pipeline_queue_depth", "Requests waiting for a sequence", registry=r)
        self.live_sequences = Gauge("pipeline_live_sequences", "Sequences the session holds", registry=r)
        self.prompt_tokens = Counter("pipeline_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("pipeline_generation_tokens", "Tokens generated", registry=r)
        self.step_seconds = Histogram("pipeline_step_seconds", "Time of one program call (a target step or a "
                                      "speculative round)", buckets=LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("pipeline_time_to_first_token_seconds", "From arrival to the first token",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.itl_seconds = Histogram("pipeline_inter_token_latency_seconds", "Between a request's tokens",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.spec_proposed = Counter("pipeline_speculative_proposed_tokens", "Draft proposals the target verified", registry=r)
        self.spec_accepted = Counter("pipeline_speculative_accepted_tokens", "Draft proposals the target kept", registry=r)
        self.prefill_tokens = Counter("pipeline_prefill_tokens", "Prompt tokens prefilled (admitted less those a "
                                      "released sequence's rows held)", registry=r)
        self.prefix_queried_tokens = Counter("pipeline_prefix_cache_queried_tokens", "Prompt tokens of the requests "
                                             "admitted with the prefix cache on", registry=r)
        self.prefix_reused_tokens = Counter("pipeline_prefix_cache_reused_tokens", "Prompt tokens whose rows a "
                                            "released sequence held (not prefilled)", registry=r)
        self.prefix_hits = Counter("pipeline_prefix_cache_hits", "Requests that reused at least one prompt token",
                                   registry=r)
        self.prefix_hit_rate = Gauge("pipeline_prefix_cache_hit_rate", "Reused prompt tokens / queried prompt tokens, "
                                     "since the engine started (0 before any)", registry=r)
        self._queried = self._reused = 0  # the rate's terms (a Counter's value is not public)

    def count_prefill(self, prompt: int, reused: int, prefix_cache: bool) -> None:
        """A request of ``prompt`` tokens joined, ``reused`` of them held by a released sequence's rows."""
        self.prefill_tokens.inc(prompt - reused)
        if prefix_cache:
            self.prefix_queried_tokens.inc(prompt)
            self.prefix_reused_tokens.inc(reused)
            if reused:
                self.prefix_hits.inc()
            self._queried, self._reused = self._queried + prompt, self._reused + reused
            self.prefix_hit_rate.set(self._reused / self._queried)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ProcessMetrics:
    """The server process's own metrics, beside the engine process's: whether an engine serves, and how
    often a dead one was replaced (``--engine-restarts``)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.engine_up = Gauge("pipeline_engine_up", "1 while an engine process serves, 0 while it is down or restarting",
                               registry=self.registry)
        self.engine_restarts = Counter("pipeline_engine_restarts", "Engine processes started to replace a dead one",
                                       registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
