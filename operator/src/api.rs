//! The `DiphomaJob` API (`diphoma.io/v1alpha1`): spec, status, schema bounds and CEL rules.
//! Types only; no I/O. The CRD YAML under `crds/` is generated from here (`diphoma-operator crd`).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::PodTemplateSpec;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Field manager of every server-side apply the operator makes.
pub const FIELD_MANAGER: &str = "diphoma-operator";

/// Longest job name: the children's names and labels derive from it, and the longest of them
/// that must be a DNS label (≤ 63), a worker's hostname `<name>-worker-<index>` with an index
/// up to 4095, leaves 51 characters.
pub const MAX_NAME_LEN: usize = 51;

/// CEL rule on `metadata.name`: a DNS-1035 label (the job's Service takes its name) of at most
/// [`MAX_NAME_LEN`] characters.
pub(crate) const NAME_RULE: &str =
    "size(self.metadata.name) <= 51 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')";
const NAME_MESSAGE: &str = "metadata.name must be at most 51 characters of lower-case letters, digits and '-', starting with a letter and ending with a letter or digit: the job's Service, labels and worker hostnames (<name>-worker-<index>, at most 63) derive from it";
const GPU_MESSAGE: &str = "an nvidia.com/gpu limit or request on the worker container (spec.template.spec.containers[0]) must equal spec.gpusPerWorker: the operator sets it from there (leave it out)";

/// CEL rule: the worker container's `nvidia.com/gpu` `limits` or `requests` (`kind`), when the
/// template has one, equals `gpusPerWorker`.
fn gpu_rule(kind: &str) -> String {
    // An empty container list is refused by its own minItems; this rule must not fail on it.
    let c = "self.template.spec.containers[0]";
    format!(
        "size(self.template.spec.containers) == 0 || !has({c}.resources) || !has({c}.resources.{kind}) || !('nvidia.com/gpu' in {c}.resources.{kind}) || string({c}.resources.{kind}['nvidia.com/gpu']) == string(self.gpusPerWorker)"
    )
}

const PROTECTION_MESSAGE: &str = "spec.ring.protection is immutable: workers of different modes refuse each other (delete and re-create the job to change it)";
const MANAGED_BY_MESSAGE: &str = "spec.managedBy is immutable: it names the controller that runs the job, set at creation (delete and re-create the job to change it)";

/// The value of `spec.managedBy` that means this operator (as batch Job's
/// `kubernetes.io/job-controller`); an absent `managedBy` means it too.
pub const CONTROLLER_NAME: &str = "diphoma.io/operator";

/// CEL transition rule on the spec: the controller `managedBy` names does not change after
/// creation (batch Job's `spec.managedBy` is immutable the same way). An absent `managedBy` is
/// [`CONTROLLER_NAME`], so writing that default explicitly (as a GitOps tool may) is no change.
pub(crate) const MANAGED_BY_RULE: &str = "(has(self.managedBy) ? self.managedBy : 'diphoma.io/operator') == (has(oldSelf.managedBy) ? oldSelf.managedBy : 'diphoma.io/operator')";

const GANG_MESSAGE: &str = "spec.gang is immutable: the workers point at their gang from creation (delete and re-create the job to change it)";

/// The gang scheduler of `spec.gang` does not change after creation; an absent `spec.gang` (or
/// scheduler) is `None`, so writing that default explicitly is no change.
pub(crate) const GANG_RULE: &str = "(has(self.gang) && has(self.gang.scheduler) ? self.gang.scheduler : 'None') == (has(oldSelf.gang) && has(oldSelf.gang.scheduler) ? oldSelf.gang.scheduler : 'None')";

const RING_PORT_METRICS_MESSAGE: &str = "spec.ringPort and the rendezvous store's port after it (spec.ringPort + 1) must not be 9400, the workers' metrics port";
/// The processes' ports (`ringPort + 2·l`, `l < P`, P the effective `processesPerWorker`) end
/// below 65536 and do not reach the metrics port 9400 from below.
const PROCESS_PORTS_RULE: &str = "(has(self.ringPort) ? self.ringPort : 29500) + 2 * ((has(self.processesPerWorker) ? self.processesPerWorker : 1) - 1) <= 65535 && ((has(self.ringPort) ? self.ringPort : 29500) > 9400 || (has(self.ringPort) ? self.ringPort : 29500) + 2 * ((has(self.processesPerWorker) ? self.processesPerWorker : 1) - 1) < 9399)";
const PROCESS_PORTS_MESSAGE: &str = "spec.processesPerWorker: local rank l listens at spec.ringPort + 2*l, so spec.ringPort + 2*(processesPerWorker - 1) must be at most 65535 and the ports must not reach the metrics port 9400 (choose another spec.ringPort)";
/// The `nccl` data plane carries CUDA tensors: a job of CPU workers cannot run it.
const NCCL_RULE: &str = "!has(self.ring) || !has(self.ring.dataPlane) || self.ring.dataPlane != 'nccl' || (has(self.gpusPerWorker) && self.gpusPerWorker >= 1)";
const NCCL_MESSAGE: &str = "spec.ring.dataPlane nccl needs GPU workers (spec.gpusPerWorker at least 1): NCCL carries CUDA tensors (use ring or gloo for CPU workers)";
const RING_PORT_MESSAGE: &str = "spec.ringPort is immutable: the running workers listen on it (delete and re-create the job to change it)";

/// A distributed data-parallel training job: a ring of worker pods that the operator keeps alive,
/// re-forming the ring at a new generation whenever a worker is lost, added or removed.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[allow(clippy::duplicated_attributes)] // each printcolumn(...) repeats `type_ = …` by design
#[kube(
    group = "diphoma.io",
    version = "v1alpha1",
    kind = "DiphomaJob",
    namespaced,
    status = "DiphomaJobStatus",
    shortname = "dpj",
    category = "diphoma",
    doc = "A distributed data-parallel training job whose ring of workers survives failures and scaling",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn(
        name = "Phase",
        type_ = "string",
        json_path = ".status.phase",
        description = "Lifecycle phase"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.ready",
        description = "Ready workers / desired"
    ),
    printcolumn(
        name = "Gen",
        type_ = "integer",
        json_path = ".status.ring.generation",
        description = "Ring generation"
    ),
    printcolumn(
        name = "Step",
        type_ = "integer",
        json_path = ".status.progress.step",
        description = "Last committed training step"
    ),
    printcolumn(
        name = "Progress",
        type_ = "string",
        json_path = ".status.progress.percentage",
        description = "Share of totalSteps done"
    ),
    printcolumn(
        name = "ETA",
        type_ = "integer",
        json_path = ".status.progress.etaSeconds",
        description = "Seconds to the last step at the recent step rate"
    ),
    printcolumn(
        name = "Restarts",
        type_ = "integer",
        json_path = ".status.repairs.total",
        description = "Ring repairs so far"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[kube(validation = Rule::new(NAME_RULE).message(NAME_MESSAGE))]
#[x_kube(validation = Rule::new(gpu_rule("limits")).message(GPU_MESSAGE).field_path(".gpusPerWorker"))]
#[x_kube(validation = Rule::new(gpu_rule("requests")).message(GPU_MESSAGE).field_path(".gpusPerWorker"))]
#[x_kube(validation = Rule::new("!has(self.elastic) || (self.elastic.minReplicas <= self.replicas && self.replicas <= self.elastic.maxReplicas)")
    .message("spec.replicas must lie within [spec.elastic.minReplicas, spec.elastic.maxReplicas]").field_path(".replicas"))]
#[x_kube(validation = Rule::new(PROCESS_PORTS_RULE).message(PROCESS_PORTS_MESSAGE).field_path(".processesPerWorker"))]
#[x_kube(validation = Rule::new(MANAGED_BY_RULE).message(MANAGED_BY_MESSAGE).field_path(".managedBy"))]
#[x_kube(validation = Rule::new(GANG_RULE).message(GANG_MESSAGE).field_path(".gang"))]
#[x_kube(validation = Rule::new(NCCL_RULE).message(NCCL_MESSAGE).field_path(".ring.dataPlane"))]
#[serde(rename_all = "camelCase")]
pub struct DiphomaJobSpec {
    /// Desired number of workers in the ring (the `/scale` subresource points here).
    #[schemars(range(min = 1, max = 4096))]
    pub replicas: i32,
    /// Elastic bounds: training goes on while `minReplicas <= ready <= maxReplicas`. Absent: the
    /// job is fixed-size (min = max = replicas).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elastic: Option<Elastic>,
    /// `nvidia.com/gpu` limit of each worker container; 0 runs CPU workers, which get
    /// `NVIDIA_VISIBLE_DEVICES=void` (they see no GPU on a GPU node). Workers are scheduled by
    /// the resource alone: no node label is required (node selectors come from `placement`).
    /// A template `nvidia.com/gpu` limit or request that differs is refused. An edit while
    /// workers run replaces them all at once (see `template`).
    #[serde(default)]
    #[schemars(range(min = 0, max = 64))]
    pub gpus_per_worker: i32,
    /// Training processes in each worker pod, one per GPU as `torchrun --nproc-per-node` runs
    /// them (absent: 1, as torchrun's default; at least 1, at most 64: set it to
    /// `gpusPerWorker` for one process per GPU). The
    /// pod's launcher (`python -m diphoma.run`, told by `DIPHOMA_PROCESSES_PER_WORKER`) starts
    /// them with `LOCAL_RANK` `0..P`, `RANK` = pod rank × P + local rank and `WORLD_SIZE` =
    /// pods × P; each picks `cuda:LOCAL_RANK` itself (`CUDA_VISIBLE_DEVICES` is not set). The pod
    /// stays the ring's member and the unit of failure and repair: a process that fails takes
    /// its pod out and the pod is replaced. Local rank `l` listens at `ringPort + 2·l` (the
    /// store keeps `ringPort + 1`), so the ports `ringPort ..= ringPort + 2·(P − 1)` must stay
    /// clear of the metrics port 9400 and below 65536. With P > 1 each worker gets an
    /// in-memory `/dev/shm` (see `sharedMemory`), the default group's all-reduces go
    /// hierarchically (in the pod, then across pods on one ring per local rank, listening on
    /// ephemeral ports: the operator's NetworkPolicy then opens every TCP port of a worker to
    /// the job's own workers). A worker that is not started by that
    /// launcher (the Rust worker image, a script run by plain `python`) stays one process and
    /// one ring rank per pod. An edit while workers run replaces them all at once (see
    /// `template`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub processes_per_worker: Option<i32>,
    /// Size limit of the in-memory `/dev/shm` (`emptyDir`, `medium: Memory`, counted against the
    /// pod's memory) that workers running more than one process get, for the local processes'
    /// shared memory (data-loader workers, intra-pod exchanges). Absent: 2Gi per process. A
    /// template that mounts its own `/dev/shm` keeps it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_memory: Option<Quantity>,
    /// Where workers may run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,
    /// The worker pod template (image, args, resources, volumes). The operator adds the ring's
    /// environment, port, labels, GPU limits and the key volume; its `serviceAccountName` is
    /// kept (the workers' Role is bound to it too; unset: the job's `<name>-worker`), its
    /// affinity merged with `placement`'s, and the worker container's
    /// `terminationMessagePolicy` defaults to `FallbackToLogsOnError`. Its schema is Kubernetes'
    /// own `PodTemplateSpec`, so a misspelled or mistyped field is refused at apply, named
    /// (`kubectl apply`'s strict field validation). A ring
    /// never mixes specs: an edit of the pod spec here (or of `gpusPerWorker`, `checkpoint`,
    /// `ring`, `balance`, `sync` or `faultTolerance.detectionSeconds`) while workers
    /// run replaces every worker at once with one built from the new spec, and the new workers
    /// form a new ring generation that resumes from the last checkpoint (event and condition
    /// reason `SpecChanged`); labels and annotations reach only workers created later.
    #[schemars(schema_with = "crate::api::template_schema")]
    pub template: PodTemplateSpec,
    /// Failure budget, deadlines, clean-up and suspension.
    #[serde(default)]
    pub run_policy: RunPolicy,
    /// How failures are detected and which exits are retried.
    #[serde(default)]
    pub fault_tolerance: FaultTolerance,
    /// Where and how often rank 0 writes checkpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<Checkpoint>,
    /// TCP port of the ring on each worker's pod IP. Immutable: the running workers listen on
    /// it, and a replacement published on another port would split the ring. The next port
    /// carries torch's rendezvous store for torchrun scripts (`MASTER_PORT` under `python -m
    /// diphoma.run`).
    #[serde(default = "default_ring_port")]
    #[schemars(range(min = 1024, max = 65534))]
    #[x_kube(validation = Rule::new("self == oldSelf").message(RING_PORT_MESSAGE))]
    #[x_kube(validation = Rule::new("self != 9399 && self != 9400").message(RING_PORT_METRICS_MESSAGE))]
    pub ring_port: i32,
    /// The ring's data path.
    #[serde(default)]
    pub ring: RingSpec,
    /// How each step's global batch is split over the workers.
    #[serde(default)]
    pub balance: Balance,
    /// When the workers synchronise their models.
    #[serde(default)]
    pub sync: SyncSpec,
    /// The controller that runs this job. Absent or `diphoma.io/operator`: this operator; any
    /// other value (e.g. `kueue.x-k8s.io/multikueue`, whose MultiKueue runs the job on another
    /// cluster and mirrors its status here): this operator creates nothing for the job and
    /// never writes its status. Immutable, as batch Job's `spec.managedBy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub managed_by: Option<String>,
    /// Gang scheduling of the workers: bound all together or not at all, at least
    /// `elastic.minReplicas` of them (`replicas` when not elastic). Absent: scheduler `None`.
    /// Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang: Option<Gang>,
}

/// Gang scheduling of the workers (`spec.gang`).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Gang {
    /// Which gang scheduler places the workers. `None` (default): each worker is scheduled on
    /// its own, so a ring that only partly fits holds the GPUs of the workers that did.
    /// `Kubernetes`: the kube-scheduler's own gang scheduling (KEP-4671, alpha in Kubernetes
    /// 1.36: feature gates `GenericWorkload` and `GangScheduling` on the API server, the
    /// controller-manager and the scheduler, API `scheduling.k8s.io/v1alpha2` enabled): the
    /// operator creates a `scheduling.k8s.io/v1alpha2` `Workload` named after the job, with one
    /// pod group template `workers` whose gang policy's `minCount` is the ring's minimum, and a
    /// `PodGroup` of the same name made from it, which each worker names
    /// (`spec.schedulingGroup`); the scheduler then binds no worker until that many fit.
    /// `Coscheduling`: the scheduler-plugins coscheduling plugin (`sigs.k8s.io/scheduler-plugins`,
    /// tested with v0.34.7), run as a second scheduler (its PodGroup CRD
    /// `podgroups.scheduling.x-k8s.io` installed): the operator creates a
    /// `scheduling.x-k8s.io/v1alpha1` `PodGroup` named after the job whose `minMember` is the
    /// ring's minimum, labels each worker `scheduling.x-k8s.io/pod-group: <job>` and sets its
    /// `schedulerName` to that scheduler's (the operator's `--coscheduling-scheduler-name`,
    /// default `scheduler-plugins-scheduler`); the plugin holds the workers at Permit until that
    /// many have a node. Either way a job whose gang API the API server does not serve is held
    /// (`GangSchedulerUnavailable`), never placed worker by worker.
    #[serde(default)]
    pub scheduler: GangScheduler,
}

/// The gang scheduler of [`Gang`].
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GangScheduler {
    /// No gang scheduling.
    #[default]
    None,
    /// Kubernetes' own gang scheduling (`scheduling.k8s.io/v1alpha2` `Workload` and `PodGroup`).
    Kubernetes,
    /// The scheduler-plugins coscheduling plugin (`scheduling.x-k8s.io/v1alpha1` `PodGroup`),
    /// run as a second scheduler.
    Coscheduling,
}

/// The split of each step's global batch over the workers (`spec.balance`).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Balance {
    /// Split the global batch in proportion to the workers' measured speeds (each worker's
    /// smoothed compute time per sample; every worker at least one sample), so that a slower
    /// worker (an older GPU, a noisy neighbour) computes fewer samples instead of setting the
    /// pace of every step. The samples of each step stay the same, so with every-step
    /// synchronisation the model does not depend on the split. `false`: equal shares. Passed
    /// to the workers as `DIPHOMA_SPEED_WEIGHTED`; a PyTorch script's `ElasticSampler` splits
    /// by speed only with `reduction="sum"` (a mean loss keeps equal shares).
    #[serde(default = "default_true")]
    pub speed_weighted: bool,
    /// Steps between two re-splits (`DIPHOMA_BALANCE_EVERY`).
    #[serde(default = "default_balance_every")]
    #[schemars(range(min = 1, max = 100000))]
    pub every_steps: i32,
}

fn default_true() -> bool {
    true
}

fn default_balance_every() -> i32 {
    10
}

impl Default for Balance {
    fn default() -> Self {
        Balance {
            speed_weighted: true,
            every_steps: default_balance_every(),
        }
    }
}

/// When the workers synchronise their models (`spec.sync`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[x_kube(validation = Rule::new("self.mode == 'Periodic' || !has(self.everySteps)").message("spec.sync.everySteps applies to mode Periodic only").field_path(".everySteps"))]
#[x_kube(validation = Rule::new("self.mode != 'Periodic' || has(self.everySteps)").message("spec.sync.everySteps is required with mode Periodic").field_path(".everySteps"))]
#[serde(rename_all = "camelCase")]
pub struct SyncSpec {
    /// `EveryStep` (default): one gradient allreduce per step; the result does not depend on
    /// the number of workers. `Periodic` (local SGD): each worker takes `everySteps` steps on
    /// its own share of each batch, then the workers average their parameters and optimizer
    /// state (AdamW's moments), weighted by samples; `everySteps` times fewer collectives,
    /// for slow links, at the price of a result that depends on the period and on the split.
    /// A repair rolls back to the last average. Passed as `DIPHOMA_SYNC_EVERY`.
    #[serde(default)]
    pub mode: SyncMode,
    /// Steps between two averages (mode `Periodic` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100000))]
    pub every_steps: Option<i32>,
}

/// How often the workers synchronise.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SyncMode {
    /// A gradient allreduce every step.
    #[default]
    EveryStep,
    /// Local steps, then an average every `everySteps` steps.
    Periodic,
}

impl SyncSpec {
    /// Steps between two synchronisations: 1 for `EveryStep`, `everySteps` for `Periodic`
    /// (the value of `DIPHOMA_SYNC_EVERY`: 0 means every step, as the worker reads it).
    pub fn period(&self) -> i32 {
        match self.mode {
            SyncMode::EveryStep => 0,
            SyncMode::Periodic => self.every_steps.unwrap_or(1),
        }
    }
}

/// The ring's data path between workers.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RingSpec {
    /// How ring data frames (gradients, parameters) are protected after each connection's
    /// HMAC handshake (which always shuts out a process without the job's key): `none`
    /// (default) adds nothing, as gloo and NCCL; `integrity` tags every frame with a keyed MAC
    /// (BLAKE3, keys derived per connection with HKDF-SHA256) and a frame counter, so data
    /// tampered with on the network path, replayed or reordered is refused; `encryption` also
    /// encrypts it (AES-256-GCM). Turn one on where the network between nodes is shared and
    /// not protected by the CNI (docs/design/protection.md); each costs throughput where the
    /// CPU, not the link, is the limit. Passed to the workers as `DIPHOMA_RING_PROTECTION`.
    /// Immutable; a job stored before `none` became the default keeps the mode its running
    /// workers have.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self == oldSelf").message(PROTECTION_MESSAGE))]
    pub protection: RingProtection,
    /// What moves the collectives' bytes of a PyTorch job's default process group (the
    /// `diphoma` backend): `ring` (default), Diphoma's own ring; `gloo`, a gloo communicator
    /// created afresh at each ring generation from an address the ring distributes, under
    /// the ring's membership and failure detection (a dead or silent peer is blamed within
    /// `faultTolerance.detectionSeconds`, the old communicator abandoned, the survivors go on in
    /// the same process); `nccl`, the same with a NCCL communicator, for CUDA tensors (one
    /// process per GPU: `processesPerWorker` = `gpusPerWorker`; NCCL's `abort` ends a collective
    /// in flight). Passed to the workers as `DIPHOMA_DATA_PLANE`; the Rust worker always uses
    /// the ring. gloo's and NCCL's connections carry no frame protection, and listen on
    /// ephemeral ports: the operator's NetworkPolicy (`--network-policy`) then opens every TCP
    /// port of a worker to the job's own workers.
    #[serde(default, skip_serializing_if = "DataPlane::is_ring")]
    pub data_plane: DataPlane,
    /// The dtype a PyTorch job's float32 all-reduces (SUM, AVG: DDP's gradients) cross the wire
    /// in: `none` (default), float32; `bf16`, a bfloat16 copy (half the bytes; each hop adds in
    /// float32 and rounds to bfloat16 for the next; the result is cast back), what DDP's
    /// `bf16_compress_hook` does, for every all-reduce of the job's process groups. Passed to
    /// the workers as `DIPHOMA_COMPRESSION`; the Rust worker ignores it.
    #[serde(default, skip_serializing_if = "Compression::is_none")]
    pub compression: Compression,
}

/// The wire dtype of a PyTorch job's float32 all-reduces.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum Compression {
    /// float32 on the wire.
    #[default]
    None,
    /// bfloat16 on the wire.
    Bf16,
}

impl Compression {
    /// The value of `DIPHOMA_COMPRESSION` (`diphoma.torch._ops.compression` parses the same).
    pub fn as_str(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Bf16 => "bf16",
        }
    }

    /// Whether this is the default (left out of the serialised spec, so that the worker-spec
    /// digest of every job stored before the field is unchanged).
    pub fn is_none(&self) -> bool {
        *self == Compression::None
    }
}

/// The library that carries a PyTorch job's collectives.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum DataPlane {
    /// Diphoma's ring.
    #[default]
    Ring,
    /// A gloo communicator per ring generation.
    Gloo,
    /// A NCCL communicator per ring generation (CUDA tensors).
    Nccl,
}

impl DataPlane {
    /// The value of `DIPHOMA_DATA_PLANE` (`diphoma.torch._plane` parses the same names).
    pub fn as_str(self) -> &'static str {
        match self {
            DataPlane::Ring => "ring",
            DataPlane::Gloo => "gloo",
            DataPlane::Nccl => "nccl",
        }
    }

    fn is_ring(&self) -> bool {
        *self == DataPlane::Ring
    }
}

/// Protection of the ring's data frames.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum RingProtection {
    /// No per-frame tag, as gloo and NCCL (the handshake still authenticates each connection).
    #[default]
    None,
    /// A keyed MAC and a frame counter on every frame.
    Integrity,
    /// AES-256-GCM on every frame: integrity and confidentiality.
    Encryption,
}

impl RingProtection {
    /// The value of `DIPHOMA_RING_PROTECTION` (the ring parses the same names).
    pub fn as_str(self) -> &'static str {
        match self {
            RingProtection::None => "none",
            RingProtection::Integrity => "integrity",
            RingProtection::Encryption => "encryption",
        }
    }
}

fn default_ring_port() -> i32 {
    diphoma_contract::DEFAULT_RING_PORT.into()
}

/// Elastic bounds of the ring size.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("self.minReplicas <= self.maxReplicas").message("spec.elastic.minReplicas must not exceed spec.elastic.maxReplicas").field_path(".minReplicas"))]
#[serde(rename_all = "camelCase")]
pub struct Elastic {
    /// Fewest workers the ring trains with; below it the ring waits (gang semantics).
    #[schemars(range(min = 1, max = 4096))]
    pub min_replicas: i32,
    /// Most workers the ring may grow to.
    #[schemars(range(min = 1, max = 4096))]
    pub max_replicas: i32,
}

/// Node choice for the workers, merged into the pod template.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    /// Node labels the workers require, e.g. `nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Extra tolerations (a `nvidia.com/gpu` NoSchedule toleration is added for GPU workers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "crate::api::preserved_array")]
    pub tolerations: Vec<k8s_openapi::api::core::v1::Toleration>,
    /// Pod affinity rules, holding together with the template's own (its required node terms
    /// are ANDed with these, every other term list extended).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::api::preserved_object")]
    pub affinity: Option<k8s_openapi::api::core::v1::Affinity>,
}

/// What the job does on failures, deadlines and completion.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RunPolicy {
    /// Worker failures the job survives: its own failures (a process that exits, hangs, or whose
    /// pod someone deletes), counted on the job. Disruptions (evictions, preemptions, node loss:
    /// not the job's fault) count against `faultTolerance.disruptionLimit` instead, as batch
    /// Job's `podFailurePolicy` ignores `DisruptionTarget` failures; deletions the operator makes
    /// itself never count.
    #[serde(default = "default_backoff_limit")]
    #[schemars(range(min = 0, max = 10000))]
    pub backoff_limit: i32,
    /// Seconds after `status.startTime` (when its workers last started running: the creation or
    /// the latest resumption) after which a job that has not finished fails
    /// (`DeadlineExceeded`). Time suspended or queued does not count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub active_deadline_seconds: Option<i64>,
    /// Seconds after finishing after which the job (and what it owns) is deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub ttl_seconds_after_finished: Option<i64>,
    /// Which workers to delete when the job ends. While it runs, failed workers are replaced
    /// under new names and their pods kept for `kubectl logs`: every one with `None`, the most
    /// recent of each worker otherwise.
    #[serde(default)]
    pub clean_pod_policy: CleanPodPolicy,
    /// Delete the workers but keep the job and its status; resuming re-creates them. As batch
    /// Job's `suspend`: `activeDeadlineSeconds` does not run while the job is suspended (or
    /// waits in a Kueue queue), and `status.startTime` is cleared on suspension and set again
    /// when the workers run after the resumption.
    #[serde(default)]
    pub suspend: bool,
}

fn default_backoff_limit() -> i32 {
    6
}

impl Default for RunPolicy {
    fn default() -> Self {
        RunPolicy {
            backoff_limit: default_backoff_limit(),
            active_deadline_seconds: None,
            ttl_seconds_after_finished: None,
            clean_pod_policy: CleanPodPolicy::default(),
            suspend: false,
        }
    }
}

/// Which workers to delete once the job has finished.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CleanPodPolicy {
    /// Every worker pod.
    All,
    /// Workers still running or pending (finished ones stay for their logs).
    #[default]
    Running,
    /// None.
    None,
}

/// Failure detection and retry policy.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FaultTolerance {
    /// Seconds within which a silent worker (a hung process, the workers of a lost node) is
    /// blamed by its ring neighbours and declared dead. A node is also declared lost from its
    /// Lease once it has not been seen to change for longer than this and a whole renewal was
    /// missed.
    #[serde(default = "default_detection_seconds")]
    #[schemars(range(min = 1, max = 3600))]
    pub detection_seconds: i32,
    /// Exit codes that are retried (the worker is replaced). Absent: everything but 1–127 (as
    /// Kubeflow's `ExitCode` restart policy: 1–127 are permanent errors, 128+ are signals).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_on_exit_codes: Option<Vec<i32>>,
    /// Disruptions the job survives: workers lost to an eviction (the Eviction API, node
    /// pressure), a preemption or the loss of their node, i.e. pods the API server marks with a
    /// `DisruptionTarget` condition and workers of a lost node. Absent: disruptions are repaired
    /// without limit (they never count against `runPolicy.backoffLimit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 10000))]
    pub disruption_limit: Option<i32>,
}

fn default_detection_seconds() -> i32 {
    10
}

impl Default for FaultTolerance {
    fn default() -> Self {
        FaultTolerance {
            detection_seconds: default_detection_seconds(),
            restart_on_exit_codes: None,
            disruption_limit: None,
        }
    }
}

/// Checkpointing by rank 0. Checkpoints belong to the job that wrote them (its namespace, name
/// and uid, in their metadata and in their path in the volume,
/// `<namespace>/<name>/<uid>/`): a job resumes and prunes only its own, so jobs may share a
/// volume, and a job deleted and created again under the same name starts afresh unless it
/// resumes the old one explicitly (`resumeFrom`). A suspended and resumed job keeps its uid
/// and its checkpoints.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Checkpoint {
    /// Name of a volume of the pod template that holds the checkpoints.
    #[schemars(length(min = 1))]
    pub volume: String,
    /// Steps between two checkpoints.
    #[schemars(range(min = 1))]
    pub every_steps: i64,
    /// Start from another job's checkpoint: while this job has none of its own, it resumes the
    /// newest checkpoint (of any uid) of the job named here, in this namespace and on the same
    /// volume (seed, model and optimizer must match, as for its own). That job's checkpoints
    /// are only read, never pruned. Unset: only this job's own checkpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_from: Option<ResumeFrom>,
}

/// The job whose checkpoints a job starts from (`spec.checkpoint.resumeFrom`).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ResumeFrom {
    /// Name of the job, in this job's namespace (a DNS label: it names a directory of the
    /// volume).
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub name: String,
}

/// Observed state, derived from what the operator and the workers saw.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DiphomaJobStatus {
    /// Lifecycle phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// `Ready`, `Progressing`, `Suspended`, `Complete`, `Failed` (`metav1.Condition`). Each
    /// condition's reason says why it has its status: `Ready` and `Progressing` carry the phase's
    /// (`Pending`, `WorkersStarting`, `RingFormed`, `RingRepairing`, `RingScaling`, `Suspended`,
    /// `RingCompleted`, or the failure's: `NonRetryableExit`, `BackoffLimitExceeded`,
    /// `DeadlineExceeded`), or while too few workers are ready what keeps one from starting
    /// (`CreateRefused`, `Unschedulable`, `ErrImagePull`, …, `GangWaiting` for a gang none of
    /// whose workers is bound), or `InvalidSpec` for a job the
    /// operator cannot read; `Suspended`, `Complete` and `Failed` carry it when True, and
    /// otherwise `NotSuspended`, `NotCompleted` (`JobFailed` once the job failed), `NotFailed`.
    /// While the job runs, `Reporting` says whether the workers' reports reach the operator:
    /// `ReportsArriving` (True), `NoReportYet` (Unknown), `ReportingPathLost` (False: their
    /// heartbeat ConfigMap or RBAC is missing and being restored) or `ReportsStopped` (False:
    /// their heartbeat has not changed for `3 × detectionSeconds`, at least 30 s).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Worker pods that exist and run on (not finished, not being deleted), for `/scale`: an
    /// HPA compares it with `spec.replicas`.
    #[serde(default)]
    pub replicas: i32,
    /// Workers that are running and members of the ring.
    #[serde(default)]
    pub ready_replicas: i32,
    /// `ready/desired`, for the printer column.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<String>,
    /// Label selector of the workers (for `/scale` and HPA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// The ring's current generation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ring: Option<RingStatus>,
    /// Training progress as the workers report it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// Ring repairs (members lost and the ring re-formed), by cause.
    #[serde(default)]
    pub repairs: Counts,
    /// Training processes restarted in place inside their running pods by `python -m
    /// diphoma.run` (a torchrun script, at each new ring generation that lists its pod), summed
    /// over the pods, by cause: `MemberLost` (the new generation lacks a member the process
    /// had), `MemberJoined` (it only adds members), `RingFault` (the same members again after
    /// the ring failed under them). An elastic script (`diphoma.torch.elastic`) keeps its
    /// process and counts none.
    #[serde(default)]
    pub in_place_restarts: Counts,
    /// The job's own failures, counted against `backoffLimit`, by cause (`ProcessExit`,
    /// `PodDeleted`, `Hung`).
    #[serde(default)]
    pub failures: Counts,
    /// Disruptions, counted against `faultTolerance.disruptionLimit`, by cause (`Evicted`,
    /// `Preempted`, `NodeLost`).
    #[serde(default)]
    pub disruptions: Counts,
    /// The most recent worker failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<LastFailure>,
    /// Lost pods that `failures` or `disruptions` already count and that the operator has not
    /// yet seen marked as counted (the pod's `diphoma.io/failure-counted` annotation, written
    /// right after this status; for a member that vanished, a ring without it): never counted
    /// again, even by an operator stopped between the two writes, as batch Job's
    /// `uncountedTerminatedPods` keeps its counts exact. Usually empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub counted_pods: Vec<CountedPod>,
    /// Why the ring waits or runs short, naming the first worker that does not start and who
    /// says why: `2 of 4 workers ready; <pod>: <reason>: <message>`, the reason being
    /// `CreateRefused` (the API server's message, e.g. an exceeded quota), the scheduler's
    /// (`Unschedulable`) or the container's (`ErrImagePull`, …); a Warning event `WorkerBlocked`
    /// names each such worker when this changes. A gang-scheduled job (`spec.gang`) none of
    /// whose workers is bound yet says why its gang waits, with the `Ready` and `Progressing`
    /// conditions' reason `GangWaiting`: `gang of 3 waits: 2 of 3 workers can be placed, none is
    /// bound; <pod>: Unschedulable: <the scheduler's message>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
    /// When the job's workers were started: first set when the job runs (not while it is
    /// suspended or queued), cleared on suspension and set again on resumption, as batch Job's
    /// (RFC 3339). `activeDeadlineSeconds` counts from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<String>,
    /// When the job finished (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<String>,
    /// The spec generation this status reflects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Lifecycle phase of a job.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Accepted; no worker runs yet.
    Pending,
    /// Workers are starting; the first ring is not formed.
    Starting,
    /// The ring trains at its desired size.
    Running,
    /// A member was lost; its replacement is on the way.
    Repairing,
    /// The ring is being resized.
    Scaling,
    /// Workers deleted on request; status kept.
    Suspended,
    /// The ring reported completion.
    Succeeded,
    /// Failed for good.
    Failed,
}

impl Phase {
    /// Every phase, in lifecycle order (metric label values are initialized from it).
    pub const ALL: [Phase; 8] = [
        Phase::Pending,
        Phase::Starting,
        Phase::Running,
        Phase::Repairing,
        Phase::Scaling,
        Phase::Suspended,
        Phase::Succeeded,
        Phase::Failed,
    ];

    /// Whether the job has finished for good.
    pub fn is_terminal(self) -> bool {
        matches!(self, Phase::Succeeded | Phase::Failed)
    }
}

/// The ring's current generation.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RingStatus {
    /// Generation number (strictly increasing).
    pub generation: i64,
    /// Members (worker pods) in this generation.
    pub size: i32,
    /// Training processes in each member (`spec.processesPerWorker` in effect; absent: 1).
    // Like every status field added after the first release, written only when it says more
    // than its default: an operator whose CRD is still the previous one (an upgrade in
    // progress, `install.yaml` applied without its CRD) can then still write the status of the
    // jobs that do not use it, as the API server refuses a server-side apply with a field its
    // schema does not declare.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub processes_per_worker: i32,
    /// Ranks of the training processes' ring: `size × processesPerWorker` (absent with one
    /// process per member: then it is `size`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub world_size: i32,
    /// ConfigMap holding the full membership (rank → pod, address).
    pub config_map: String,
    /// Members of this generation that have left and were already accounted for (a counted
    /// failure or an operator deletion); cleared by the next generation.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub departed: Vec<String>,
    /// The members, rank by rank, when there are at most [`MAX_LISTED_MEMBERS`] (the ConfigMap
    /// always holds them all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<RingMember>,
}

/// Rings up to this size list their members in `status.ring.members`.
pub const MAX_LISTED_MEMBERS: usize = 16;

/// One ring member in the job's status.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RingMember {
    /// Rank in this generation.
    pub rank: i32,
    /// The worker pod.
    pub pod: String,
    /// The node it runs on, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

/// Training progress reported by the workers.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    /// Last committed step.
    pub step: i64,
    /// Steps to train in total.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_steps: Option<i64>,
    /// Training loss at `step`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    /// Samples per second over the whole ring.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples_per_second: Option<f64>,
    /// Step of the newest checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_checkpoint_step: Option<i64>,
    /// Accuracy of the trained model on the held-out test split, in [0, 1] (after the last step).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_accuracy: Option<f64>,
    /// Smallest share of the global batch that a worker computes (samples per step): with
    /// `spec.balance.speedWeighted` the slower workers compute fewer samples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_batch_share: Option<i64>,
    /// Largest share of the global batch that a worker computes (samples per step).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batch_share: Option<i64>,
    /// `step / totalSteps` as a whole percentage, e.g. `"42%"` (the `Progress` column).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percentage: Option<String>,
    /// Steps per second between the two latest reports that moved the step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps_per_second: Option<f64>,
    /// Seconds until `totalSteps` at [`Progress::steps_per_second`], rounded up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_seconds: Option<i64>,
    /// When the workers reported reaching `step` (RFC 3339, the reporting worker's clock).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_time: Option<String>,
}

/// A total with a breakdown by cause.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Counts {
    /// Sum over causes.
    pub total: i32,
    /// Per cause: `ProcessExit`, `PodDeleted`, `Evicted`, `Preempted`, `NodeLost`, `Hung`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub by_cause: BTreeMap<String, i32>,
    /// Seconds from the last loss to the ring re-formed without it (repairs only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seconds: Option<f64>,
}

impl Counts {
    /// Adds one occurrence of `cause`.
    pub fn add(&mut self, cause: &str) {
        self.total += 1;
        *self.by_cause.entry(cause.to_owned()).or_default() += 1;
    }
}

/// A lost pod counted in the status and not yet seen marked ([`DiphomaJobStatus::counted_pods`]).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CountedPod {
    /// Pod name.
    pub pod: String,
    /// Pod UID; none for a member that vanished from the API before it was counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// The cause it was counted under (`ProcessExit`, `Hung`, `NodeLost`, …).
    pub cause: String,
}

/// The most recent worker failure.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct LastFailure {
    /// Pod name.
    pub pod: String,
    /// Its rank in the ring generation it was lost from, if it was a member.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<i32>,
    /// Exit code, for process exits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Cause (`ProcessExit`, `NodeLost`, …).
    pub cause: String,
    /// Reason (`Error`, `OOMKilled`, `EvictionByEvictionAPI`, …).
    pub reason: String,
    /// What its container said as it ended: the termination message (with the operator's
    /// default `terminationMessagePolicy: FallbackToLogsOnError`, the last lines of its log on
    /// a failed exit: a Python rank's traceback), at most 2048 bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// When it happened: its container's finish time, else its deletion's request (not the
    /// graceful deletion's deadline), else when the operator observed it; never after the
    /// observation (RFC 3339).
    pub time: String,
}

/// Schema of an embedded Kubernetes object kept as is (validated by the API server when the
/// operator creates the pods).
pub fn preserved_object(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({"type": "object", "x-kubernetes-preserve-unknown-fields": true})
}

/// Schema of the worker pod template: Kubernetes' own `PodTemplateSpec` (k8s-openapi's
/// schema, as controller-gen CRDs embed it), so that a misspelled or misplaced field is refused
/// at apply with its path (`kubectl apply`'s strict field validation: `unknown field
/// "spec.template.spec.containers[0].imagePullPolcy"`) and a value of the wrong type too,
/// instead of being dropped. Its descriptions are left out (they would make the CRD too big for
/// `kubectl apply`'s last-applied annotation; `kubectl explain pod.spec` has them). A template
/// must have at least one container (the first is the worker), and may not name the
/// namespace's `default` service account.
pub fn template_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let mut template = generator.subschema_for::<PodTemplateSpec>().to_value();
    strip_descriptions(&mut template, false);
    let spec = &mut template["properties"]["spec"];
    spec["required"] = serde_json::json!(["containers"]);
    let containers = &mut spec["properties"]["containers"];
    containers["minItems"] = 1.into();
    containers["description"] = "At least one container; the first is the worker.".into();
    spec["properties"]["serviceAccountName"]["x-kubernetes-validations"] = serde_json::json!([{
        "rule": "self != 'default'",
        "message": "the workers' Role is bound to the template's serviceAccountName: name an account of the job's own, not the namespace's default (leave it unset for the job's <name>-worker)"
    }]);
    template["required"] = serde_json::json!(["spec"]);
    serde_json::from_value(template).expect("a valid schema")
}

/// Removes every schema's `description` under `v` (not a property that happens to be called
/// so: `in_properties` is true for the map of a `properties` keyword).
fn strip_descriptions(v: &mut serde_json::Value, in_properties: bool) {
    if let serde_json::Value::Object(map) = v {
        if !in_properties {
            map.remove("description");
        }
        for (k, child) in map.iter_mut() {
            strip_descriptions(child, !in_properties && k == "properties");
        }
    } else if let serde_json::Value::Array(items) = v {
        items.iter_mut().for_each(|i| strip_descriptions(i, false));
    }
}

/// Decodes a job as stored by the API server. Errors: the field that does not decode, as a path
/// (`spec.template.spec.hostNetwork: invalid type: …`), so that a job the operator cannot read
/// is reported on itself with the field named.
pub fn decode(object: serde_json::Value) -> Result<DiphomaJob, String> {
    serde_path_to_error::deserialize(object).map_err(|e| format!("{}: {}", e.path(), e.inner()))
}

/// Schema of an array of embedded Kubernetes objects kept as is.
pub fn preserved_array(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({"type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}})
}

fn is_one(n: &i32) -> bool {
    *n == 1
}

fn is_zero(n: &i32) -> bool {
    *n == 0
}

fn one() -> i32 {
    1
}

/// The in-memory `/dev/shm` of a worker running several processes: this much per process when
/// `spec.sharedMemory` is absent, in GiB.
pub const DEFAULT_SHARED_MEMORY_GIB_PER_PROCESS: i32 = 2;

impl DiphomaJobSpec {
    /// The training processes in each worker pod: `processesPerWorker`, else 1 (the API server
    /// keeps a set value within 1..=64). Not `gpusPerWorker` by default: the operator cannot
    /// tell whether the image starts one process per GPU (`python -m diphoma.run` does; the
    /// Rust worker and a plain `python` script run one), and the layout in the status and
    /// `kubectl diphoma ring` must be the one that runs.
    pub fn processes_per_worker(&self) -> i32 {
        self.processes_per_worker.unwrap_or(1)
    }

    /// The size limit of the workers' in-memory `/dev/shm` ([`Self::shared_memory`], else
    /// [`DEFAULT_SHARED_MEMORY_GIB_PER_PROCESS`] per process); `None` with one process (no
    /// volume is added).
    pub fn shm_size_limit(&self) -> Option<Quantity> {
        let p = self.processes_per_worker();
        (p > 1).then(|| {
            self.shared_memory.clone().unwrap_or_else(|| {
                Quantity(format!("{}Gi", p * DEFAULT_SHARED_MEMORY_GIB_PER_PROCESS))
            })
        })
    }

    /// Whether this operator runs the job (`spec.managedBy` absent or [`CONTROLLER_NAME`]).
    pub fn managed_here(&self) -> bool {
        self.managed_by
            .as_deref()
            .is_none_or(|m| m == CONTROLLER_NAME)
    }

    /// The gang scheduler that places the workers (`spec.gang.scheduler`, `None` when absent).
    pub fn gang_scheduler(&self) -> GangScheduler {
        self.gang
            .as_ref()
            .map_or(GangScheduler::None, |g| g.scheduler)
    }

    /// The ring's minimum size, at most `replicas`: `elastic.minReplicas`, or `replicas` for a
    /// fixed-size job (the gang's `minCount`, Kueue's podSet `minCount`).
    pub fn min_workers(&self) -> i32 {
        self.bounds().0.min(self.replicas)
    }

    /// `(min, max)` ring size: the elastic bounds, or `(replicas, replicas)`.
    pub fn bounds(&self) -> (i32, i32) {
        match &self.elastic {
            Some(e) => (e.min_replicas, e.max_replicas),
            None => (self.replicas, self.replicas),
        }
    }

    /// Whether a worker that exited with `code` is replaced rather than failing the job.
    pub fn retryable_exit(&self, code: i32) -> bool {
        match &self.fault_tolerance.restart_on_exit_codes {
            Some(codes) => codes.contains(&code),
            None => !(1..=127).contains(&code),
        }
    }
}
