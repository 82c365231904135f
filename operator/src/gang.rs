//! Gang scheduling I/O: reads a job's gang Workload (`scheduling.k8s.io/v1alpha1`) from the
//! store the controller's watch keeps (no API request), and carries out what
//! [`crate::plan::gang`] decided (create, delete). Decides nothing.

use k8s_openapi::api::scheduling::v1alpha1::Workload;
use kube::api::DeleteParams;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, ResourceExt};

use crate::api::{DiphomaJob, GangScheduler};
use crate::build;
use crate::build::Kind;
use crate::controller::applier;
use crate::controller::caches::Written;
use crate::error::Error;
use crate::plan::gang::{self, Gang, GangPlan};

/// The job's gang as the store of watched gang Workloads shows it (`store`: none when the API
/// server does not serve them). [`Gang::Off`] for a job that asks for no gang scheduler.
pub fn observe(store: Option<&Store<Workload>>, job: &DiphomaJob) -> Gang {
    if job.spec.gang_scheduler() == GangScheduler::None {
        return Gang::Off;
    }
    let Some(store) = store else {
        return Gang::Unserved;
    };
    let name = build::gang_workload_name(&job.name_any());
    let key = ObjectRef::new(&name).within(&job.namespace().unwrap_or_default());
    Gang::Observed(
        store
            .get(&key)
            .map(|w| gang::view(&w, &job.uid().unwrap_or_default())),
    )
}

/// Carries out `plan` for `job`'s gang Workload: delete, create. A Workload already gone or
/// already created (the store had not shown it yet) is fine ([`applier`]).
///
/// Errors: [`Error::Gang`] naming the action, the Workload and the API server's answer.
pub async fn apply(
    client: &Client,
    job: &DiphomaJob,
    plan: &GangPlan,
    written: &mut Written,
) -> Result<(), Error> {
    let api: Api<Workload> = Api::namespaced(client.clone(), &job.namespace().unwrap_or_default());
    if let Some(name) = &plan.delete {
        let deleted = applier::delete(&api, name, &DeleteParams::background()).await;
        let deleted = deleted.map_err(|source| Error::Gang {
            action: "delete",
            name: name.clone(),
            source,
        })?;
        written.note_some(Kind::GangWorkload, deleted.as_ref());
    }
    if let Some(w) = &plan.create {
        let created = applier::create(&api, w).await;
        let created = created.map_err(|source| Error::Gang {
            action: "create",
            name: w.name_any(),
            source,
        })?;
        written.note_some(Kind::GangWorkload, created.as_ref());
    }
    Ok(())
}
