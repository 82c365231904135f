//! Kueue I/O: reads a queued job's Workload (`kueue.x-k8s.io/v1beta2`), its
//! WorkloadPriorityClass and the ResourceFlavors its admission assigns from the stores the
//! controller's watches keep ([`Stores`]: no API request), and carries out what [`crate::plan::queue`] decided (create, delete,
//! patch the Workload's status). Decides nothing. Workloads and ResourceFlavors are read as
//! dynamic objects: Kueue's types are not a Rust crate, and the plan reads only a few fields.

use std::collections::BTreeMap;

use diphoma_contract::LABEL_JOB_NAME;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use crate::api::{DiphomaJob, FIELD_MANAGER};
use crate::build::Kind;
use crate::controller::applier;
use crate::controller::caches::Written;
use crate::error::Error;
use crate::plan::queue::{self, Queue, QueuePlan, WorkloadView};

fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", kind),
        plural,
    )
}

/// The kind of the Workloads written here, for read-your-writes ([`Written`]).
const KIND: Kind = Kind::KueueWorkload;

/// The Workload resource (`kueue.x-k8s.io/v1beta2`, `workloads`).
pub fn workloads() -> ApiResource {
    resource("Workload", "workloads")
}

/// The WorkloadPriorityClass resource (`kueue.x-k8s.io/v1beta2`).
pub fn priority_classes() -> ApiResource {
    resource("WorkloadPriorityClass", "workloadpriorityclasses")
}

/// The ResourceFlavor resource (`kueue.x-k8s.io/v1beta2`).
pub fn flavors() -> ApiResource {
    resource("ResourceFlavor", "resourceflavors")
}

/// What the watches keep of Kueue, when the API server serves it
/// ([`crate::controller::caches::Caches::keep_kueue`]).
#[derive(Clone)]
pub struct Stores {
    /// The Workloads this operator created (label `app.kubernetes.io/managed-by`).
    pub workloads: Store<DynamicObject>,
    /// Every WorkloadPriorityClass.
    pub priority_classes: Store<DynamicObject>,
    /// Every ResourceFlavor.
    pub flavors: Store<DynamicObject>,
}

/// The job's place in Kueue: [`Queue::NotQueued`] without [`queue::QUEUE_LABEL`]; else its
/// Workload (if any: of all its Workloads, its workload slices, the one [`queue::slices`]
/// picks, with the newer slice that replaces it), the value of its WorkloadPriorityClass (none: no label, or no such class)
/// and the flavors of its admission resolved. Read from `stores` (no API request) once their
/// watches have listed; else (Kueue not served when the operator started, or its lists not
/// complete yet: a job must not be planned from an empty store) by API reads.
///
/// Errors: [`Error::Observe`] when an API read fails.
pub async fn observe(
    client: &Client,
    stores: Option<&Stores>,
    job: &DiphomaJob,
) -> Result<Queue, Error> {
    let Some(queue_name) = queue::queue_of(job) else {
        return Ok(Queue::NotQueued);
    };
    let ns = job.namespace().unwrap_or_default();
    let read = Reader { client, stores };
    let objects = read.workloads_of(&ns, &job.name_any()).await?;
    let priority = match job.labels().get(queue::PRIORITY_CLASS_LABEL) {
        Some(class) => read
            .get(Kueue::PriorityClass, None, class)
            .await?
            .and_then(|c| c.data.get("value")?.as_i64())
            .map(|v| v as i32),
        None => None,
    };
    let mut views: Vec<WorkloadView> = vec![];
    for object in objects {
        let value = serde_json::to_value(&*object).unwrap_or_default();
        let mut flavors = BTreeMap::new();
        for name in queue::assigned_flavors(&value) {
            if let Some(f) = read.get(Kueue::Flavor, None, &name).await? {
                flavors.insert(name, f.data.get("spec").cloned().unwrap_or_default());
            }
        }
        views.push(queue::view(
            &value,
            &job.uid().unwrap_or_default(),
            &flavors,
        ));
    }
    Ok(Queue::Queued {
        queue: queue_name,
        workload: queue::slices(views).map(Box::new),
        priority,
    })
}

/// The Kueue objects [`observe`] reads.
#[derive(Debug, Clone, Copy)]
enum Kueue {
    Workload,
    PriorityClass,
    Flavor,
}

impl Kueue {
    fn resource(self) -> ApiResource {
        match self {
            Kueue::Workload => workloads(),
            Kueue::PriorityClass => priority_classes(),
            Kueue::Flavor => flavors(),
        }
    }

    fn store(self, stores: &Stores) -> &Store<DynamicObject> {
        match self {
            Kueue::Workload => &stores.workloads,
            Kueue::PriorityClass => &stores.priority_classes,
            Kueue::Flavor => &stores.flavors,
        }
    }

    /// What an [`Error::Observe`] names.
    fn what(self) -> &'static str {
        match self {
            Kueue::Workload => "Kueue Workload",
            Kueue::PriorityClass => "Kueue WorkloadPriorityClass",
            Kueue::Flavor => "Kueue ResourceFlavor",
        }
    }
}

/// Where [`observe`] reads: the stores when given, else the API server.
struct Reader<'a> {
    client: &'a Client,
    stores: Option<&'a Stores>,
}

impl Reader<'_> {
    /// The Workloads of job `job` in namespace `ns` (label [`LABEL_JOB_NAME`]: its slices, and
    /// one a deleted job of the same name left); none when Kueue's CRDs are not installed.
    ///
    /// Errors: [`Error::Observe`] when an API read fails.
    async fn workloads_of(
        &self,
        ns: &str,
        job: &str,
    ) -> Result<Vec<std::sync::Arc<DynamicObject>>, Error> {
        let of_job = |o: &DynamicObject| {
            o.namespace().as_deref() == Some(ns)
                && o.labels().get(LABEL_JOB_NAME).map(String::as_str) == Some(job)
        };
        if let Some(stores) = self.stores {
            let all = Kueue::Workload.store(stores).state();
            return Ok(all.into_iter().filter(|o| of_job(o)).collect());
        }
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), ns, &Kueue::Workload.resource());
        let params = ListParams::default().labels(&format!("{LABEL_JOB_NAME}={job}"));
        match api.list(&params).await {
            Ok(list) => Ok(list.items.into_iter().map(std::sync::Arc::new).collect()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(vec![]),
            Err(source) => Err(Error::Observe {
                what: Kueue::Workload.what(),
                source,
            }),
        }
    }

    /// Object `name` of `kind` (in namespace `ns`, none: cluster-scoped); none when there is
    /// none (a 404 too: Kueue's CRDs not installed).
    ///
    /// Errors: [`Error::Observe`] when an API read fails.
    async fn get(
        &self,
        kind: Kueue,
        ns: Option<&str>,
        name: &str,
    ) -> Result<Option<std::sync::Arc<DynamicObject>>, Error> {
        let ar = kind.resource();
        if let Some(stores) = self.stores {
            let key = ObjectRef::new_with(name, ar);
            return Ok(kind.store(stores).get(&match ns {
                Some(ns) => key.within(ns),
                None => key,
            }));
        }
        let api: Api<DynamicObject> = match ns {
            Some(ns) => Api::namespaced_with(self.client.clone(), ns, &ar),
            None => Api::all_with(self.client.clone(), &ar),
        };
        match api.get_opt(name).await {
            Ok(o) => Ok(o.map(std::sync::Arc::new)),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(None),
            Err(source) => Err(Error::Observe {
                what: kind.what(),
                source,
            }),
        }
    }
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

/// Carries out `plan` for `job`'s Workload: delete, create, resize, set `spec.active`, patch
/// its status.
///
/// Errors: [`Error::Workload`] naming the action and the Workload.
pub async fn apply(
    client: &Client,
    job: &DiphomaJob,
    plan: &QueuePlan,
    written: &mut Written,
) -> Result<(), Error> {
    let ns = job.namespace().unwrap_or_default();
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &workloads());
    if let Some(name) = &plan.delete {
        let deleted = applier::delete(&api, name, &DeleteParams::background()).await;
        let deleted = deleted.map_err(|source| Error::Workload {
            action: "delete",
            name: name.clone(),
            source,
        })?;
        written.note_some(KIND, deleted.as_ref());
    }
    if let Some(object) = &plan.create {
        let w: DynamicObject = serde_json::from_value(object.clone()).expect("a Workload object");
        let created = applier::create(&api, &w).await; // 409: created meanwhile
        let created = created.map_err(|source| Error::Workload {
            action: "create",
            name: w.name_any(),
            source,
        })?;
        written.note_some(KIND, created.as_ref());
    }
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    };
    if let Some((name, count, min_count)) = &plan.resize {
        let mut ops = vec![
            json!({"op": "test", "path": "/spec/podSets/0/name", "value": queue::PODSET}),
            json!({"op": "replace", "path": "/spec/podSets/0/count", "value": count}),
        ];
        if let Some(min) = min_count {
            ops.push(json!({"op": "add", "path": "/spec/podSets/0/minCount", "value": min}));
        }
        let ops: json_patch::Patch = serde_json::from_value(json!(ops)).expect("a JSON patch");
        let resized = api.patch(name, &params, &Patch::Json::<()>(ops)).await;
        let resized = resized.map_err(|source| Error::Workload {
            action: "resize",
            name: name.clone(),
            source,
        })?;
        written.note(KIND, &resized.metadata);
    }
    if let Some((name, active)) = &plan.set_active {
        let body = json!({"spec": {"active": active}});
        let set = api.patch(name, &params, &Patch::Merge(&body)).await;
        let set = set.map_err(|source| Error::Workload {
            action: "set spec.active of",
            name: name.clone(),
            source,
        })?;
        written.note(KIND, &set.metadata);
    }
    if let Some((name, status)) = &plan.patch_status {
        let mut body = json!({"status": status});
        if let Some(rv) = &plan.status_version {
            body["metadata"] = json!({"resourceVersion": rv});
        }
        let patched = match api.patch_status(name, &params, &Patch::Merge(&body)).await {
            // Kueue wrote the Workload since it was read (its watch event reconciles the job
            // again, with the plan made from Kueue's write): not a failure.
            Err(kube::Error::Api(e)) if e.code == 409 => {
                tracing::debug!(workload = %name, "Kueue wrote the Workload meanwhile: planned again");
                return Ok(());
            }
            patched => patched.map_err(|source| Error::Workload {
                action: "patch status of",
                name: name.clone(),
                source,
            })?,
        };
        written.note(KIND, &patched.metadata);
    }
    Ok(())
}
