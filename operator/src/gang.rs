//! Gang scheduling I/O: reads a job's gang Workload and PodGroup (`scheduling.k8s.io/v1alpha2`)
//! from the stores the controller's watches keep (no API request), and carries out what
//! [`crate::plan::gang`] decided (create, delete). Decides nothing.

use k8s_openapi::api::scheduling::v1alpha2::{PodGroup, Workload};
use kube::api::DeleteParams;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::api::{DiphomaJob, GangScheduler};
use crate::build;
use crate::build::Kind;
use crate::controller::applier;
use crate::controller::caches::Written;
use crate::error::Error;
use crate::plan::gang::{self, Gang, GangPlan, Step};

/// The stores of the gang objects this operator created, as their watches keep them.
#[derive(Clone)]
pub struct Stores {
    /// The Workloads.
    pub workloads: Store<Workload>,
    /// The PodGroups.
    pub pod_groups: Store<PodGroup>,
}

/// The job's gang as the stores of watched gang objects show it (`stores`: none when the API
/// server does not serve them). [`Gang::Off`] for a job that asks for no gang scheduler.
pub fn observe(stores: Option<&Stores>, job: &DiphomaJob) -> Gang {
    if job.spec.gang_scheduler() == GangScheduler::None {
        return Gang::Off;
    }
    let Some(stores) = stores else {
        return Gang::Unserved;
    };
    let name = build::gang_name(&job.name_any());
    let ns = job.namespace().unwrap_or_default();
    let uid = job.uid().unwrap_or_default();
    Gang::Observed {
        workload: stores
            .workloads
            .get(&ObjectRef::new(&name).within(&ns))
            .map(|w| gang::view_workload(&w, &uid)),
        pod_group: stores
            .pod_groups
            .get(&ObjectRef::new(&name).within(&ns))
            .map(|g| gang::view_pod_group(&g, &uid)),
    }
}

/// Carries out `plan` for `job`'s gang objects: the Workload, then the PodGroup made from it.
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
    carry(&pod_groups, Kind::GangPodGroup, &plan.pod_group, written).await
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
