//! Step 0 of the plan: admission, computed once per plan. Whether the job's workers may run
//! now: the user's `runPolicy.suspend` first, then the job's queue (Kueue has not admitted it,
//! evicted it, or refused its Workload), then its gang (a gang scheduler asked for and not
//! served, or a gang that yields to another's repair). The lifecycle step suspends a held job
//! ([`super::lifecycle`]); the queue and gang steps decide their own objects afterwards.

use super::{Hold, Observed};
use crate::api::DiphomaJob;

/// The hold on the job, if any: `runPolicy.suspend` first, then the queue's
/// ([`super::queue::hold`], or `WorkloadRefused` when the API server refused the Workload that
/// has not been created yet), then the gang's ([`super::gang::hold`]).
pub fn hold(job: &DiphomaJob, obs: &Observed) -> Option<Hold> {
    if job.spec.run_policy.suspend {
        return Some(Hold {
            reason: "Suspended".into(),
            message: "the job is suspended".into(),
        });
    }
    match (super::queue::hold(job, &obs.queue), &obs.workload_refused) {
        // No Workload yet, and its creation was refused: the API server's word, not a wait.
        (Some(h), Some(refusal)) if h.reason == super::queue::NO_WORKLOAD_YET => Some(Hold {
            reason: "WorkloadRefused".into(),
            message: format!("the API server refused the job's Kueue Workload: {refusal}"),
        }),
        (Some(h), _) => Some(h),
        (None, _) => super::gang::hold(job, obs),
    }
}
