//! The server's Prometheus metrics (`GET /metrics`, text format).

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// Every metric the server exports, registered in one registry.
pub struct Metrics {
    registry: Registry,
    /// Requests answered, by endpoint and HTTP status.
    pub requests: IntCounterVec,
    pub prompt_tokens: IntCounter,
    pub generated_tokens: IntCounter,
    /// Requests waiting for a slot in the batch.
    pub queue_depth: IntGauge,
    /// Requests in the running batch.
    pub running: IntGauge,
    /// Requests decoded together, observed once per step.
    pub batch_size: Histogram,
    /// From a request's arrival to its first generated token (queueing and prompt included).
    pub time_to_first_token: Histogram,
    /// Between consecutive tokens of one request.
    pub time_per_output_token: Histogram,
    /// Tokens drafted by speculative passes, and those of them the model kept.
    pub speculative_drafted_tokens: IntCounter,
    pub speculative_accepted_tokens: IntCounter,
}

impl Metrics {
    pub fn new() -> prometheus::Result<Self> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new("difftx_requests_total", "HTTP requests answered, by endpoint and status"),
            &["endpoint", "status"],
        )?;
        let prompt_tokens = IntCounter::new("difftx_prompt_tokens_total", "Prompt tokens processed")?;
        let generated_tokens = IntCounter::new("difftx_generated_tokens_total", "Tokens generated")?;
        let queue_depth = IntGauge::new("difftx_queue_depth", "Requests waiting for a slot in the batch")?;
        let running = IntGauge::new("difftx_running_requests", "Requests in the running batch")?;
        let batch_size = Histogram::with_opts(
            HistogramOpts::new("difftx_batch_size", "Requests decoded together in one step")
                .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]),
        )?;
        let latency_buckets = vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
        let time_to_first_token = Histogram::with_opts(
            HistogramOpts::new("difftx_time_to_first_token_seconds", "From a request's arrival to its first token")
                .buckets(latency_buckets.clone()),
        )?;
        let time_per_output_token = Histogram::with_opts(
            HistogramOpts::new("difftx_time_per_output_token_seconds", "Between consecutive tokens of one request")
                .buckets(latency_buckets),
        )?;
        let speculative_drafted_tokens = IntCounter::new(
            "difftx_speculative_drafted_tokens_total",
            "Tokens drafted for requests decoded alone (--speculative)",
        )?;
        let speculative_accepted_tokens = IntCounter::new(
            "difftx_speculative_accepted_tokens_total",
            "Drafted tokens the model kept (--speculative)",
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(prompt_tokens.clone()))?;
        registry.register(Box::new(generated_tokens.clone()))?;
        registry.register(Box::new(queue_depth.clone()))?;
        registry.register(Box::new(running.clone()))?;
        registry.register(Box::new(batch_size.clone()))?;
        registry.register(Box::new(time_to_first_token.clone()))?;
        registry.register(Box::new(time_per_output_token.clone()))?;
        registry.register(Box::new(speculative_drafted_tokens.clone()))?;
        registry.register(Box::new(speculative_accepted_tokens.clone()))?;
        Ok(Metrics {
            registry,
            requests,
            prompt_tokens,
            generated_tokens,
            queue_depth,
            running,
            batch_size,
            time_to_first_token,
            time_per_output_token,
            speculative_drafted_tokens,
            speculative_accepted_tokens,
        })
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let encoder = prometheus::TextEncoder::new();
        if let Err(e) = encoder.encode_utf8(&self.registry.gather(), &mut out) {
            out = format!("# cannot encode metrics: {e}\n");
        }
        out
    }
}
