//! The worker's Prometheus metrics (own registry, `diphoma_worker_` prefix, no labels), the
//! `/metrics` endpoint, and [`Metered`]: a ring source that records them. It decides nothing
//! about what to record beyond what the ring source is told.

use std::net::SocketAddr;

use diphoma_ring::k8s::KubeError;
use diphoma_ring::source::{Control, Generation, Progress, RingSource};
use diphoma_ring::{AbortHandle, CommError};
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntGauge, Registry, TextEncoder,
};

/// Every metric the worker exports.
#[derive(Clone, Debug)]
pub struct WorkerMetrics {
    registry: Registry,
    /// `diphoma_worker_allreduce_seconds`: duration of each step's fused gradient allreduce.
    pub allreduce_seconds: Histogram,
    /// `diphoma_worker_allreduce_bytes_total`: bytes allreduced (buffer size per call).
    pub allreduce_bytes: IntCounter,
    /// `diphoma_worker_step`: last committed step.
    pub step: IntGauge,
    /// `diphoma_worker_loss`: global mean training loss of the last committed step.
    pub loss: Gauge,
    /// `diphoma_worker_samples_per_second`: over the ring, since the generation started.
    pub samples_per_second: Gauge,
    /// `diphoma_worker_ring_generation`: generation this member trains in.
    pub ring_generation: IntGauge,
    /// `diphoma_worker_repairs_total`: failed collectives after which the ring was re-formed.
    pub repairs: IntCounter,
    /// `diphoma_worker_batch_share`: samples of each global batch this member computes (its
    /// speed-weighted share; the shares of all members add up to the global batch).
    pub batch_share: IntGauge,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        WorkerMetrics::new()
    }
}

impl WorkerMetrics {
    /// A fresh registry with every metric at zero.
    pub fn new() -> WorkerMetrics {
        let registry = Registry::new();
        let n = |name: &str| format!("diphoma_worker_{name}");
        let allreduce_seconds = Histogram::with_opts(
            HistogramOpts::new(n("allreduce_seconds"), "Duration of each step's allreduce")
                .buckets(prometheus::exponential_buckets(1e-5, 4.0, 12).expect("buckets")),
        )
        .expect("metric");
        let allreduce_bytes =
            IntCounter::new(n("allreduce_bytes_total"), "Bytes allreduced").expect("metric");
        let step = IntGauge::new(n("step"), "Last committed step").expect("metric");
        let loss = Gauge::new(n("loss"), "Training loss of the last step").expect("metric");
        let samples_per_second =
            Gauge::new(n("samples_per_second"), "Samples per second over the ring")
                .expect("metric");
        let ring_generation =
            IntGauge::new(n("ring_generation"), "Ring generation").expect("metric");
        let repairs = IntCounter::new(n("repairs_total"), "Ring re-formations after a failure")
            .expect("metric");
        let batch_share = IntGauge::new(
            n("batch_share"),
            "Samples of each global batch this member computes",
        )
        .expect("metric");
        for c in [
            Box::new(allreduce_seconds.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(allreduce_bytes.clone()),
            Box::new(step.clone()),
            Box::new(loss.clone()),
            Box::new(samples_per_second.clone()),
            Box::new(ring_generation.clone()),
            Box::new(repairs.clone()),
            Box::new(batch_share.clone()),
        ] {
            registry.register(c).expect("unique metric names");
        }
        WorkerMetrics {
            registry,
            allreduce_seconds,
            allreduce_bytes,
            step,
            loss,
            samples_per_second,
            ring_generation,
            repairs,
            batch_share,
        }
    }

    /// Records a committed step.
    pub fn observe(&self, p: &Progress) {
        self.allreduce_seconds.observe(p.allreduce_seconds);
        self.allreduce_bytes.inc_by(p.allreduce_bytes);
        self.step.set(p.step as i64);
        self.loss.set(f64::from(p.loss));
        self.samples_per_second.set(p.samples_per_second);
        self.ring_generation.set(p.generation as i64);
        if let Some(&share) = p.shares.get(p.rank) {
            self.batch_share.set(share as i64);
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding");
        String::from_utf8(buf).expect("utf-8")
    }

    /// Serves `GET /metrics` on `listener` until the task is dropped.
    ///
    /// # Errors
    /// An I/O error of the server.
    pub async fn serve(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let m = self.clone();
                async move { m.render() }
            }),
        );
        axum::serve(listener, app).await
    }

    /// Binds `addr` and serves `/metrics` there on `rt` in the background (a failing server is
    /// logged, not fatal).
    ///
    /// # Errors
    /// [`KubeError::Bind`] when `addr` cannot be bound.
    pub fn spawn_server(
        &self,
        rt: &tokio::runtime::Handle,
        addr: SocketAddr,
    ) -> Result<(), KubeError> {
        let l = rt
            .block_on(tokio::net::TcpListener::bind(addr))
            .map_err(|source| KubeError::Bind { addr, source })?;
        let m = self.clone();
        rt.spawn(async move {
            if let Err(e) = m.serve(l).await {
                tracing::warn!("/metrics server: {e}");
            }
        });
        Ok(())
    }
}

/// A [`RingSource`] that records the worker's metrics around another one: the generation on
/// each connect, each committed step, each ring re-formed after a failure.
#[derive(Debug)]
pub struct Metered<S> {
    /// The source followed (e.g. the ring ConfigMap's `KubeRing`).
    pub inner: S,
    /// Where it records.
    pub metrics: WorkerMetrics,
}

impl<S: RingSource> RingSource for Metered<S> {
    fn connected(&mut self, generation: u64, rank: usize, abort: AbortHandle) {
        self.metrics.ring_generation.set(generation as i64);
        self.inner.connected(generation, rank, abort);
    }

    fn after_commit(&mut self, progress: &Progress) -> Control {
        self.metrics.observe(progress);
        self.inner.after_commit(progress)
    }

    fn after_failure(&mut self, err: &CommError) -> Option<Generation> {
        let next = self.inner.after_failure(err);
        if next.is_some() {
            self.metrics.repairs.inc();
        }
        next
    }

    fn report_failure(&mut self, err: &CommError) {
        self.inner.report_failure(err);
    }

    fn publish_progress(&mut self, progress: &Progress) {
        self.inner.publish_progress(progress);
    }

    fn report_test_accuracy(&mut self, accuracy: f64) {
        self.inner.report_test_accuracy(accuracy);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observed_progress_is_served() {
        let m = WorkerMetrics::new();
        m.observe(&Progress {
            step: 7,
            total_steps: Some(10),
            generation: 3,
            rank: 0,
            loss: 0.25,
            samples_per_second: 100.0,
            last_checkpoint: None,
            allreduce_seconds: 0.001,
            allreduce_bytes: 4096,
            shares: vec![20, 44],
        });
        m.repairs.inc();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let body = rt.block_on(async {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            tokio::spawn(m.serve(l));
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await
                .unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        });
        for line in [
            "diphoma_worker_step 7",
            "diphoma_worker_ring_generation 3",
            "diphoma_worker_loss 0.25",
            "diphoma_worker_allreduce_bytes_total 4096",
            "diphoma_worker_repairs_total 1",
            "diphoma_worker_samples_per_second 100",
            "diphoma_worker_allreduce_seconds_count 1",
            "diphoma_worker_batch_share 20",
        ] {
            assert!(body.contains(line), "{line} missing from {body}");
        }
    }
}
