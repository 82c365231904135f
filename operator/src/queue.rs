//! Kueue I/O: reads a queued job's Workload (`kueue.x-k8s.io/v1beta2`) from the store the
//! controller's watch keeps (no API request), its WorkloadPriorityClass and the ResourceFlavors
//! its admission assigns (API reads), and carries out what [`crate::plan::queue`] decided (create, delete,
//! patch the Workload's status). Decides nothing. Workloads and ResourceFlavors are read as
//! dynamic objects: Kueue's types are not a Rust crate, and the plan reads only a few fields.

use std::collections::BTreeMap;

use kube::api::{ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, ResourceExt};

use crate::api::{DiphomaJob, FIELD_MANAGER};
use crate::controller::applier;
use crate::error::Error;
use crate::plan::queue::{self, Queue, QueuePlan, WorkloadView};

fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", kind),
        plural,
    )
}

/// The Workload resource (`kueue.x-k8s.io/v1beta2`, `workloads`).
pub fn workloads() -> ApiResource {
    resource("Workload", "workloads")
}

/// The job's place in Kueue: [`Queue::NotQueued`] without [`queue::QUEUE_LABEL`]; else its
/// Workload (if any) as the store of their watch shows it (`workloads`: none when the API server
/// does not serve them, read as no Workload: the job stays held and its status says so), its
/// priority, and the flavors of its admission resolved. The WorkloadPriorityClass and the
/// ResourceFlavors are API reads (only for a job with a priority class label, or admitted).
///
/// Errors: [`Error::Observe`] when the WorkloadPriorityClass or a ResourceFlavor cannot be read.
pub async fn observe(
    client: &Client,
    workloads: Option<&Store<DynamicObject>>,
    job: &DiphomaJob,
) -> Result<Queue, Error> {
    let Some(queue_name) = queue::queue_of(job) else {
        return Ok(Queue::NotQueued);
    };
    let ns = job.namespace().unwrap_or_default();
    let read = |what| move |source| Error::Observe { what, source };
    let object = workloads.and_then(|store| {
        let name = queue::workload_name(&job.name_any());
        store.get(&ObjectRef::new_with(&name, self::workloads()).within(&ns))
    });
    let priority = match job.labels().get(queue::PRIORITY_CLASS_LABEL) {
        Some(class) => {
            let classes: Api<DynamicObject> = Api::all_with(
                client.clone(),
                &resource("WorkloadPriorityClass", "workloadpriorityclasses"),
            );
            match classes.get_opt(class).await {
                Ok(c) => c
                    .and_then(|c| c.data.get("value")?.as_i64())
                    .map(|v| v as i32),
                Err(kube::Error::Api(e)) if e.code == 404 => None,
                Err(e) => return Err(read("Kueue WorkloadPriorityClass")(e)),
            }
        }
        None => None,
    };
    let Some(object) = object else {
        return Ok(Queue::Queued {
            queue: queue_name,
            workload: None,
            priority,
        });
    };
    let value = serde_json::to_value(&*object).unwrap_or_default();
    let flavors_api: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &resource("ResourceFlavor", "resourceflavors"),
    );
    let mut flavors = BTreeMap::new();
    for name in queue::assigned_flavors(&value) {
        if let Some(f) = flavors_api
            .get_opt(&name)
            .await
            .map_err(read("Kueue ResourceFlavor"))?
        {
            flavors.insert(name, f.data.get("spec").cloned().unwrap_or_default());
        }
    }
    let view: WorkloadView = queue::view(&value, &job.uid().unwrap_or_default(), &flavors);
    Ok(Queue::Queued {
        queue: queue_name,
        workload: Some(Box::new(view)),
        priority,
    })
}

/// What the job's status says of the API server's refusal `e` of its Workload: its message,
/// or, for a 404 (Kueue's CRDs are not installed: "404 page not found"), what to do about it.
pub fn refusal(e: &kube::core::Status) -> String {
    match e.code {
        404 => "the API server does not serve kueue.x-k8s.io/v1beta2 Workloads (Kueue is not \
                installed): install Kueue, or remove the label kueue.x-k8s.io/queue-name"
            .to_owned(),
        _ => e.message.clone(),
    }
}

/// Carries out `plan` for `job`'s Workload: delete, create, set `spec.active`, patch its
/// status.
///
/// Errors: [`Error::Workload`] naming the action and the Workload.
pub async fn apply(client: &Client, job: &DiphomaJob, plan: &QueuePlan) -> Result<(), Error> {
    let ns = job.namespace().unwrap_or_default();
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &workloads());
    if let Some(name) = &plan.delete {
        let deleted = applier::delete(&api, name, &DeleteParams::background()).await;
        deleted.map_err(|source| Error::Workload {
            action: "delete",
            name: name.clone(),
            source,
        })?;
    }
    if let Some(object) = &plan.create {
        let w: DynamicObject = serde_json::from_value(object.clone()).expect("a Workload object");
        let created = applier::create(&api, &w).await; // 409: created meanwhile
        created.map_err(|source| Error::Workload {
            action: "create",
            name: w.name_any(),
            source,
        })?;
    }
    if let Some((name, active)) = &plan.set_active {
        let body = serde_json::json!({"spec": {"active": active}});
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        };
        api.patch(name, &params, &Patch::Merge(&body))
            .await
            .map_err(|source| Error::Workload {
                action: "set spec.active of",
                name: name.clone(),
                source,
            })?;
    }
    if let Some((name, status)) = &plan.patch_status {
        let body = serde_json::json!({"status": status});
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        };
        api.patch_status(name, &params, &Patch::Merge(&body))
            .await
            .map_err(|source| Error::Workload {
                action: "patch status of",
                name: name.clone(),
                source,
            })?;
    }
    Ok(())
}
