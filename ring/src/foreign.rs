//! Collectives of another library under the ring's membership (`spec.ring.dataPlane: gloo`, the
//! Python backend's per-generation communicator): which member a failed or long-waiting
//! collective of that library blames. The same rule as the ring's own collectives (slow is not
//! hung, [`crate::liveness`]): a member whose process answers a liveness probe is waited for,
//! one that does not is blamed. Pure: the caller probes and keeps the verdict.

use std::time::Duration;

use crate::CommError;

/// The operation names a verdict can carry (`CommError`'s `op`): `op` itself when it is one of
/// them, else `"collective"`.
pub fn op_name(op: &str) -> &'static str {
    const OPS: [&str; 5] = [
        "allreduce",
        "reduce_scatter",
        "allgather",
        "broadcast",
        "barrier",
    ];
    OPS.into_iter().find(|o| *o == op).unwrap_or("collective")
}

/// What collective `op` of another library means after it waited `waited` (`failed`: the
/// library raised, typically a closed connection), given the other members' answers to a
/// liveness probe (`(rank, answered)`, in rank order):
/// - the first member that did not answer is blamed: [`CommError::PeerLost`] when the library
///   failed (its process is gone), else [`CommError::Timeout`] naming it (stopped, frozen);
/// - every member answered: a failure of the library is [`CommError::Aborted`] (the ring
///   re-forms; nobody is reported), a wait is `None` (a slow member, not a hung one: wait on).
pub fn verdict(
    op: &'static str,
    waited: Duration,
    failed: bool,
    answers: &[(usize, bool)],
) -> Option<CommError> {
    match answers.iter().find(|(_, answered)| !answered) {
        Some(&(rank, _)) if failed => Some(CommError::PeerLost { rank, op }),
        Some(&(rank, _)) => Some(CommError::Timeout {
            op,
            after: waited,
            peer: Some(rank),
        }),
        None if failed => Some(CommError::Aborted),
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_secs(3);

    #[test]
    fn a_silent_member_is_blamed_lost_when_the_library_failed_and_hung_when_it_waits() {
        let answers = [(0, true), (2, false), (3, false)];
        assert!(matches!(
            verdict("allreduce", W, true, &answers),
            Some(CommError::PeerLost {
                rank: 2,
                op: "allreduce"
            })
        ));
        assert!(matches!(
            verdict("broadcast", W, false, &answers),
            Some(CommError::Timeout { op: "broadcast", after, peer: Some(2) }) if after == W
        ));
    }

    #[test]
    fn when_every_member_answers_a_wait_goes_on_and_a_failure_reforms_unreported() {
        let answers = [(0, true), (1, true)];
        assert!(verdict("allreduce", W, false, &answers).is_none());
        assert!(matches!(
            verdict("allreduce", W, true, &answers),
            Some(CommError::Aborted)
        ));
        assert!(verdict("allreduce", W, false, &[]).is_none());
    }

    #[test]
    fn unknown_operations_are_named_collective() {
        assert_eq!(op_name("allgather"), "allgather");
        assert_eq!(op_name("all_to_all"), "collective");
    }
}
