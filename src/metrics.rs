//! Process-wide counters and latency histograms, rendered in Prometheus' text format by
//! `runner serve` (`GET /metrics`). Any layer records into it; only the API renders it.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

/// Upper bounds (seconds) of the latency buckets: sub-millisecond execs to minute-long pulls.
const BUCKETS: [f64; 16] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// What each metric is, for `# HELP`.
const HELP: &[(&str, &str)] = &[
    (
        "runner_http_request_duration_seconds",
        "HTTP requests by route template, method and status, and how long they took",
    ),
    (
        "runner_container_operation_seconds",
        "containerd operations of the runtime (create, start, exec) and how long they took",
    ),
    ("runner_errors_total", "failed requests by kind of error"),
    (
        "runner_cgroup_attach_warm_writes_total",
        "writes that kept the kernel's cgroup attach lock warm while runc created containers",
    ),
    (
        "runner_cgroup_attach_warm_calibrations_total",
        "what this process's first quiet write found: pays (kept on), saves-nothing (turned off), favordynmods (never started)",
    ),
    (
        "runner_pool_keys_computed_total",
        "pool keys computed (image resolved, member spec built and hashed): by fills, and by claims that found none kept or found the kept one's image moved",
    ),
    (
        "runner_pool_image_reads_total",
        "image record reads that confirmed a kept pool key, by whether the read was sent ahead when the session's request arrived",
    ),
    (
        "runner_warm_shims_total",
        "warm shims (seeds): made, used by a cold create, missed (a cold create found none ready), failed to start",
    ),
    (
        "runner_containerd_revivals_total",
        "times runner's private containerd was found dead (not stopped on purpose) and started again: started, failed",
    ),
    (
        "runner_evictions_total",
        "sandboxes evicted, by reason (ephemeral-storage: over resources.ephemeralStorage)",
    ),
];

type Labels = Vec<(&'static str, String)>;

#[derive(Default)]
struct Histogram {
    /// Per bucket (not cumulative; summed when rendered).
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

#[derive(Default)]
struct Registry {
    histograms: Mutex<BTreeMap<(&'static str, Labels), Arc<Histogram>>>,
    counters: Mutex<BTreeMap<(&'static str, Labels), Arc<AtomicU64>>>,
}

static REGISTRY: LazyLock<Registry> = LazyLock::new(Registry::default);

/// Record one observation of a latency.
pub fn observe(name: &'static str, labels: &[(&'static str, &str)], took: Duration) {
    let key = (name, owned(labels));
    let histogram = REGISTRY
        .histograms
        .lock()
        .expect("metrics lock")
        .entry(key)
        .or_default()
        .clone();
    let seconds = took.as_secs_f64();
    if let Some(i) = BUCKETS.iter().position(|b| seconds <= *b) {
        histogram.buckets[i].fetch_add(1, Ordering::Relaxed);
    }
    histogram.count.fetch_add(1, Ordering::Relaxed);
    histogram
        .sum_nanos
        .fetch_add(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
}

/// Add one to a counter.
pub fn increment(name: &'static str, labels: &[(&'static str, &str)]) {
    REGISTRY
        .counters
        .lock()
        .expect("metrics lock")
        .entry((name, owned(labels)))
        .or_default()
        .fetch_add(1, Ordering::Relaxed);
}

fn owned(labels: &[(&'static str, &str)]) -> Labels {
    labels.iter().map(|(k, v)| (*k, v.to_string())).collect()
}

/// A label value escaped as the text format wants (`\\`, `\"`, `\n`).
fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn label_text(labels: &[(&str, String)], extra: Option<(&str, &str)>) -> String {
    let mut parts: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
    if let Some((k, v)) = extra {
        parts.push(format!("{k}=\"{}\"", escape(v)));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

fn help(out: &mut String, name: &str, kind: &str) {
    let text = HELP.iter().find(|(n, _)| *n == name).map_or(name, |(_, h)| h);
    let _ = writeln!(out, "# HELP {name} {text}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// A gauge computed by the caller at render time (sessions live, jobs by phase).
pub struct Gauge<'a> {
    pub name: &'a str,
    pub help: &'a str,
    pub values: Vec<(Vec<(&'a str, String)>, f64)>,
}

/// Everything recorded, and the given gauges, in the Prometheus text format (0.0.4).
pub fn render(gauges: &[Gauge<'_>]) -> String {
    let mut out = String::new();
    for gauge in gauges {
        let _ = writeln!(out, "# HELP {} {}", gauge.name, gauge.help);
        let _ = writeln!(out, "# TYPE {} gauge", gauge.name);
        for (labels, value) in &gauge.values {
            let labels: Vec<(&str, String)> = labels.clone();
            let _ = writeln!(out, "{}{} {value}", gauge.name, label_text(&labels, None));
        }
    }
    let counters = REGISTRY.counters.lock().expect("metrics lock");
    let mut last = "";
    for ((name, labels), value) in counters.iter() {
        if *name != last {
            help(&mut out, name, "counter");
            last = name;
        }
        let _ = writeln!(
            out,
            "{name}{} {}",
            label_text(labels, None),
            value.load(Ordering::Relaxed)
        );
    }
    drop(counters);
    let histograms = REGISTRY.histograms.lock().expect("metrics lock");
    let mut last = "";
    for ((name, labels), h) in histograms.iter() {
        if *name != last {
            help(&mut out, name, "histogram");
            last = name;
        }
        let mut cumulative = 0;
        for (bound, bucket) in BUCKETS.iter().zip(&h.buckets) {
            cumulative += bucket.load(Ordering::Relaxed);
            let le = bound.to_string();
            let _ = writeln!(
                out,
                "{name}_bucket{} {cumulative}",
                label_text(labels, Some(("le", &le)))
            );
        }
        let count = h.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{} {count}", label_text(labels, Some(("le", "+Inf"))));
        let sum = h.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum{} {sum}", label_text(labels, None));
        let _ = writeln!(out, "{name}_count{} {count}", label_text(labels, None));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_labels_escaped() {
        let labels = [("route", "/t/\"q\""), ("method", "GET")];
        observe("runner_test_seconds", &labels, Duration::from_micros(300));
        observe("runner_test_seconds", &labels, Duration::from_millis(20));
        observe("runner_test_seconds", &labels, Duration::from_secs(100));
        increment("runner_test_total", &[("kind", "x")]);
        let text = render(&[Gauge {
            name: "runner_test_live",
            help: "test",
            values: vec![(vec![], 3.0)],
        }]);
        assert!(text.contains("runner_test_live 3\n"), "{text}");
        assert!(text.contains("runner_test_total{kind=\"x\"} 1\n"), "{text}");
        let line =
            |le: &str| format!("runner_test_seconds_bucket{{route=\"/t/\\\"q\\\"\",method=\"GET\",le=\"{le}\"}}");
        assert!(text.contains(&format!("{} 1\n", line("0.0005"))), "{text}");
        assert!(text.contains(&format!("{} 2\n", line("0.025"))), "{text}");
        assert!(text.contains(&format!("{} 2\n", line("60"))), "{text}");
        assert!(text.contains(&format!("{} 3\n", line("+Inf"))), "{text}");
        assert!(text.contains("# TYPE runner_test_seconds histogram"), "{text}");
    }
}
