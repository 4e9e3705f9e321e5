//! Prometheus metrics of the whole service, served as text by `GET /metrics`.
//!
//! One process-wide set ([`metrics`]): the HTTP layer records requests, the query path
//! records its stages, the ingest jobs their outcomes. Nothing here depends on the rest
//! of docent, so every stage can record without import cycles.

use std::sync::OnceLock;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

/// The stages of the query path timed by `docent_stage_seconds`.
pub const STAGES: [&str; 6] = [
    "embed",
    "retrieve",
    "prompt",
    "ttft",
    "generate",
    "postprocess",
];

/// Every metric of the service, registered in one registry; get the process's set with
/// [`metrics`]. Each field's Prometheus name starts with `docent_`.
pub struct Metrics {
    registry: Registry,
    /// Requests by route (the pattern, not the path), method and status.
    pub http_requests: IntCounterVec,
    /// Request latency by route (until the response head; streams run on after it).
    pub http_seconds: HistogramVec,
    /// Requests being handled now.
    pub in_flight: IntGauge,
    /// Time per stage of an answer.
    pub stage_seconds: HistogramVec,
    /// Generated tokens per second of generation, per answer.
    pub tokens_per_second: Histogram,
    /// Generated tokens.
    pub tokens: IntCounter,
    /// Answers waiting for or in generation.
    pub queue_depth: IntGauge,
    /// Ingest jobs by outcome (`accepted`, `done`, `failed`).
    pub ingest_jobs: IntCounterVec,
    /// Chunks written by ingest jobs.
    pub ingest_chunks: IntCounter,
    /// Safety-filter decisions by reason (`checked`, `blocked`, `prompt_injection:document`…).
    pub safety: IntCounterVec,
    /// Answer-cache lookups by result (`hit`, `miss`).
    pub cache: IntCounterVec,
    /// Requests refused by the rate limiter, the concurrency limit or the generation queue.
    pub rejected: IntCounterVec,
}

fn histogram(name: &str, help: &str, labels: &[&str], buckets: Vec<f64>) -> HistogramVec {
    HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)
        .expect("static metric definition")
}

fn counter(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("static metric definition")
}

impl Metrics {
    fn new() -> Metrics {
        let latency = prometheus::exponential_buckets(0.001, 2.0, 18).expect("static buckets");
        let reuse = docent_generate::reuse::metrics::metrics();
        let m = Metrics {
            registry: Registry::new(),
            http_requests: counter(
                "docent_http_requests_total",
                "HTTP requests by route, method and status.",
                &["route", "method", "status"],
            ),
            http_seconds: histogram(
                "docent_http_request_duration_seconds",
                "HTTP request latency until the response head, by route.",
                &["route"],
                latency.clone(),
            ),
            in_flight: IntGauge::new("docent_http_in_flight", "HTTP requests being handled.")
                .expect("static metric definition"),
            stage_seconds: histogram(
                "docent_stage_duration_seconds",
                "Time per stage of the query path (embed, retrieve, prompt, ttft, generate, postprocess).",
                &["stage"],
                latency,
            ),
            tokens_per_second: Histogram::with_opts(
                HistogramOpts::new(
                    "docent_generation_tokens_per_second",
                    "Generated tokens per second of generation time, per answer.",
                )
                .buckets(prometheus::exponential_buckets(1.0, 2.0, 12).expect("static buckets")),
            )
            .expect("static metric definition"),
            tokens: IntCounter::new("docent_generated_tokens_total", "Generated tokens.")
                .expect("static metric definition"),
            queue_depth: IntGauge::new(
                "docent_generation_queue_depth",
                "Answers waiting for or in generation.",
            )
            .expect("static metric definition"),
            ingest_jobs: counter(
                "docent_ingest_jobs_total",
                "Ingest jobs by outcome (accepted, done, failed).",
                &["outcome"],
            ),
            ingest_chunks: IntCounter::new(
                "docent_ingest_chunks_total",
                "Chunks written by ingest jobs.",
            )
            .expect("static metric definition"),
            safety: counter(
                "docent_safety_decisions_total",
                "Safety-filter decisions by reason.",
                &["reason"],
            ),
            cache: counter(
                "docent_answer_cache_total",
                "Answer-cache lookups by result (hit, miss).",
                &["result"],
            ),
            rejected: counter(
                "docent_rejected_requests_total",
                "Requests refused by a limit (rate, concurrency, queue, timeout).",
                &["reason"],
            ),
        };
        let r = &m.registry;
        for c in [
            Box::new(m.http_requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(m.http_seconds.clone()),
            Box::new(m.in_flight.clone()),
            Box::new(m.stage_seconds.clone()),
            Box::new(m.tokens_per_second.clone()),
            Box::new(m.tokens.clone()),
            Box::new(m.queue_depth.clone()),
            Box::new(m.ingest_jobs.clone()),
            Box::new(m.ingest_chunks.clone()),
            Box::new(m.safety.clone()),
            Box::new(m.cache.clone()),
            Box::new(m.rejected.clone()),
            // the passage cache's own collectors (docent_generate::reuse::metrics)
            Box::new(reuse.lookups.clone()),
            Box::new(reuse.bytes.clone()),
            Box::new(reuse.disk_bytes.clone()),
        ] {
            r.register(c).expect("metric names are unique");
        }
        // every stage and outcome appears from the start, at zero
        for s in STAGES {
            m.stage_seconds.with_label_values(&[s]);
        }
        for o in ["accepted", "done", "failed"] {
            m.ingest_jobs.with_label_values(&[o]);
        }
        for r in ["hit", "miss"] {
            m.cache.with_label_values(&[r]);
        }
        m
    }

    /// Records `seconds` spent in a stage of the query path.
    pub fn stage(&self, stage: &str, seconds: f64) {
        self.stage_seconds
            .with_label_values(&[stage])
            .observe(seconds);
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        // encoding into a Vec cannot fail for the text format
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

/// The process's metrics.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_family_in_text_format() {
        let m = Metrics::new();
        m.http_requests
            .with_label_values(&["/v1/query", "POST", "200"])
            .inc();
        m.stage("embed", 0.004);
        let text = m.render();
        for family in [
            "docent_http_requests_total{method=\"POST\",route=\"/v1/query\",status=\"200\"} 1",
            "# TYPE docent_stage_duration_seconds histogram",
            "docent_stage_duration_seconds_count{stage=\"embed\"} 1",
            "docent_stage_duration_seconds_count{stage=\"ttft\"} 0",
            "docent_ingest_jobs_total{outcome=\"failed\"} 0",
            "docent_answer_cache_total{result=\"hit\"} 0",
            "# TYPE docent_generation_queue_depth gauge",
        ] {
            assert!(text.contains(family), "missing {family:?} in\n{text}");
        }
    }
}
