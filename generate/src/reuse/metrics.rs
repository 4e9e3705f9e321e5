//! The passage cache's Prometheus metrics. They live with the cache that moves them; the
//! service registers the same collectors in its own registry (docent's `metrics`).

use std::sync::OnceLock;

use prometheus::{IntCounterVec, IntGauge, Opts};

/// The passage cache's counters and gauges (one set per process).
pub struct ReuseMetrics {
    /// Passage-cache lookups by result (`hit`, `miss`): passages' keys and values reused.
    pub lookups: IntCounterVec,
    /// Bytes the passage cache holds in memory.
    pub bytes: IntGauge,
    /// Bytes of passage blocks on disk.
    pub disk_bytes: IntGauge,
}

/// The process's passage-cache metrics.
pub fn metrics() -> &'static ReuseMetrics {
    static METRICS: OnceLock<ReuseMetrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let lookups = IntCounterVec::new(
            Opts::new(
                "docent_passage_cache_total",
                "Passage-cache lookups by result (hit: in memory or on disk, miss).",
            ),
            &["result"],
        )
        .expect("static metric definition");
        for r in ["hit", "miss"] {
            lookups.with_label_values(&[r]);
        }
        ReuseMetrics {
            lookups,
            bytes: IntGauge::new(
                "docent_passage_cache_bytes",
                "Bytes of passages' keys and values the passage cache holds in memory.",
            )
            .expect("static metric definition"),
            disk_bytes: IntGauge::new(
                "docent_passage_cache_disk_bytes",
                "Bytes of passages' keys and values on disk beside the index.",
            )
            .expect("static metric definition"),
        }
    })
}
