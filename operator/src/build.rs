//! Desired children of a job, built as typed k8s-openapi objects (no I/O, no JSON editing): worker
//! pods, the headless Service, the NetworkPolicy, the ServiceAccount, Role and RoleBinding of its
//! workers, the ring and heartbeat ConfigMaps and the key Secret. A template that cannot make a
//! worker is a [`BuildError`] naming the job and the field, never a pod without spec.
//! Names are deterministic, every object carries the job as controller owner and the standard
//! labels, so the reconciler can apply them with server-side apply and prune by label.

use std::collections::BTreeMap;

use diphoma_contract::{
    self as contract, ENV_JOB_NAME, ENV_JOB_UID, ENV_KEY_FILE, ENV_MEMBERSHIP, ENV_NAMESPACE,
    ENV_POD_IP, ENV_POD_NAME, ENV_RING_PORT, KEY_FILE_NAME, KEY_MOUNT_DIR, LABEL_JOB_NAME,
    LABEL_REPLICA_INDEX, MEMBERSHIP_KEY, Membership,
};
use k8s_openapi::api::core::v1::{
    Affinity, ConfigMap, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    NodeSelectorRequirement, NodeSelectorTerm, ObjectFieldSelector, Pod, PodSchedulingGroup,
    PodSpec, Secret, SecretVolumeSource, Service, ServiceAccount, ServicePort, ServiceSpec,
    Toleration, Volume, VolumeMount,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::api::scheduling::v1alpha2::{
    GangSchedulingPolicy, PodGroup, PodGroupSchedulingPolicy, PodGroupSpec, PodGroupTemplate,
    PodGroupTemplateReference, TypedLocalObjectReference, Workload,
    WorkloadPodGroupTemplateReference, WorkloadSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{ApiResource, DynamicObject};
use kube::{Resource, ResourceExt};

use crate::api::{DataPlane, DiphomaJob, GangScheduler};

/// `app.kubernetes.io/managed-by` value on everything the operator creates.
pub const MANAGED_BY: &str = "diphoma-operator";
/// Annotation the operator puts on a pod before it deletes it itself (scale-down, suspend,
/// replacement, clean-up), so the deletion is never counted as a failure.
pub const ANNOT_DELETED_BY_OPERATOR: &str = "diphoma.io/deleted-by-operator";
/// Annotation recording that a pod's failure has been counted (its value is the cause).
pub const ANNOT_FAILURE_COUNTED: &str = "diphoma.io/failure-counted";
/// Label on each worker pod: the [`worker_spec_digest`] of the spec it was built from.
pub const LABEL_WORKER_SPEC: &str = "diphoma.io/worker-spec";
/// Where the checkpoint volume is mounted when the template does not mount it itself.
pub const CHECKPOINT_MOUNT_DIR: &str = "/var/lib/diphoma/checkpoints";
/// Extended resource name of NVIDIA GPUs.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// Environment variable NVIDIA's container runtime reads; `void` exposes no GPU.
pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
/// The in-memory volume of a worker running several processes, and where it is mounted.
pub const SHM_VOLUME: &str = "diphoma-shm";
/// See [`SHM_VOLUME`].
pub const SHM_PATH: &str = "/dev/shm";

/// Name of the per-job key Secret.
pub fn key_secret_name(job: &str) -> String {
    format!("{job}-key")
}

/// Name of the ServiceAccount, Role and RoleBinding of the job's workers.
pub fn worker_account_name(job: &str) -> String {
    format!("{job}-worker")
}

/// Name of worker `index`'s pod, attempt `attempt` (0 for the first; replacements count up, so a
/// replacement never waits for a predecessor stuck Terminating on a lost node).
pub fn pod_name(job: &str, index: i32, attempt: i32) -> String {
    if attempt == 0 {
        format!("{job}-worker-{index}")
    } else {
        format!("{job}-worker-{index}-{attempt}")
    }
}

/// Label selector of a job's workers.
pub fn selector(job: &str) -> String {
    format!("{LABEL_JOB_NAME}={job}")
}

fn owner(job: &DiphomaJob) -> OwnerReference {
    job.controller_owner_ref(&())
        .expect("a stored job has a name and uid")
}

fn labels(job: &DiphomaJob) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            "app.kubernetes.io/name".to_owned(),
            "diphoma-worker".to_owned(),
        ),
        ("app.kubernetes.io/instance".to_owned(), job.name_any()),
        (
            "app.kubernetes.io/managed-by".to_owned(),
            MANAGED_BY.to_owned(),
        ),
        (LABEL_JOB_NAME.to_owned(), job.name_any()),
    ])
}

fn meta(job: &DiphomaJob, name: String) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: job.namespace(),
        labels: Some(labels(job)),
        owner_references: Some(vec![owner(job)]),
        ..Default::default()
    }
}

/// The name of the job's gang objects (`scheduling.k8s.io/v1alpha2` `Workload` and `PodGroup`):
/// the job's own (a different API group than Kueue's Workload, `diphomajob-<job>`).
pub fn gang_name(job: &str) -> String {
    job.to_owned()
}

/// The only pod group template of the job's gang `Workload`, which its `PodGroup` names.
pub const GANG_TEMPLATE: &str = "workers";

/// The gang policy: all or nothing, for at least `min_count` workers.
fn gang_policy(min_count: i32) -> PodGroupSchedulingPolicy {
    PodGroupSchedulingPolicy {
        gang: Some(GangSchedulingPolicy { min_count }),
        basic: None,
    }
}

/// The job's gang definition: a `scheduling.k8s.io/v1alpha2` `Workload` (KEP-4671, Kubernetes
/// 1.36) owned by the job, with one pod group template [`GANG_TEMPLATE`] whose gang policy's
/// `minCount` is `min_count` (the ring's minimum). The scheduler reads the [`gang_pod_group`]
/// made from it; `spec.podGroupTemplates` is immutable: a new minimum takes a new Workload of
/// the same name.
pub fn gang_workload(job: &DiphomaJob, min_count: i32) -> Workload {
    Workload {
        metadata: meta(job, gang_name(&job.name_any())),
        spec: WorkloadSpec {
            controller_ref: Some(TypedLocalObjectReference {
                api_group: Some(DiphomaJob::group(&()).into_owned()),
                kind: DiphomaJob::kind(&()).into_owned(),
                name: job.name_any(),
            }),
            pod_group_templates: vec![PodGroupTemplate {
                name: GANG_TEMPLATE.into(),
                scheduling_policy: gang_policy(min_count),
                ..Default::default()
            }],
        },
    }
}

/// The job's gang as the kube-scheduler places it: a `scheduling.k8s.io/v1alpha2` `PodGroup`
/// owned by the job, made from template [`GANG_TEMPLATE`] of its [`gang_workload`], with the
/// same gang policy; every worker names it (`spec.schedulingGroup.podGroupName`). The scheduler
/// binds none of them until `min_count` can be placed. Immutable, and kept by the API server
/// while a pod names it (finalizer `scheduling.k8s.io/podgroup-protection`).
pub fn gang_pod_group(job: &DiphomaJob, min_count: i32) -> PodGroup {
    let name = gang_name(&job.name_any());
    PodGroup {
        metadata: meta(job, name.clone()),
        spec: PodGroupSpec {
            pod_group_template_ref: Some(PodGroupTemplateReference {
                workload: Some(WorkloadPodGroupTemplateReference {
                    workload_name: name,
                    pod_group_template_name: GANG_TEMPLATE.into(),
                }),
            }),
            scheduling_policy: gang_policy(min_count),
            ..Default::default()
        },
        status: None,
    }
}

/// The scheduler-plugins coscheduling plugin's API (`sigs.k8s.io/scheduler-plugins`,
/// `apis/scheduling/v1alpha1`): only the fields the operator writes and reads.
pub mod coscheduling {
    use kube::CustomResource;
    use serde::{Deserialize, Serialize};

    /// The label that puts a pod in a PodGroup of its namespace (its value: the PodGroup's name).
    pub const POD_GROUP_LABEL: &str = "scheduling.x-k8s.io/pod-group";

    /// `PodGroup.spec` (`scheduling.x-k8s.io/v1alpha1`): the plugin binds no pod of the group
    /// until `minMember` of its pods have a node (its Permit stage).
    #[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
    #[kube(
        group = "scheduling.x-k8s.io",
        version = "v1alpha1",
        kind = "PodGroup",
        root = "CoschedulingPodGroup",
        derive = "PartialEq",
        namespaced,
        schema = "disabled"
    )]
    #[serde(rename_all = "camelCase")]
    pub struct PodGroupSpec {
        /// The fewest pods that run together.
        pub min_member: i32,
        /// How long the group's pods wait at Permit for the rest (none: the plugin's
        /// `permitWaitingTimeSeconds`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub schedule_timeout_seconds: Option<i32>,
    }
}

/// The job's gang for the scheduler-plugins coscheduling plugin: a `scheduling.x-k8s.io/v1alpha1`
/// `PodGroup` named [`gang_name`], owned by the job, whose `minMember` is `min_count` (the ring's
/// minimum); every worker carries [`coscheduling::POD_GROUP_LABEL`] naming it. The plugin's
/// timeout at Permit is left to the scheduler's configuration (`permitWaitingTimeSeconds`).
pub fn coscheduling_pod_group(
    job: &DiphomaJob,
    min_count: i32,
) -> coscheduling::CoschedulingPodGroup {
    coscheduling::CoschedulingPodGroup {
        metadata: meta(job, gang_name(&job.name_any())),
        spec: coscheduling::PodGroupSpec {
            min_member: min_count,
            schedule_timeout_seconds: None,
        },
    }
}

/// Why a worker pod cannot be built from a job's template.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The template has no pod spec.
    #[error("job {job}: spec.template.spec is missing")]
    NoPodSpec {
        /// The job.
        job: String,
    },
    /// The template's pod spec has no container.
    #[error("job {job}: spec.template.spec.containers is empty")]
    NoContainer {
        /// The job.
        job: String,
    },
    /// `spec.processesPerWorker` is out of range (the CRD's schema and rules refuse it at
    /// apply; this catches a job that bypassed them).
    #[error("job {job}: spec.processesPerWorker {processes}: {problem}")]
    ProcessesPerWorker {
        /// The job.
        job: String,
        /// The value in effect (`gpusPerWorker` when the field is absent).
        processes: i32,
        /// What is wrong with it.
        problem: String,
    },
}

/// The training processes each worker of `job` runs ([`crate::api::DiphomaJobSpec::processes_per_worker`]),
/// checked: at least 1, at most [`contract::MAX_PROCESSES_PER_WORKER`], and their ports
/// ([`contract::process_port`], `ringPort + 2·l`) below 65536 and clear of the metrics port.
///
/// # Errors
/// [`BuildError::ProcessesPerWorker`] naming the field and what is wrong.
pub fn processes_per_worker(job: &DiphomaJob) -> Result<i32, BuildError> {
    let spec = &job.spec;
    let processes = spec.processes_per_worker();
    let bad = |problem: String| BuildError::ProcessesPerWorker {
        job: job.name_any(),
        processes,
        problem,
    };
    let max = contract::MAX_PROCESSES_PER_WORKER;
    let p = u32::try_from(processes)
        .ok()
        .filter(|p| (1..=max).contains(p))
        .ok_or_else(|| bad(format!("must be 1..={max}")))?;
    let ring = u16::try_from(spec.ring_port).unwrap_or(u16::MAX);
    let last = contract::last_port(ring, p);
    let metrics = u32::from(contract::DEFAULT_METRICS_PORT);
    if last > u32::from(u16::MAX) || (u32::from(ring) <= metrics && metrics <= last + 1) {
        return Err(bad(format!(
            "local rank {} would listen at spec.ringPort {} + {}: above 65535 or reaching the metrics port {metrics}",
            p - 1,
            spec.ring_port,
            2 * (p - 1)
        )));
    }
    Ok(processes)
}

/// A digest of everything in the spec that a worker is built from and that its ring peers must
/// agree on: `template.spec`, `gpusPerWorker`, `checkpoint`, `ringPort`, `ring`, `balance`,
/// `sync` and `faultTolerance.detectionSeconds` (not `replicas`, `elastic`, `runPolicy` nor the
/// failure policy, which only the operator reads, nor `placement` and the node labels and
/// tolerations Kueue's flavors add to it, which say where workers run, nor the template's labels
/// and annotations, which only workers created later carry). 16 hex digits of SHA-256
/// over their JSON (serde's field order, sorted maps): stable across operator versions, so an
/// upgrade replaces nothing. Two workers with the same digest run the same spec; a ring never
/// mixes two (see `plan::workers`).
pub fn worker_spec_digest(job: &DiphomaJob) -> String {
    use sha2::Digest;
    let s = &job.spec;
    let shaping = serde_json::json!([
        s.template.spec,
        s.gpus_per_worker,
        s.checkpoint,
        s.ring_port,
        s.ring,
        s.balance,
        s.sync,
        s.fault_tolerance.detection_seconds,
    ]);
    // Appended only when not 1 (set), so that a job of one process per worker keeps its digest
    // across the upgrade that introduced them (its workers are not replaced); a GPU job whose
    // default became one process per GPU is replaced at once, never a ring of both layouts.
    let mut shaping = shaping;
    if let Some(list) = shaping.as_array_mut() {
        let p = s.processes_per_worker();
        if p != 1 {
            list.push(serde_json::json!({ "processesPerWorker": p }));
        }
        if let Some(m) = &s.shared_memory {
            list.push(serde_json::json!({ "sharedMemory": m }));
        }
    }
    let hash = sha2::Sha256::digest(shaping.to_string().as_bytes());
    hash[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// Worker pod `index` (attempt `attempt`): the user's template plus the contract env, the ring
/// port, labels, `nvidia.com/gpu` limits, GPU node selection and toleration, and the key volume.
/// `restartPolicy` is `Never`: the operator replaces failed workers itself. The first container
/// is the worker.
///
/// With several processes per worker ([`processes_per_worker`]) it also gets their ports and
/// an in-memory `/dev/shm` ([`crate::api::DiphomaJobSpec::shm_size_limit`]) unless the template
/// mounts one.
///
/// Errors: [`BuildError`] naming the job when the template has no pod spec or no container,
/// or `spec.processesPerWorker` is out of range.
pub fn worker_pod(job: &DiphomaJob, index: i32, attempt: i32) -> Result<Pod, BuildError> {
    let spec = &job.spec;
    let name = job.name_any();
    let tpl_meta = spec.template.metadata.clone().unwrap_or_default();
    let mut pod_spec = spec
        .template
        .spec
        .clone()
        .ok_or_else(|| BuildError::NoPodSpec { job: name.clone() })?;
    let c = pod_spec
        .containers
        .first_mut()
        .ok_or_else(|| BuildError::NoContainer { job: name.clone() })?;
    let processes = processes_per_worker(job)?;
    worker_container(job, c, processes);
    if let Some(size) = job.spec.shm_size_limit()
        && !c
            .volume_mounts
            .iter()
            .flatten()
            .any(|m| m.mount_path.trim_end_matches('/') == SHM_PATH)
    {
        // The local processes share memory (data-loader workers, intra-pod exchanges); the
        // container runtime's default /dev/shm is 64 MiB.
        c.volume_mounts.get_or_insert_default().push(VolumeMount {
            name: SHM_VOLUME.into(),
            mount_path: SHM_PATH.into(),
            ..Default::default()
        });
        pod_spec.volumes.get_or_insert_default().push(Volume {
            name: SHM_VOLUME.into(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".into()),
                size_limit: Some(size),
            }),
            ..Default::default()
        });
    }
    pod_spec.volumes.get_or_insert_default().push(Volume {
        name: "diphoma-key".into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(key_secret_name(&name)),
            default_mode: Some(0o400),
            ..Default::default()
        }),
        ..Default::default()
    });
    pod_spec.restart_policy = Some("Never".into());
    // The template's account is kept (IRSA / Workload Identity bind cloud access to it; the
    // worker Role is bound to it too: `role_binding`), else the job's own.
    if pod_spec
        .service_account_name
        .as_deref()
        .is_none_or(str::is_empty)
    {
        pod_spec.service_account_name = Some(worker_account_name(&name));
    }
    // The hostname stays per index (a DNS label, ≤ 63 for every name the CRD accepts), while
    // the pod name counts attempts up.
    pod_spec.hostname = Some(pod_name(&name, index, 0));
    pod_spec.subdomain = Some(name.clone());
    place(spec, &mut pod_spec);
    // A gang-scheduled worker names its gang's PodGroup (immutable on the pod, set at creation).
    // A coscheduled worker is labelled with its PodGroup instead (its `schedulerName` is the
    // operator's option: `crate::plan::workers`).
    pod_spec.scheduling_group = match spec.gang_scheduler() {
        GangScheduler::Kubernetes => Some(PodSchedulingGroup {
            pod_group_name: Some(gang_name(&name)),
        }),
        GangScheduler::None | GangScheduler::Coscheduling => None,
    };
    let mut meta = meta(job, pod_name(&name, index, attempt));
    let mut pod_labels = tpl_meta.labels.unwrap_or_default();
    pod_labels.extend(labels(job));
    if spec.gang_scheduler() == GangScheduler::Coscheduling {
        pod_labels.insert(coscheduling::POD_GROUP_LABEL.into(), gang_name(&name));
    }
    pod_labels.insert(LABEL_REPLICA_INDEX.into(), index.to_string());
    pod_labels.insert(LABEL_WORKER_SPEC.into(), worker_spec_digest(job));
    meta.labels = Some(pod_labels);
    meta.annotations = tpl_meta.annotations;
    Ok(Pod {
        metadata: meta,
        spec: Some(pod_spec),
        status: None,
    })
}

/// The rendezvous store's port of a job whose ring listens on `ring_port`
/// ([`contract::store_port`]; the API keeps `spec.ringPort` at most 65534).
fn store_port(ring_port: i32) -> i32 {
    u16::try_from(ring_port).map_or(ring_port, |p| contract::store_port(p).into())
}

/// The worker container: the contract env (replacing the template's variables of the same
/// names), the checkpoint env and volume, the ring, store and metrics ports, the key mount, GPU
/// limits (and requests, where the template has requests), and, unless the template sets one,
/// `terminationMessagePolicy: FallbackToLogsOnError` (a failed worker's last log lines, such as
/// a Python traceback, become its termination message and `status.lastFailure.message`).
fn worker_container(job: &DiphomaJob, c: &mut Container, processes: i32) {
    let spec = &job.spec;
    c.termination_message_policy
        .get_or_insert_with(|| "FallbackToLogsOnError".into());
    let name = job.name_any();
    let value = |n: &str, v: String| EnvVar {
        name: n.into(),
        value: Some(v),
        value_from: None,
    };
    let field = |n: &str, path: &str| EnvVar {
        name: n.into(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.into(),
                api_version: None,
            }),
            ..Default::default()
        }),
    };
    let contract_env = [
        value(ENV_JOB_NAME, name.clone()),
        value(ENV_JOB_UID, job.uid().unwrap_or_default()),
        field(ENV_NAMESPACE, "metadata.namespace"),
        field(ENV_POD_NAME, "metadata.name"),
        field(ENV_POD_IP, "status.podIP"),
        value(ENV_RING_PORT, spec.ring_port.to_string()),
        value(
            contract::ENV_STORE_PORT,
            store_port(spec.ring_port).to_string(),
        ),
        value(ENV_KEY_FILE, format!("{KEY_MOUNT_DIR}/{KEY_FILE_NAME}")),
        value(ENV_MEMBERSHIP, contract::membership_configmap_name(&name)),
        value(
            contract::ENV_DETECTION_SECONDS,
            spec.fault_tolerance.detection_seconds.to_string(),
        ),
        value(
            contract::ENV_RING_PROTECTION,
            spec.ring.protection.as_str().into(),
        ),
        value(
            contract::ENV_DATA_PLANE,
            spec.ring.data_plane.as_str().into(),
        ),
        value(
            contract::ENV_COMPRESSION,
            spec.ring.compression.as_str().into(),
        ),
        value(
            contract::ENV_SPEED_WEIGHTED,
            spec.balance.speed_weighted.to_string(),
        ),
        value(
            contract::ENV_BALANCE_EVERY,
            spec.balance.every_steps.to_string(),
        ),
        value(contract::ENV_SYNC_EVERY, spec.sync.period().to_string()),
        value(contract::ENV_PROCESSES_PER_WORKER, processes.to_string()),
    ];
    let mut contract_env = contract_env.to_vec();
    if spec.gpus_per_worker == 0 {
        // A CPU worker on a GPU node would otherwise see every GPU (NVIDIA's container runtime
        // exposes all of them to a container that requests none).
        contract_env.push(value(NVIDIA_VISIBLE_DEVICES, "void".into()));
    }
    let env = c.env.get_or_insert_default();
    env.retain(|e| !contract_env.iter().any(|n| n.name == e.name));
    env.extend(contract_env);
    let port = |n: &str, p: i32, protocol: &str| ContainerPort {
        name: Some(n.into()),
        container_port: p,
        protocol: Some(protocol.into()),
        ..Default::default()
    };
    c.ports.get_or_insert_default().extend([
        port(contract::RING_PORT_NAME, spec.ring_port, "TCP"),
        port(contract::LIVENESS_PORT_NAME, spec.ring_port, "UDP"),
        port(contract::STORE_PORT_NAME, store_port(spec.ring_port), "TCP"),
        port(
            contract::METRICS_PORT_NAME,
            contract::DEFAULT_METRICS_PORT.into(),
            "TCP",
        ),
    ]);
    // Local rank l ≥ 1 at ringPort + 2·l (contract::process_port), TCP and UDP like rank 0's.
    for l in 1..processes {
        let p = spec.ring_port + 2 * l;
        c.ports.get_or_insert_default().extend([
            port(&format!("ring-{l}"), p, "TCP"),
            port(&format!("liveness-{l}"), p, "UDP"),
        ]);
    }
    let mounts = c.volume_mounts.get_or_insert_default();
    if let Some(cp) = &spec.checkpoint {
        // Rank 0 checkpoints into the named volume: where the template mounts it, else here.
        let path = match mounts.iter().find(|m| m.name == cp.volume) {
            Some(m) => m.mount_path.clone(),
            None => {
                mounts.push(VolumeMount {
                    name: cp.volume.clone(),
                    mount_path: CHECKPOINT_MOUNT_DIR.into(),
                    ..Default::default()
                });
                CHECKPOINT_MOUNT_DIR.to_owned()
            }
        };
        env.extend([
            value(contract::ENV_CHECKPOINT_DIR, path),
            value(contract::ENV_CHECKPOINT_EVERY, cp.every_steps.to_string()),
        ]);
        if let Some(from) = &cp.resume_from {
            env.push(value(
                contract::ENV_CHECKPOINT_RESUME_FROM,
                from.name.clone(),
            ));
        }
    }
    mounts.push(VolumeMount {
        name: "diphoma-key".into(),
        mount_path: KEY_MOUNT_DIR.into(),
        read_only: Some(true),
        ..Default::default()
    });
    if spec.gpus_per_worker > 0 {
        let g = Quantity(spec.gpus_per_worker.to_string());
        let resources = c.resources.get_or_insert_default();
        resources
            .limits
            .get_or_insert_default()
            .insert(GPU_RESOURCE.into(), g.clone());
        if let Some(requests) = &mut resources.requests {
            requests.insert(GPU_RESOURCE.into(), g);
        }
    }
}

/// Node choice: the template's node selector and tolerations plus [`crate::api::Placement`]'s,
/// the GPU taint tolerated by GPU workers, and the placement's affinity when it has one. GPU
/// nodes are found by the `nvidia.com/gpu` resource alone: no node label is required (only
/// NVIDIA's GPU Feature Discovery sets `nvidia.com/gpu.present`).
fn place(spec: &crate::api::DiphomaJobSpec, pod_spec: &mut PodSpec) {
    let placement = spec.placement.clone().unwrap_or_default();
    let mut selector = pod_spec.node_selector.take().unwrap_or_default();
    selector.extend(placement.node_selector);
    let mut tolerations = pod_spec.tolerations.take().unwrap_or_default();
    tolerations.extend(placement.tolerations);
    if spec.gpus_per_worker > 0 {
        tolerations.push(Toleration {
            key: Some(GPU_RESOURCE.into()),
            operator: Some("Exists".into()),
            effect: Some("NoSchedule".into()),
            ..Default::default()
        });
    }
    pod_spec.node_selector = (!selector.is_empty()).then_some(selector);
    pod_spec.tolerations = (!tolerations.is_empty()).then_some(tolerations);
    pod_spec.affinity = merge_affinity(pod_spec.affinity.take(), placement.affinity);
}

/// Both affinities at once (`None` when neither is set): required node affinity as the pairs of
/// one term of each (node selector terms are ORed, so `a AND b` is every `a_i AND b_j`), and
/// every other term list (preferred node terms, pod affinity and anti-affinity, all ANDed or
/// weighed by the scheduler) concatenated.
pub fn merge_affinity(a: Option<Affinity>, b: Option<Affinity>) -> Option<Affinity> {
    let (mut a, b) = match (a, b) {
        (None, b) => return b,
        (a, None) => return a,
        (Some(a), Some(b)) => (a, b),
    };
    fn cat<T>(x: &mut Option<Vec<T>>, y: Option<Vec<T>>) {
        if let Some(y) = y {
            x.get_or_insert_default().extend(y);
        }
    }
    if let Some(bn) = b.node_affinity {
        let an = a.node_affinity.get_or_insert_default();
        cat(
            &mut an.preferred_during_scheduling_ignored_during_execution,
            bn.preferred_during_scheduling_ignored_during_execution,
        );
        an.required_during_scheduling_ignored_during_execution = match (
            an.required_during_scheduling_ignored_during_execution
                .take(),
            bn.required_during_scheduling_ignored_during_execution,
        ) {
            (Some(mut x), Some(y)) => {
                x.node_selector_terms = x
                    .node_selector_terms
                    .iter()
                    .flat_map(|s| {
                        y.node_selector_terms.iter().map(move |t| {
                            let mut st = s.clone();
                            cat(&mut st.match_expressions, t.match_expressions.clone());
                            cat(&mut st.match_fields, t.match_fields.clone());
                            st
                        })
                    })
                    .collect();
                Some(x)
            }
            (x, y) => x.or(y),
        };
    }
    // Pod affinity and anti-affinity: two types of the same two term lists.
    macro_rules! both_terms {
        ($field:ident) => {
            if let Some(bp) = b.$field {
                let ap = a.$field.get_or_insert_default();
                cat(
                    &mut ap.required_during_scheduling_ignored_during_execution,
                    bp.required_during_scheduling_ignored_during_execution,
                );
                cat(
                    &mut ap.preferred_during_scheduling_ignored_during_execution,
                    bp.preferred_during_scheduling_ignored_during_execution,
                );
            }
        };
    }
    both_terms!(pod_affinity);
    both_terms!(pod_anti_affinity);
    Some(a)
}

/// Keeps `pod` off `nodes` (nodes found lost): a required node-affinity term excluding their
/// hostnames, added to every term the template already has. No-op for an empty set or a pod
/// without spec.
pub fn avoid_nodes(pod: &mut Pod, nodes: &std::collections::BTreeSet<String>) {
    let Some(spec) = pod.spec.as_mut().filter(|_| !nodes.is_empty()) else {
        return;
    };
    let expr = NodeSelectorRequirement {
        key: "kubernetes.io/hostname".into(),
        operator: "NotIn".into(),
        values: Some(nodes.iter().cloned().collect()),
    };
    let required = spec
        .affinity
        .get_or_insert_default()
        .node_affinity
        .get_or_insert_default()
        .required_during_scheduling_ignored_during_execution
        .get_or_insert_default();
    if required.node_selector_terms.is_empty() {
        required
            .node_selector_terms
            .push(NodeSelectorTerm::default());
    }
    for t in &mut required.node_selector_terms {
        t.match_expressions
            .get_or_insert_default()
            .push(expr.clone());
    }
}

/// The headless Service of the workers (stable DNS names; the ring itself dials pod IPs).
pub fn service(job: &DiphomaJob) -> Service {
    Service {
        metadata: meta(job, job.name_any()),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(BTreeMap::from([(LABEL_JOB_NAME.into(), job.name_any())])),
            ports: Some(vec![ServicePort {
                name: Some(contract::RING_PORT_NAME.into()),
                port: job.spec.ring_port,
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    }
}

/// The job's NetworkPolicy (created when the operator runs with `--network-policy`): the ring
/// port of its workers (TCP, and UDP for liveness pings) and the rendezvous store's port accept
/// only this job's workers (with `spec.ring.dataPlane: gloo` or `nccl`, every TCP port: gloo listens on
/// ephemeral ones; so do the cross-pod rings of the hierarchical all-reduce of a job of several
/// processes per worker); the metrics port stays open to scrapers.
/// Other ingress to the workers is denied (the policy selects them).
pub fn network_policy(job: &DiphomaJob) -> NetworkPolicy {
    let workers = LabelSelector {
        match_labels: Some(BTreeMap::from([(LABEL_JOB_NAME.into(), job.name_any())])),
        ..Default::default()
    };
    let on = |protocol: &str, port: i32| NetworkPolicyPort {
        protocol: Some(protocol.into()),
        port: Some(IntOrString::Int(port)),
        ..Default::default()
    };
    // The ring ports of every local process: ringPort ..= ringPort + 2·(P − 1).
    let last = job.spec.ring_port + 2 * (job.spec.processes_per_worker().max(1) - 1);
    let ring = |protocol: &str| NetworkPolicyPort {
        end_port: (last > job.spec.ring_port).then_some(last),
        ..on(protocol, job.spec.ring_port)
    };
    NetworkPolicy {
        metadata: meta(job, job.name_any()),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(workers.clone()),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![
                NetworkPolicyIngressRule {
                    from: Some(vec![NetworkPolicyPeer {
                        pod_selector: Some(workers),
                        ..Default::default()
                    }]),
                    ports: Some(
                        if job.spec.ring.data_plane == DataPlane::Ring
                            && job.spec.processes_per_worker() <= 1
                        {
                            vec![ring("TCP"), on("TCP", store_port(job.spec.ring_port))]
                        } else {
                            // gloo's and NCCL's stores and connections, and the cross-pod rings of the
                            // hierarchical all-reduce (several processes per worker), listen on
                            // ephemeral ports.
                            vec![NetworkPolicyPort {
                                protocol: Some("TCP".into()),
                                ..Default::default()
                            }]
                        },
                    ),
                },
                // The liveness port answers anyone: the operator's probe of a silent member, and
                // its peers'. A pong is as long as its ping and only a key holder can check it.
                NetworkPolicyIngressRule {
                    from: None,
                    ports: Some(vec![
                        ring("UDP"),
                        on("TCP", contract::DEFAULT_METRICS_PORT.into()),
                    ]),
                },
            ]),
            ..Default::default()
        }),
    }
}

/// The workers' ServiceAccount.
pub fn service_account(job: &DiphomaJob) -> ServiceAccount {
    ServiceAccount {
        metadata: meta(job, worker_account_name(&job.name_any())),
        ..Default::default()
    }
}

/// The workers' Role: read this job's ring ConfigMap, read and update its heartbeat ConfigMap.
/// Nothing else (the key reaches the pods as a volume, mounted by the kubelet).
pub fn role(job: &DiphomaJob) -> Role {
    let name = job.name_any();
    let configmap = |verbs: &[&str], object: String| PolicyRule {
        api_groups: Some(vec!["".into()]),
        resources: Some(vec!["configmaps".into()]),
        verbs: verbs.iter().map(|v| (*v).to_owned()).collect(),
        resource_names: Some(vec![object]),
        ..Default::default()
    };
    Role {
        metadata: meta(job, worker_account_name(&name)),
        rules: Some(vec![
            configmap(
                &["get", "list", "watch"],
                contract::membership_configmap_name(&name),
            ),
            configmap(
                &["get", "patch", "update"],
                contract::heartbeat_configmap_name(&name),
            ),
        ]),
    }
}

/// Binds [`role`] to [`service_account`] and to the template's `serviceAccountName` when it names
/// another (the account its workers then run as).
pub fn role_binding(job: &DiphomaJob) -> RoleBinding {
    let name = worker_account_name(&job.name_any());
    let account = |name: String| Subject {
        kind: "ServiceAccount".into(),
        name,
        namespace: job.namespace(),
        ..Default::default()
    };
    let mut subjects = vec![account(name.clone())];
    // The template's own account, which its workers run as (`worker_pod`).
    if let Some(own) = job
        .spec
        .template
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .filter(|s| !s.is_empty() && *s != name)
    {
        subjects.push(account(own));
    }
    RoleBinding {
        metadata: meta(job, name.clone()),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: name.clone(),
        },
        subjects: Some(subjects),
    }
}

/// The ring ConfigMap holding one generation's membership JSON.
pub fn ring_configmap(job: &DiphomaJob, m: &Membership) -> ConfigMap {
    ConfigMap {
        metadata: meta(job, contract::membership_configmap_name(&job.name_any())),
        data: Some(BTreeMap::from([(
            MEMBERSHIP_KEY.to_owned(),
            serde_json::to_string(m).expect("membership serializes"),
        )])),
        ..Default::default()
    }
}

/// The job's heartbeat ConfigMap, created empty: rank 0's progress and the workers' failure
/// reports go into it (docs/design/heartbeat.md).
pub fn heartbeat_configmap(job: &DiphomaJob) -> ConfigMap {
    ConfigMap {
        metadata: meta(job, contract::heartbeat_configmap_name(&job.name_any())),
        ..Default::default()
    }
}

/// The per-job key Secret with `key` (at least [`contract::MIN_KEY_LEN`] random bytes). Created
/// once and never re-applied, so the key does not change under running workers.
pub fn key_secret(job: &DiphomaJob, key: Vec<u8>) -> Secret {
    Secret {
        metadata: meta(job, key_secret_name(&job.name_any())),
        data: Some(BTreeMap::from([(
            KEY_FILE_NAME.to_owned(),
            k8s_openapi::ByteString(key),
        )])),
        type_: Some("Opaque".into()),
        ..Default::default()
    }
}

/// The kinds of object the operator writes and watches (the key of [`Child::kind`] and of the
/// controller's read-your-writes bookkeeping, `controller::caches::Seen`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// `DiphomaJob` (the controller's own watch).
    Job,
    /// Worker pods.
    Pod,
    /// Ring and heartbeat ConfigMaps.
    ConfigMap,
    /// The workers' ServiceAccount.
    ServiceAccount,
    /// The workers' Role.
    Role,
    /// The workers' RoleBinding.
    RoleBinding,
    /// The headless Service.
    Service,
    /// The key Secret.
    Secret,
    /// The NetworkPolicy (made only when the operator's option says so).
    NetworkPolicy,
    /// The job's Kueue Workload (`kueue.x-k8s.io/v1beta2`), when Kueue is served.
    KueueWorkload,
    /// The job's gang Workload (`scheduling.k8s.io/v1alpha2`), when the API server serves it.
    GangWorkload,
    /// The job's gang PodGroup (`scheduling.k8s.io/v1alpha2`), when the API server serves it.
    GangPodGroup,
    /// The job's coscheduling PodGroup (`scheduling.x-k8s.io/v1alpha1`), when the API server
    /// serves it. The last variant: `controller::caches` counts the kinds from it.
    CoschedulingPodGroup,
}

impl Kind {
    /// The kinds of the static children ([`children`]) whose metadata alone the operator keeps,
    /// each in a store of its own and every one watched (`controller::caches`), pruned when the
    /// table no longer builds them. The one table to extend for a new child kind (besides the
    /// variant, its [`Kind::name`] and [`Kind::resource`]).
    pub const BY_METADATA: [Kind; 6] = [
        Kind::ServiceAccount,
        Kind::Role,
        Kind::RoleBinding,
        Kind::Service,
        Kind::Secret,
        Kind::NetworkPolicy,
    ];

    /// Its API resource (group, version, plural), for a dynamic `Api` and store.
    pub fn resource(self) -> ApiResource {
        match self {
            Kind::Job => ApiResource::erase::<DiphomaJob>(&()),
            Kind::Pod => ApiResource::erase::<Pod>(&()),
            Kind::ConfigMap => ApiResource::erase::<ConfigMap>(&()),
            Kind::ServiceAccount => ApiResource::erase::<ServiceAccount>(&()),
            Kind::Role => ApiResource::erase::<Role>(&()),
            Kind::RoleBinding => ApiResource::erase::<RoleBinding>(&()),
            Kind::Service => ApiResource::erase::<Service>(&()),
            Kind::Secret => ApiResource::erase::<Secret>(&()),
            Kind::NetworkPolicy => ApiResource::erase::<NetworkPolicy>(&()),
            Kind::KueueWorkload => crate::queue::workloads(),
            Kind::GangWorkload => ApiResource::erase::<Workload>(&()),
            Kind::GangPodGroup => ApiResource::erase::<PodGroup>(&()),
            Kind::CoschedulingPodGroup => {
                ApiResource::erase::<coscheduling::CoschedulingPodGroup>(&())
            }
        }
    }

    /// The Kubernetes kind, as `Kind/name` strings and errors name it.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Job => "DiphomaJob",
            Kind::Pod => "Pod",
            Kind::ConfigMap => "ConfigMap",
            Kind::ServiceAccount => "ServiceAccount",
            Kind::Role => "Role",
            Kind::RoleBinding => "RoleBinding",
            Kind::Service => "Service",
            Kind::Secret => "Secret",
            Kind::NetworkPolicy => "NetworkPolicy",
            Kind::KueueWorkload | Kind::GangWorkload => "Workload",
            Kind::GangPodGroup | Kind::CoschedulingPodGroup => "PodGroup",
        }
    }
}

/// One static child of a job, as the API server takes it, and how it is written.
#[derive(Debug, Clone)]
pub struct Child {
    /// Its kind (the store it is looked up in, the watch that delivers its writes, its API
    /// resource: [`Kind::resource`]).
    pub kind: Kind,
    /// The object.
    pub object: DynamicObject,
    /// Created once and never re-applied (server-side applied on every apply otherwise); an
    /// orphan of a deleted job of the same name is taken over (`controller::caches::adoption`).
    pub once: bool,
    /// The job's workers run on it once they exist: never taken over from then on.
    pub pinned_by_workers: bool,
}

impl Child {
    fn new<K>(kind: Kind, obj: &K, once: bool, pinned_by_workers: bool) -> Child
    where
        K: Resource<DynamicType = ()> + serde::Serialize,
    {
        let value = serde_json::to_value(obj).expect("a typed object serializes");
        debug_assert_eq!(kind.resource(), ApiResource::erase::<K>(&()));
        Child {
            kind,
            object: serde_json::from_value(value).expect("a typed object is a dynamic object"),
            once,
            pinned_by_workers,
        }
    }

    /// Its name.
    pub fn name(&self) -> String {
        self.object.name_any()
    }
}

/// The job's static children, in the order they are written, all of them listed here and
/// nowhere else: ServiceAccount, Role, RoleBinding, Service and (`network_policy`)
/// NetworkPolicy, server-side applied; the key Secret holding `key` (created once, never under
/// running workers) and the heartbeat ConfigMap (created once, empty: the workers may patch it
/// but not create it, as create cannot be limited by resourceNames).
pub fn children(job: &DiphomaJob, network_policy: bool, key: Vec<u8>) -> Vec<Child> {
    let mut all = vec![
        Child::new(Kind::ServiceAccount, &service_account(job), false, false),
        Child::new(Kind::Role, &role(job), false, false),
        Child::new(Kind::RoleBinding, &role_binding(job), false, false),
        Child::new(Kind::Service, &service(job), false, false),
    ];
    if network_policy {
        let np = self::network_policy(job);
        all.push(Child::new(Kind::NetworkPolicy, &np, false, false));
    }
    all.push(Child::new(Kind::Secret, &key_secret(job, key), true, true));
    all.push(Child::new(
        Kind::ConfigMap,
        &heartbeat_configmap(job),
        true,
        false,
    ));
    all
}

/// The replica index of one of the job's pods (its label).
pub fn replica_index(pod: &Pod) -> Option<i32> {
    pod.labels().get(LABEL_REPLICA_INDEX)?.parse().ok()
}

/// The attempt number encoded in a worker pod's name (`<job>-worker-<i>[-<attempt>]`).
pub fn attempt_of(job: &str, pod: &str) -> i32 {
    let rest = pod
        .strip_prefix(&format!("{job}-worker-"))
        .unwrap_or_default();
    rest.split_once('-')
        .and_then(|(_, a)| a.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::api::DiphomaJobSpec;
    use serde_json::json;

    /// A stored job (name, namespace, uid set) from a spec given as JSON.
    pub fn job(spec: serde_json::Value) -> DiphomaJob {
        let spec: DiphomaJobSpec = serde_json::from_value(spec).unwrap();
        let mut j = DiphomaJob::new("train", spec);
        j.metadata.namespace = Some("ml".into());
        j.metadata.uid = Some("uid-1".into());
        j.metadata.generation = Some(1);
        j
    }

    pub fn basic() -> DiphomaJob {
        job(
            json!({"replicas": 4, "gpusPerWorker": 2, "template": {"metadata": {"labels": {"team": "a"}},
            "spec": {"containers": [{"name": "w", "image": "diphoma-worker", "env": [{"name": "X", "value": "1"}]}]}}}),
        )
    }

    #[test]
    fn the_longest_accepted_name_fits_every_child_through_repairs() {
        let long = "a".repeat(crate::api::MAX_NAME_LEN);
        let mut j = basic();
        j.metadata.name = Some(long.clone());
        j.spec.replicas = 4096;
        let dns_label = |s: &str| {
            s.len() <= 63
                && s.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        };
        let p = worker_pod(&j, 4095, 10_000).unwrap();
        let spec = p.spec.as_ref().unwrap();
        assert!(dns_label(spec.hostname.as_deref().unwrap()), "hostname");
        assert!(dns_label(spec.subdomain.as_deref().unwrap()), "subdomain");
        assert!(p.labels().values().all(|v| v.len() <= 63), "label values");
        assert!(p.name_any().len() <= 253);
        assert!(dns_label(&service(&j).name_any()), "Service");
        for name in [
            role(&j).name_any(),
            key_secret_name(&long),
            contract::membership_configmap_name(&long),
            contract::heartbeat_configmap_name(&long),
        ] {
            assert!(name.len() <= 253, "{name}");
        }
        // The CEL rule states the same limit.
        assert!(crate::api::NAME_RULE.contains(&crate::api::MAX_NAME_LEN.to_string()));
    }

    #[test]
    fn processes_per_worker_defaults_to_one_and_is_checked_by_name() {
        let mut j = basic();
        assert_eq!(
            j.spec.processes_per_worker(),
            1,
            "gpusPerWorker 2, one process unless asked (the image may run one)"
        );
        assert!(
            worker_pod(&j, 0, 0)
                .unwrap()
                .spec
                .unwrap()
                .volumes
                .unwrap_or_default()
                .iter()
                .all(|v| v.name != SHM_VOLUME),
            "no /dev/shm for one process"
        );
        j.spec.processes_per_worker = Some(3);
        assert_eq!(processes_per_worker(&j).unwrap(), 3);
        for (p, port) in [(0, 29500), (65, 29500), (2, 65534), (4, 9394)] {
            j.spec.processes_per_worker = Some(p);
            j.spec.ring_port = port;
            let e = processes_per_worker(&j).unwrap_err().to_string();
            assert!(e.contains("spec.processesPerWorker"), "{e}");
            assert!(worker_pod(&j, 0, 0).is_err(), "{p} at {port}");
        }
        j.spec.ring_port = 9402;
        j.spec.processes_per_worker = Some(4);
        assert_eq!(
            processes_per_worker(&j).unwrap(),
            4,
            "above the metrics port"
        );
        // The CRD refuses the same at apply, naming the field.
        let crd = serde_json::to_string(&<DiphomaJob as kube::CustomResourceExt>::crd()).unwrap();
        assert!(
            crd.contains("spec.processesPerWorker: local rank l listens at spec.ringPort + 2*l")
        );
    }

    #[test]
    fn workers_of_several_processes_get_the_layout_their_ports_and_shared_memory() {
        let mut j = basic();
        j.spec.processes_per_worker = Some(8);
        j.spec.gpus_per_worker = 8;
        let p = worker_pod(&j, 0, 0).unwrap();
        let spec = p.spec.as_ref().unwrap();
        let c = &spec.containers[0];
        let env: Vec<_> = c
            .env
            .iter()
            .flatten()
            .map(|e| (e.name.as_str(), e.value.as_deref()))
            .collect();
        assert!(env.contains(&(contract::ENV_PROCESSES_PER_WORKER, Some("8"))));
        assert!(
            !env.iter()
                .any(|(n, _)| *n == "CUDA_VISIBLE_DEVICES" || *n == NVIDIA_VISIBLE_DEVICES)
        );
        let ports: Vec<_> = c
            .ports
            .iter()
            .flatten()
            .map(|p| (p.name.as_deref().unwrap(), p.container_port))
            .collect();
        assert!(ports.contains(&("ring-7", 29514)) && ports.contains(&("liveness-7", 29514)));
        assert!(ports.contains(&("store", 29501)));
        let shm = spec
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == SHM_VOLUME)
            .unwrap();
        let dir = shm.empty_dir.as_ref().unwrap();
        assert_eq!(dir.medium.as_deref(), Some("Memory"));
        assert_eq!(
            dir.size_limit,
            Some(Quantity("16Gi".into())),
            "2Gi per process"
        );
        assert!(
            c.volume_mounts
                .iter()
                .flatten()
                .any(|m| m.name == SHM_VOLUME && m.mount_path == SHM_PATH)
        );
        j.spec.shared_memory = Some(Quantity("40Gi".into()));
        let p = worker_pod(&j, 0, 0).unwrap();
        let vols = p.spec.unwrap().volumes.unwrap();
        assert_eq!(
            vols.iter()
                .find(|v| v.name == SHM_VOLUME)
                .unwrap()
                .empty_dir
                .as_ref()
                .unwrap()
                .size_limit,
            Some(Quantity("40Gi".into()))
        );
        // The NetworkPolicy admits every process's ring port (liveness probes; TCP is open on
        // every port among the workers, for the hierarchical all-reduce's cross-pod rings).
        let np = network_policy(&j);
        let rules = np.spec.unwrap().ingress.unwrap();
        let ring = &rules[1].ports.as_ref().unwrap()[0];
        assert_eq!(
            (ring.port.clone(), ring.end_port),
            (Some(IntOrString::Int(29500)), Some(29514))
        );
        // One process: no volume, no extra port, and the digest of a job that predates the field.
        let mut one = basic();
        one.spec.gpus_per_worker = 0;
        let before = worker_spec_digest(&one);
        let p = worker_pod(&one, 0, 0).unwrap();
        let spec = p.spec.unwrap();
        assert!(!spec.volumes.iter().flatten().any(|v| v.name == SHM_VOLUME));
        assert!(
            !spec.containers[0]
                .ports
                .iter()
                .flatten()
                .any(|p| p.name.as_deref() == Some("ring-1"))
        );
        one.spec.processes_per_worker = Some(2);
        assert_ne!(
            worker_spec_digest(&one),
            before,
            "a new layout is a new worker spec"
        );
        one.spec.processes_per_worker = Some(1);
        assert_eq!(worker_spec_digest(&one), before);
    }

    #[test]
    fn gpu_workers_need_only_the_resource_and_cpu_workers_see_no_gpu() {
        let gpu = worker_pod(&basic(), 0, 0).unwrap();
        let spec = gpu.spec.as_ref().unwrap();
        assert!(
            spec.node_selector.is_none(),
            "no GPU Feature Discovery label required: {:?}",
            spec.node_selector
        );
        let env = |p: &Pod| -> Vec<(String, Option<String>)> {
            p.spec.as_ref().unwrap().containers[0]
                .env
                .iter()
                .flatten()
                .map(|e| (e.name.clone(), e.value.clone()))
                .collect()
        };
        assert!(!env(&gpu).iter().any(|(n, _)| n == NVIDIA_VISIBLE_DEVICES));
        let mut cpu = basic();
        cpu.spec.gpus_per_worker = 0;
        let p = worker_pod(&cpu, 0, 0).unwrap();
        assert!(env(&p).contains(&(NVIDIA_VISIBLE_DEVICES.into(), Some("void".into()))));
    }

    #[test]
    fn worker_pod_carries_contract_gpu_and_key() {
        let p = worker_pod(&basic(), 2, 0).unwrap();
        assert_eq!(p.metadata.name.as_deref(), Some("train-worker-2"));
        let labels = p.metadata.labels.clone().unwrap();
        assert_eq!(labels[LABEL_REPLICA_INDEX], "2");
        assert_eq!(labels["team"], "a");
        assert_eq!(
            p.metadata.owner_references.as_ref().unwrap()[0].kind,
            "DiphomaJob"
        );
        let spec = p.spec.unwrap();
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        let c = &spec.containers[0];
        assert_eq!(
            c.resources.as_ref().unwrap().limits.as_ref().unwrap()[GPU_RESOURCE].0,
            "2"
        );
        let env: Vec<&str> = c
            .env
            .as_ref()
            .unwrap()
            .iter()
            .map(|e| e.name.as_str())
            .collect();
        for n in [
            "X",
            ENV_JOB_NAME,
            ENV_JOB_UID,
            ENV_POD_NAME,
            ENV_POD_IP,
            ENV_RING_PORT,
            ENV_KEY_FILE,
            ENV_MEMBERSHIP,
            contract::ENV_DETECTION_SECONDS,
            contract::ENV_RING_PROTECTION,
        ] {
            assert!(env.contains(&n), "{n} missing from {env:?}");
        }
        let ports = c.ports.as_ref().unwrap();
        assert_eq!(ports[0].container_port, 29500);
        assert_eq!(
            (ports[1].container_port, ports[1].protocol.as_deref()),
            (29500, Some("UDP")),
            "liveness pings on the ring port's number"
        );
        assert_eq!(
            (ports[2].name.as_deref(), ports[2].container_port),
            (Some(contract::STORE_PORT_NAME), 29501),
            "torch's rendezvous store on the next port"
        );
        assert!(env.contains(&contract::ENV_STORE_PORT));
        assert_eq!(
            c.termination_message_policy.as_deref(),
            Some("FallbackToLogsOnError"),
            "a failed worker's last log lines reach lastFailure"
        );
        assert!(
            c.volume_mounts
                .as_ref()
                .unwrap()
                .iter()
                .any(|m| m.mount_path == KEY_MOUNT_DIR && m.read_only == Some(true))
        );
        assert_eq!(
            spec.tolerations.unwrap()[0].key.as_deref(),
            Some(GPU_RESOURCE)
        );
        assert_eq!(spec.service_account_name.as_deref(), Some("train-worker"));
    }

    #[test]
    fn checkpoint_volume_is_mounted_and_passed_to_the_worker() {
        let mut j = basic();
        j.spec.checkpoint = Some(crate::api::Checkpoint {
            volume: "ckpt".into(),
            every_steps: 25,
            resume_from: Some(crate::api::ResumeFrom {
                name: "earlier".into(),
            }),
        });
        let c = worker_pod(&j, 0, 0)
            .unwrap()
            .spec
            .unwrap()
            .containers
            .remove(0);
        let env: BTreeMap<String, String> = c
            .env
            .unwrap()
            .into_iter()
            .filter_map(|e| Some((e.name, e.value?)))
            .collect();
        assert_eq!(env[contract::ENV_CHECKPOINT_DIR], CHECKPOINT_MOUNT_DIR);
        assert_eq!(env[contract::ENV_CHECKPOINT_EVERY], "25");
        assert_eq!(env[contract::ENV_CHECKPOINT_RESUME_FROM], "earlier");
        assert!(
            c.volume_mounts
                .unwrap()
                .iter()
                .any(|m| m.name == "ckpt" && m.mount_path == CHECKPOINT_MOUNT_DIR)
        );
    }

    /// The value of env `name` in worker 0's container of `j`.
    fn worker_env(j: &DiphomaJob, name: &str) -> Option<String> {
        worker_pod(j, 0, 0).unwrap().spec.unwrap().containers[0]
            .env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .and_then(|e| e.value.clone())
    }

    #[test]
    fn ring_protection_reaches_the_worker_none_by_default() {
        let protection = |j: &DiphomaJob| worker_env(j, contract::ENV_RING_PROTECTION);
        let mut j = basic();
        assert_eq!(protection(&j).as_deref(), Some("none"));
        j.spec.ring.protection = crate::api::RingProtection::Integrity;
        assert_eq!(protection(&j).as_deref(), Some("integrity"));
        j.spec.ring.protection = crate::api::RingProtection::Encryption;
        assert_eq!(protection(&j).as_deref(), Some("encryption"));
    }

    #[test]
    fn the_data_plane_reaches_the_worker_and_only_a_library_changes_the_digest() {
        let plane = |j: &DiphomaJob| worker_env(j, contract::ENV_DATA_PLANE);
        let mut j = basic();
        let before = worker_spec_digest(&j);
        assert_eq!(plane(&j).as_deref(), Some("ring"));
        j.spec.ring.data_plane = DataPlane::Ring;
        assert_eq!(
            worker_spec_digest(&j),
            before,
            "ring, stated: the digest of before"
        );
        j.spec.ring.data_plane = DataPlane::Gloo;
        assert_eq!(plane(&j).as_deref(), Some("gloo"));
        assert_ne!(
            worker_spec_digest(&j),
            before,
            "a ring never mixes data planes"
        );
        let gloo = worker_spec_digest(&j);
        j.spec.ring.data_plane = DataPlane::Nccl;
        assert_eq!(plane(&j).as_deref(), Some("nccl"));
        assert!(![before, gloo].contains(&worker_spec_digest(&j)));
    }

    #[test]
    fn compression_reaches_the_worker_and_only_bf16_changes_the_digest() {
        let wire = |j: &DiphomaJob| worker_env(j, contract::ENV_COMPRESSION);
        let mut j = basic();
        let before = worker_spec_digest(&j);
        assert_eq!(wire(&j).as_deref(), Some("none"));
        j.spec.ring.compression = crate::api::Compression::Bf16;
        assert_eq!(wire(&j).as_deref(), Some("bf16"));
        assert_ne!(
            worker_spec_digest(&j),
            before,
            "a ring never mixes wire dtypes"
        );
    }

    #[test]
    fn balance_and_sync_reach_the_worker() {
        let env = |j: &DiphomaJob| -> BTreeMap<String, String> {
            worker_pod(j, 0, 0).unwrap().spec.unwrap().containers[0]
                .env
                .iter()
                .flatten()
                .filter_map(|e| Some((e.name.clone(), e.value.clone()?)))
                .collect()
        };
        let mut j = basic();
        let e = env(&j);
        assert_eq!(e[contract::ENV_SPEED_WEIGHTED], "true");
        assert_eq!(e[contract::ENV_BALANCE_EVERY], "10");
        assert_eq!(e[contract::ENV_SYNC_EVERY], "0");
        j = job(
            json!({"replicas": 2, "template": {"spec": {"containers": [{"name": "w"}]}},
            "balance": {"speedWeighted": false, "everySteps": 5},
            "sync": {"mode": "Periodic", "everySteps": 8}}),
        );
        let e = env(&j);
        assert_eq!(e[contract::ENV_SPEED_WEIGHTED], "false");
        assert_eq!(e[contract::ENV_BALANCE_EVERY], "5");
        assert_eq!(e[contract::ENV_SYNC_EVERY], "8");
    }

    #[test]
    fn a_gloo_or_hierarchical_jobs_network_policy_opens_every_tcp_port_to_its_own_workers_only() {
        let mut gloo = basic();
        gloo.spec.ring.data_plane = DataPlane::Gloo;
        let mut pods_of_two = basic();
        pods_of_two.spec.processes_per_worker = Some(2);
        // The liveness rule stays on the ring ports of every local process.
        let first = basic().spec.ring_port;
        for (j, last) in [(gloo, None), (pods_of_two, Some(first + 2))] {
            let spec = network_policy(&j).spec.unwrap();
            let rules = spec.ingress.unwrap();
            let own = &rules[0];
            assert!(own.from.as_ref().unwrap()[0].pod_selector.is_some());
            let ports = own.ports.as_ref().unwrap();
            assert_eq!(ports.len(), 1);
            assert_eq!(
                (ports[0].protocol.as_deref(), &ports[0].port),
                (Some("TCP"), &None)
            );
            let liveness = &rules[1].ports.as_ref().unwrap()[0];
            assert_eq!(
                (
                    liveness.protocol.as_deref(),
                    &liveness.port,
                    liveness.end_port
                ),
                (Some("UDP"), &Some(IntOrString::Int(first)), last)
            );
        }
    }

    #[test]
    fn network_policy_opens_the_ring_port_to_the_jobs_own_workers_only_and_liveness_to_probes() {
        let np = network_policy(&basic());
        let spec = np.spec.unwrap();
        let own = Some(BTreeMap::from([(
            LABEL_JOB_NAME.to_owned(),
            "train".to_owned(),
        )]));
        assert_eq!(spec.pod_selector.unwrap().match_labels, own);
        let rules = spec.ingress.unwrap();
        let ring = &rules[0];
        let from = ring.from.as_ref().unwrap();
        assert_eq!(from.len(), 1);
        assert_eq!(from[0].pod_selector.as_ref().unwrap().match_labels, own);
        assert!(from[0].namespace_selector.is_none(), "same namespace only");
        let ports_of =
            |r: &NetworkPolicyIngressRule| -> Vec<(Option<String>, Option<IntOrString>)> {
                r.ports
                    .iter()
                    .flatten()
                    .map(|p| (p.protocol.clone(), p.port.clone()))
                    .collect()
            };
        let tcp = || Some("TCP".to_owned());
        let ring_port = Some(IntOrString::Int(basic().spec.ring_port));
        assert_eq!(
            ports_of(ring),
            [
                (tcp(), ring_port.clone()),
                (tcp(), Some(IntOrString::Int(basic().spec.ring_port + 1)))
            ],
            "the ring and torch's rendezvous store"
        );
        assert!(
            rules[1].from.is_none(),
            "liveness and metrics open to probes and scrapers"
        );
        assert_eq!(
            ports_of(&rules[1]),
            [
                (Some("UDP".to_owned()), ring_port),
                (
                    tcp(),
                    Some(IntOrString::Int(contract::DEFAULT_METRICS_PORT.into()))
                )
            ]
        );
    }

    #[test]
    fn the_worker_spec_digest_is_pinned_so_an_upgrade_rolls_no_ring() {
        // A change here rolls every running job when the operator is upgraded: make it only
        // with a serialisation that keeps the old digests (a new field absent when unset).
        // One process per worker (the default, or stated) keeps the digest of before
        // `processesPerWorker`: no running job rolls at the upgrade. Several processes per
        // worker is another layout (its workers could not share a ring with one-process ones).
        // Every job stored so far has `spec.ring.protection` written out, `integrity` unless
        // stated (the schema's default at its creation); `none`, the default since, is another
        // mode (a job read as `none` keeps its workers' mode: `plan::workers::kept_protection`).
        let stored = || {
            let mut j = basic();
            j.spec.ring.protection = crate::api::RingProtection::Integrity;
            j
        };
        let mut one = stored();
        one.spec.processes_per_worker = Some(1);
        assert_eq!(worker_spec_digest(&one), "0ddbddf00d140e95");
        assert_eq!(worker_spec_digest(&stored()), "0ddbddf00d140e95");
        assert_ne!(worker_spec_digest(&basic()), "0ddbddf00d140e95");
        let mut two = stored();
        two.spec.processes_per_worker = Some(2);
        assert_ne!(worker_spec_digest(&two), "0ddbddf00d140e95");
        let mut placed = basic();
        placed.spec.placement = Some(crate::api::Placement {
            node_selector: [("pool".to_owned(), "a".to_owned())].into(),
            ..Default::default()
        });
        assert_eq!(worker_spec_digest(&placed), worker_spec_digest(&basic()));
    }

    #[test]
    fn cpu_workers_get_no_gpu_limit_or_toleration() {
        let mut j = basic();
        j.spec.gpus_per_worker = 0;
        let spec = worker_pod(&j, 0, 0).unwrap().spec.unwrap();
        assert!(spec.containers[0].resources.is_none());
        assert!(spec.tolerations.is_none() && spec.node_selector.is_none());
    }

    #[test]
    fn replacements_avoid_lost_nodes_in_every_affinity_term() {
        let mut p = worker_pod(&basic(), 0, 1).unwrap();
        avoid_nodes(&mut p, &["n1".to_owned()].into());
        let a = serde_json::to_value(p.spec.unwrap().affinity).unwrap();
        let terms = &a["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"];
        assert_eq!(
            terms[0]["matchExpressions"][0],
            json!({"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n1"]})
        );
        let mut untouched = worker_pod(&basic(), 0, 0).unwrap();
        avoid_nodes(&mut untouched, &Default::default());
        assert!(untouched.spec.unwrap().affinity.is_none());
    }

    #[test]
    fn the_templates_service_account_is_kept_and_bound_to_the_worker_role() {
        let mut j = basic();
        j.spec.template.spec.as_mut().unwrap().service_account_name = Some("s3-reader".into());
        let p = worker_pod(&j, 0, 0).unwrap();
        assert_eq!(
            p.spec.unwrap().service_account_name.as_deref(),
            Some("s3-reader")
        );
        let names: Vec<String> = role_binding(&j)
            .subjects
            .unwrap()
            .into_iter()
            .map(|s| s.name)
            .collect();
        assert_eq!(names, ["train-worker", "s3-reader"]);
        let names: Vec<String> = role_binding(&basic())
            .subjects
            .unwrap()
            .into_iter()
            .map(|s| s.name)
            .collect();
        assert_eq!(
            names,
            ["train-worker"],
            "no template account: the job's own only"
        );
    }

    #[test]
    fn the_templates_affinity_and_the_placements_both_hold() {
        let term = |k: &str| json!({"matchExpressions": [{"key": k, "operator": "Exists"}]});
        let anti = json!({"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"a": "b"}}});
        let mut j = job(json!({"replicas": 1, "template": {"spec": {
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [term("zone-a"), term("zone-b")]}},
                "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [anti]}},
            "containers": [{"name": "w", "image": "i"}]}}}));
        j.spec.placement = Some(serde_json::from_value(json!({"affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term("a100")]}}}})).unwrap());
        let a = serde_json::to_value(worker_pod(&j, 0, 0).unwrap().spec.unwrap().affinity).unwrap();
        let keys: Vec<Vec<&str>> = a["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["matchExpressions"].as_array().unwrap().iter().map(|e| e["key"].as_str().unwrap()).collect())
            .collect();
        assert_eq!(
            keys,
            [["zone-a", "a100"], ["zone-b", "a100"]],
            "(a or b) and a100"
        );
        assert_eq!(
            a["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"],
            json!([anti])
        );
        assert_eq!(merge_affinity(None, None), None);
    }

    #[test]
    fn a_template_that_cannot_make_a_worker_is_an_error_naming_the_job_and_field() {
        let no_spec = job(json!({"replicas": 1, "template": {"metadata": {"labels": {"a": "b"}}}}));
        let err = worker_pod(&no_spec, 0, 0).unwrap_err();
        assert_eq!(err.to_string(), "job train: spec.template.spec is missing");
        let no_container = job(json!({"replicas": 1, "template": {"spec": {"containers": []}}}));
        let err = worker_pod(&no_container, 0, 0).unwrap_err();
        assert_eq!(
            err.to_string(),
            "job train: spec.template.spec.containers is empty"
        );
    }

    #[test]
    fn replacement_names_count_attempts() {
        assert_eq!(pod_name("j", 3, 0), "j-worker-3");
        assert_eq!(pod_name("j", 3, 2), "j-worker-3-2");
        assert_eq!(attempt_of("j", "j-worker-3-2"), 2);
        assert_eq!(attempt_of("j", "j-worker-3"), 0);
    }

    #[test]
    fn role_grants_only_this_jobs_objects() {
        let r = serde_json::to_value(role(&basic())).unwrap();
        assert_eq!(r["rules"][0]["resourceNames"], json!(["train-ring"]));
        assert_eq!(r["rules"][1]["resourceNames"], json!(["train-heartbeat"]));
        assert_eq!(r["rules"].as_array().unwrap().len(), 2);
    }

    /// The one table of static children: their order, how each is written, and the objects the
    /// typed builders make, unchanged as dynamic objects.
    #[test]
    fn the_static_children_are_one_table() {
        let job = basic();
        let names = |np| -> Vec<String> {
            children(&job, np, vec![7; 32])
                .iter()
                .map(|c| format!("{}/{}:{}", c.kind.name(), c.name(), c.once))
                .collect()
        };
        assert_eq!(
            names(false),
            [
                "ServiceAccount/train-worker:false",
                "Role/train-worker:false",
                "RoleBinding/train-worker:false",
                "Service/train:false",
                "Secret/train-key:true",
                "ConfigMap/train-heartbeat:true",
            ]
        );
        assert_eq!(names(true)[4], "NetworkPolicy/train:false");
        let all = children(&job, true, vec![7; 32]);
        assert!(
            all.iter()
                .all(|c| c.pinned_by_workers == (c.kind == Kind::Secret))
        );
        let dynamic = |k: Kind| {
            let c = all.iter().find(|c| c.kind == k).unwrap();
            (
                serde_json::to_value(&c.object).unwrap(),
                c.kind.resource().plural,
            )
        };
        let typed = serde_json::to_value(key_secret(&job, vec![7; 32])).unwrap();
        assert_eq!(dynamic(Kind::Secret), (typed, "secrets".into()));
        let typed = serde_json::to_value(network_policy(&job)).unwrap();
        assert_eq!(
            dynamic(Kind::NetworkPolicy),
            (typed, "networkpolicies".into())
        );
    }
}
