//! Node health, judged with this operator's clocks only. A node's Lease in `kube-node-lease`
//! carries a `renewTime` written by the kubelet's clock; comparing it with the operator's clock
//! would declare every node lost (or none) whenever the two disagree. So, as Kubernetes' node
//! lifecycle controller does (`pkg/controller/nodelifecycle`, its `nodeHealthData.probeTimestamp`),
//! the operator remembers when it *observed* each `renewTime` change, by its own monotonic clock,
//! and judges the Lease by that age ([`observe_lease`], [`node_lease`]); a Lease first seen
//! gets a full grace window. The `renewTime` itself is used only to measure the skew between
//! the two clocks, which is reported once per node ([`skew_events`]) and never judged.
//!
//! Pure: the memory ([`LeaseSeen`]) is kept by the controller, which passes the instants in.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use jiff::{SignedDuration, Timestamp};

use super::{EventNote, NodeHealth};

/// Lease duration assumed when a node's Lease has none: the kubelet's default
/// (`nodeLeaseDurationSeconds`, 40 s).
pub const DEFAULT_NODE_LEASE_SECONDS: i32 = 40;

/// How current a node's Lease in `kube-node-lease` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeLease {
    /// Renewed on schedule.
    Fresh,
    /// A whole renewal was missed, but the node is not yet declared lost.
    Late,
    /// Unchanged for longer than both two renewal intervals and `detectionSeconds`, or never
    /// renewed.
    Lost,
}

/// The kubelet's renewal interval for a Lease of `leaseDurationSeconds` `duration_s`:
/// `leaseDurationSeconds / 4` (its `nodeLeaseRenewIntervalFraction`, 0.25: every 10 s for the
/// default 40 s).
fn renew_interval(duration_s: Option<i32>) -> Duration {
    let duration_s = duration_s.unwrap_or(DEFAULT_NODE_LEASE_SECONDS).max(1);
    Duration::from_millis(u64::from(duration_s.unsigned_abs()) * 250)
}

/// Judges a node Lease whose `renewTime` this operator last saw change `age` ago (none: no
/// Lease, or never renewed), with `leaseDurationSeconds` `duration_s`.
///
/// A Lease is late once unchanged for longer than two renewal intervals (a renewal was missed,
/// not merely delayed), and lost once also unchanged for longer than `detection_seconds`: a node
/// is never declared lost for a slow renewal, however small `detectionSeconds` is.
pub fn node_lease(
    age: Option<Duration>,
    duration_s: Option<i32>,
    detection_seconds: i32,
) -> NodeLease {
    let Some(age) = age else {
        return NodeLease::Lost;
    };
    let late = renew_interval(duration_s) * 2;
    let detection = Duration::from_secs(detection_seconds.max(0).unsigned_abs().into());
    match age {
        age if age > late && age > detection => NodeLease::Lost,
        age if age > late => NodeLease::Late,
        _ => NodeLease::Fresh,
    }
}

/// The nodes found unhealthy, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Nodes {
    /// Lost: Lease [`NodeLease::Lost`] or the node not Ready. Its pods are lost.
    pub lost: BTreeSet<String>,
    /// Late: Lease not [`NodeLease::Fresh`] or the node not Ready (every lost node is late). A
    /// silent member there is counted as `NodeLost`, not `Hung`.
    pub late: BTreeSet<String>,
}

/// Which of the observed `nodes` are lost or late (see [`node_lease`]).
pub fn judge_nodes(nodes: &BTreeMap<String, NodeHealth>, detection_seconds: i32) -> Nodes {
    let mut out = Nodes::default();
    for (name, h) in nodes {
        let lease = node_lease(h.lease_age, h.lease_duration_seconds, detection_seconds);
        if lease != NodeLease::Fresh || !h.ready {
            out.late.insert(name.clone());
        }
        if lease == NodeLease::Lost || !h.ready {
            out.lost.insert(name.clone());
        }
    }
    out
}

/// How long until the first of `nodes` would be judged [`NodeLease::Lost`] if its Lease is not
/// renewed meanwhile (its age passes both two renewal intervals and `detection_seconds`), plus
/// 100 ms; none when no node with a Lease is still unjudged (already lost, or no Lease). A renewal
/// pushes this back: the reconcile it schedules then finds the node fresh and schedules again.
pub fn next_check(
    nodes: &BTreeMap<String, NodeHealth>,
    detection_seconds: i32,
) -> Option<Duration> {
    let detection = Duration::from_secs(detection_seconds.max(0).unsigned_abs().into());
    nodes
        .values()
        .filter_map(|h| {
            let age = h.lease_age?;
            let lost_after = (renew_interval(h.lease_duration_seconds) * 2).max(detection);
            (age <= lost_after).then(|| lost_after - age + Duration::from_millis(100))
        })
        .min()
}

/// What this operator remembers of one node's Lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseSeen {
    /// The `renewTime` last seen, as the kubelet wrote it (its clock: compared for equality
    /// only).
    pub renew_time: Timestamp,
    /// When this operator first saw that `renewTime` (its monotonic clock).
    pub changed_at: Instant,
    /// This operator's wall clock at its latest look at the Lease: the earliest the next
    /// `renewTime` can have been written, which bounds the skew.
    pub seen_at: Timestamp,
    /// Whether a large skew was already reported for this node.
    pub skew_reported: bool,
}

impl LeaseSeen {
    /// How long ago, at `now`, this operator saw the `renewTime` change.
    pub fn age(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.changed_at)
    }
}

/// The least the node's clock can differ from this operator's (positive: the node is ahead),
/// for a `renewTime` `renewed` first seen at wall time `now` and not yet written at the previous
/// look `before`: it was written, by this operator's clock, within `(before, now]`.
pub fn skew_bound(renewed: Timestamp, before: Timestamp, now: Timestamp) -> SignedDuration {
    if renewed < before {
        renewed.duration_since(before)
    } else if renewed > now {
        renewed.duration_since(now)
    } else {
        SignedDuration::ZERO
    }
}

/// The skew above which a node's clock is reported: the Lease's duration, twice the window in
/// which a renewal must be seen ([`node_lease`]'s late threshold).
pub fn skew_threshold(duration_s: Option<i32>) -> Duration {
    renew_interval(duration_s) * 4
}

/// This operator looks at a node Lease with `renewTime` `renewed` and `leaseDurationSeconds`
/// `duration_s`, at monotonic `now` and wall time `wall`; `prev` is what it remembered. Returns
/// the new memory, and the skew to report now: one beyond [`skew_threshold`] measured
/// ([`skew_bound`]) at a change of `renewTime`, for a node not reported before. A Lease first
/// seen counts as just renewed (a full grace window) and measures no skew.
pub fn observe_lease(
    prev: Option<&LeaseSeen>,
    renewed: Timestamp,
    duration_s: Option<i32>,
    now: Instant,
    wall: Timestamp,
) -> (LeaseSeen, Option<SignedDuration>) {
    let Some(prev) = prev else {
        let first = LeaseSeen {
            renew_time: renewed,
            changed_at: now,
            seen_at: wall,
            skew_reported: false,
        };
        return (first, None);
    };
    if prev.renew_time == renewed {
        return (
            LeaseSeen {
                seen_at: wall,
                ..*prev
            },
            None,
        );
    }
    let skew = skew_bound(renewed, prev.seen_at, wall);
    let report = !prev.skew_reported && skew.unsigned_abs() > skew_threshold(duration_s);
    let seen = LeaseSeen {
        renew_time: renewed,
        changed_at: now,
        seen_at: wall,
        skew_reported: prev.skew_reported || report,
    };
    (seen, report.then_some(skew))
}

/// A Warning event `ClockSkew` for each node whose skew is reported on this observation
/// ([`NodeHealth::clock_skew`]).
pub fn skew_events(nodes: &BTreeMap<String, NodeHealth>) -> Vec<EventNote> {
    nodes
        .iter()
        .filter_map(|(name, h)| {
            let skew = h.clock_skew?;
            let way = if skew.is_negative() {
                "behind"
            } else {
                "ahead of"
            };
            let note = format!(
                "node {name}'s clock is at least {:.0}s {way} the operator's (its Lease's \
                 renewTime against when the operator saw it change); node health is judged by \
                 the operator's own clock, so this does not make the node lost, but times \
                 written there disagree with the cluster's",
                skew.unsigned_abs().as_secs_f64()
            );
            Some(EventNote::warning("ClockSkew", "Observe", note))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    #[test]
    fn nodes_are_judged_by_lease_age_and_readiness() {
        let health = |age_s: u64, ready: bool| NodeHealth {
            lease_age: Some(Duration::from_secs(age_s)),
            lease_duration_seconds: Some(8),
            ready,
            clock_skew: None,
        };
        let nodes = BTreeMap::from([
            ("fresh".to_owned(), health(1, true)),
            ("late".to_owned(), health(5, true)),
            ("lost".to_owned(), health(20, true)),
            ("not-ready".to_owned(), health(1, false)),
            ("no-lease".to_owned(), NodeHealth::default()),
        ]);
        let n = judge_nodes(&nodes, 10);
        let set = |names: &[&str]| names.iter().map(|s| s.to_string()).collect();
        assert_eq!(n.lost, set(&["lost", "no-lease", "not-ready"]));
        assert_eq!(n.late, set(&["late", "lost", "no-lease", "not-ready"]));
    }

    #[test]
    fn a_lease_is_aged_by_when_it_was_seen_to_change_whatever_its_renew_time_says() {
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        // A kubelet 30 s behind: every renewTime is 30 s older than the operator's clock.
        let behind = |s: i64| t(s - 30);
        let (seen, skew) = observe_lease(None, behind(0), Some(8), at(0), t(0));
        assert_eq!(skew, None, "a first look measures no skew");
        assert_eq!(seen.age(at(0)), Duration::ZERO, "a full grace window");
        // Renewed every 2 s: each change makes it fresh, however old its renewTime reads. The
        // skew is bounded by the looks around the change: written within (0, 2] by the
        // operator's clock, at -28 by the node's, so at least 28 s behind.
        let (seen, skew) = observe_lease(Some(&seen), behind(2), Some(8), at(2), t(2));
        assert_eq!(skew, Some(SignedDuration::from_secs(-28)));
        assert!(seen.skew_reported);
        assert_eq!(
            node_lease(Some(seen.age(at(3))), Some(8), 4),
            NodeLease::Fresh
        );
        let (seen, skew) = observe_lease(Some(&seen), behind(4), Some(8), at(4), t(4));
        assert_eq!(skew, None, "reported once per node");
        // The kubelet stops: the same renewTime, looked at again, ages until lost.
        let (seen, _) = observe_lease(Some(&seen), behind(4), Some(8), at(9), t(9));
        assert_eq!(seen.changed_at, at(4));
        assert_eq!(
            node_lease(Some(seen.age(at(9))), Some(8), 6),
            NodeLease::Late
        );
        assert_eq!(
            node_lease(Some(seen.age(at(11))), Some(8), 6),
            NodeLease::Lost
        );
    }

    #[test]
    fn skew_is_bounded_by_the_looks_around_a_change_and_small_skews_are_not_reported() {
        assert_eq!(skew_bound(t(5), t(4), t(6)), SignedDuration::ZERO);
        assert_eq!(skew_bound(t(40), t(4), t(6)), SignedDuration::from_secs(34));
        assert_eq!(skew_bound(t(1), t(4), t(6)), SignedDuration::from_secs(-3));
        let start = Instant::now();
        let (seen, _) = observe_lease(None, t(0), Some(8), start, t(0));
        // 5 s ahead, below an 8 s Lease's threshold.
        let (_, skew) = observe_lease(Some(&seen), t(7), Some(8), start, t(2));
        assert_eq!(skew, None);
        assert_eq!(skew_threshold(Some(8)), Duration::from_secs(8));
    }

    #[test]
    fn the_next_check_is_when_the_first_node_would_be_lost() {
        let health = |age_s: u64| NodeHealth {
            lease_age: Some(Duration::from_secs(age_s)),
            lease_duration_seconds: Some(8),
            ready: true,
            clock_skew: None,
        };
        let ms = Duration::from_millis;
        // Late after 4 s (two renewals of 2 s), lost after 10 s (detectionSeconds).
        let nodes = BTreeMap::from([("a".to_owned(), health(3)), ("b".to_owned(), health(6))]);
        assert_eq!(next_check(&nodes, 10), Some(ms(4_100)));
        // A detectionSeconds below two renewals: lost once late.
        assert_eq!(next_check(&nodes, 1), Some(ms(1_100)));
        // Lost already, or without a Lease: nothing left to wait for.
        let gone = BTreeMap::from([
            ("a".to_owned(), health(11)),
            ("b".to_owned(), NodeHealth::default()),
        ]);
        assert_eq!(next_check(&gone, 10), None);
        assert_eq!(
            node_lease(Some(Duration::from_secs(11)), Some(8), 10),
            NodeLease::Lost
        );
    }

    #[test]
    fn a_reported_skew_is_one_warning_naming_the_node() {
        let nodes = BTreeMap::from([
            (
                "n1".to_owned(),
                NodeHealth {
                    clock_skew: Some(SignedDuration::from_secs(-30)),
                    ..NodeHealth::default()
                },
            ),
            ("n2".to_owned(), NodeHealth::default()),
        ]);
        let events = skew_events(&nodes);
        assert_eq!(events.len(), 1);
        assert!(events[0].warning && events[0].reason == "ClockSkew");
        assert!(events[0].note.contains("n1's clock is at least 30s behind"));
    }
}
