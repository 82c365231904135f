//! Gang scheduling I/O: reads a job's gang Workload and PodGroup (`scheduling.k8s.io/v1alpha2`),
//! or its coscheduling PodGroup (`scheduling.x-k8s.io/v1alpha1`), from the stores the
//! controller's watches keep (no API request), and carries out what [`crate::plan::gang`]
//! decided (create, delete). Decides nothing.

use k8s_openapi::api::scheduling::v1alpha2::{PodGroup, Workload};
use kube::api::DeleteParams;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::api::{DiphomaJob, GangScheduler};
use crate::build;
use crate::build::Kind;
use crate::build::coscheduling::CoschedulingPodGroup;
use crate::controller::applier;
use crate::controller::caches::Written;
use crate::error::Error;
use crate::plan::gang::{self, Gang, GangPlan, Step};

/// The stores of the native gang objects this operator created, as their watches keep them.
#[derive(Clone)]
pub struct Native {
    /// The Workloads.
    pub workloads: Store<Workload>,
    /// The PodGroups.
    pub pod_groups: Store<PodGroup>,
}

/// The stores of the gang objects this operator created, each when the API server serves its
/// kind (seen at start).
#[derive(Clone, Default)]
pub struct Stores {
    /// `scheduling.k8s.io/v1alpha2` Workloads and PodGroups (`Kubernetes`).
    pub native: Option<Native>,
    /// `scheduling.x-k8s.io/v1alpha1` PodGroups (`Coscheduling`).
    pub coscheduling: Option<Store<CoschedulingPodGroup>>,
}

/// The job's gang as the stores of watched gang objects show it ([`Gang::Unserved`] when the
/// API server does not serve the kinds of its scheduler). [`Gang::Off`] for a job that asks
/// for no gang scheduler.
pub fn observe(stores: &Stores, job: &DiphomaJob) -> Gang {
    let name = build::gang_name(&job.name_any());
    let ns = job.namespace().unwrap_or_default();
    let uid = job.uid().unwrap_or_default();
    match job.spec.gang_scheduler() {
        GangScheduler::None => Gang::Off,
        GangScheduler::Kubernetes => match &stores.native {
            None => Gang::Unserved,
            Some(n) => Gang::Observed {
                workload: n
                    .workloads
                    .get(&at(&name, &ns))
                    .map(|w| gang::view_workload(&w, &uid)),
                pod_group: n
                    .pod_groups
                    .get(&at(&name, &ns))
                    .map(|g| gang::view_pod_group(&g, &uid)),
            },
        },
        GangScheduler::Coscheduling => match &stores.coscheduling {
            None => Gang::Unserved,
            Some(groups) => Gang::Observed {
                workload: None,
                pod_group: groups
                    .get(&at(&name, &ns))
                    .map(|g| gang::view_coscheduling_pod_group(&g, &uid)),
            },
        },
    }
}

/// The reference of `name` in `ns`, for a store lookup.
fn at<K: Resource<DynamicType = ()>>(name: &str, ns: &str) -> ObjectRef<K> {
    ObjectRef::new(name).within(ns)
}

/// Carries out `plan` for `job`'s gang objects: the Workload, then the PodGroup made from it; or
/// the coscheduling PodGroup.
///
/// Errors: [`Error::Gang`] naming the action, the object and the API server's answer.
pub async fn apply(
    client: &Client,
    job: &DiphomaJob,
    plan: &GangPlan,
    written: &mut Written,
) -> Result<(), Error> {
    let ns = job.namespace().unwrap_or_default();
    let workloads = Api::namespaced(client.clone(), &ns);
    carry(&workloads, Kind::GangWorkload, &plan.workload, written).await?;
    let pod_groups = Api::namespaced(client.clone(), &ns);
    carry(&pod_groups, Kind::GangPodGroup, &plan.pod_group, written).await?;
    let coscheduling = Api::namespaced(client.clone(), &ns);
    carry(
        &coscheduling,
        Kind::CoschedulingPodGroup,
        &plan.coscheduling,
        written,
    )
    .await
}

/// Carries out `step` for one gang object of `kind`. An object already gone or already
/// created (the store had not shown it yet) is fine ([`applier`]).
async fn carry<K>(
    api: &Api<K>,
    kind: Kind,
    step: &Step<K>,
    written: &mut Written,
) -> Result<(), Error>
where
    K: Resource + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    let (action, name, done) = match step {
        Step::Keep => return Ok(()),
        Step::Delete(name) => (
            "delete",
            name.clone(),
            applier::delete(api, name, &DeleteParams::background()).await,
        ),
        Step::Create(obj) => (
            "create",
            obj.meta().name.clone().unwrap_or_default(),
            applier::create(api, obj).await,
        ),
    };
    let done = done.map_err(|source| Error::Gang {
        action,
        kind: kind.name(),
        name,
        source,
    })?;
    written.note_some(kind, done.as_ref());
    Ok(())
}
