//! The operator's view of the cluster, kept by watches: reflector stores of the jobs' children
//! (label `app.kubernetes.io/managed-by=diphoma-operator`; pods and ConfigMaps whole, the other
//! kinds metadata only, `managedFields` dropped from all), the memory of the node Leases in
//! `kube-node-lease` and of the Nodes' `Ready` condition (no object stored), and the
//! `resourceVersion` each watch has delivered ([`Seen`]), so that a reconcile can wait until the
//! stores hold its own writes.
//!
//! `observe` reads only from here: a reconcile makes no read request. The stores are eventually
//! consistent: after the operator writes an object, the store shows the old one until the watch
//! delivers the new. A reconcile therefore waits, after its writes, until each watch has passed
//! the `resourceVersion` the API server returned for them ([`Seen::caught_up`]); the next
//! reconcile of the job then plans from the state it wrote (no failure counted twice, no ring
//! generation published twice or from an older one). `resourceVersion`s are compared as integers
//! (etcd revisions, as the API server issues them; one that does not parse is not waited for).
//!
//! Node health (judged by the plan, [`crate::plan::nodes`]): each Lease event updates when this
//! operator saw its `renewTime` change ([`observe_lease`], the instant the event arrived). A
//! renewal triggers nothing; the jobs on a node are reconciled when its Lease appears or goes, a
//! clock skew is to be reported, or its Node's `Ready` condition flips. A missed renewal is found
//! by the job's own timer: each reconcile requeues for when its nodes would be judged lost
//! ([`crate::plan::nodes::next_check`]).

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, ContainerStatus, Node, Pod, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{ApiResource, DynamicObject, PartialObjectMeta};
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{self, ObjectRef, Store, store::Writer};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use crate::api::DiphomaJob;
use crate::build::{self, MANAGED_BY};
use crate::plan::NodeHealth;
use crate::plan::nodes::{LeaseSeen, observe_lease};

pub use crate::build::Kind;

/// The number of [`Kind`]s: one past the last variant.
const KINDS: usize = Kind::CoschedulingPodGroup as usize + 1;

/// The `resourceVersion` of an object as an integer (none: missing or not a number).
pub fn resource_version(meta: &ObjectMeta) -> Option<u64> {
    meta.resource_version.as_deref()?.parse().ok()
}

/// Per [`Kind`]: the highest `resourceVersion` its watch has delivered (after its store applied
/// it); and which watches have listed once ([`Listed`]).
pub struct Seen {
    versions: [watch::Sender<u64>; KINDS],
    listed: watch::Sender<u32>,
}

/// A watch that lists: a [`Kind`]'s, or the node Leases' or Nodes'.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listed {
    /// The watch of a [`Kind`].
    Kind(Kind),
    /// The node Leases.
    Leases,
    /// The Nodes.
    Nodes,
    /// Kueue's WorkloadPriorityClasses.
    PriorityClasses,
    /// Kueue's ResourceFlavors.
    Flavors,
}

impl Listed {
    fn bit(self) -> u32 {
        match self {
            Listed::Kind(k) => 1 << (k as u32),
            Listed::Leases => 1 << KINDS,
            Listed::Nodes => 1 << (KINDS + 1),
            Listed::PriorityClasses => 1 << (KINDS + 2),
            Listed::Flavors => 1 << (KINDS + 3),
        }
    }
}

impl Default for Seen {
    fn default() -> Self {
        Seen {
            versions: std::array::from_fn(|_| watch::Sender::new(0)),
            listed: watch::Sender::new(0),
        }
    }
}

impl Seen {
    /// Records that the watch `w` has listed once (its store holds a complete list).
    pub fn listed(&self, w: Listed) {
        self.listed.send_modify(|l| *l |= w.bit());
    }

    /// Whether every watch of `all` has listed once.
    fn has_listed(&self, all: &[Listed]) -> bool {
        let mask = all.iter().fold(0, |m, w| m | w.bit());
        *self.listed.borrow() & mask == mask
    }

    /// Resolves once every watch of `all` has listed once. (Not [`Store::wait_until_ready`]: its
    /// one-shot channel wakes only the last of several waiters, and reconciles wait together.)
    async fn all_listed(&self, all: &[Listed]) {
        let mask = all.iter().fold(0, |m, w| m | w.bit());
        let _ = self.listed.subscribe().wait_for(|l| l & mask == mask).await;
    }

    /// Records that the watch of `kind` delivered `meta`.
    pub fn note(&self, kind: Kind, meta: &ObjectMeta) {
        if let Some(rv) = resource_version(meta) {
            self.versions[kind as usize].send_if_modified(|m| {
                let newer = rv > *m;
                if newer {
                    *m = rv;
                }
                newer
            });
        }
    }

    /// Resolves once the watch of `kind` has delivered `resourceVersion` `rv` or a later one.
    pub async fn caught_up(&self, kind: Kind, rv: u64) {
        let mut rx = self.versions[kind as usize].subscribe();
        let _ = rx.wait_for(|m| *m >= rv).await;
    }
}

/// The writes of one reconcile: per [`Kind`], the highest `resourceVersion` the API server
/// returned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Written(pub BTreeMap<Kind, u64>);

impl Written {
    /// Records a write of `kind` that returned `meta`.
    pub fn note(&mut self, kind: Kind, meta: &ObjectMeta) {
        if let Some(rv) = resource_version(meta) {
            let e = self.0.entry(kind).or_default();
            *e = (*e).max(rv);
        }
    }

    /// Records a write of `kind` that returned `object` (none: nothing to wait for, e.g. a
    /// deletion done at once or a creation that found the object there).
    pub fn note_some<K: Resource>(&mut self, kind: Kind, object: Option<&K>) {
        if let Some(o) = object {
            self.note(kind, o.meta());
        }
    }
}

/// What this operator knows of one node.
#[derive(Debug, Clone, Default)]
pub struct NodeSeen {
    /// Its Lease, as seen change (none: no Lease, or one never renewed).
    pub lease: Option<LeaseSeen>,
    /// The Lease's `leaseDurationSeconds`.
    pub duration_s: Option<i32>,
    /// The Node's `Ready` condition is `True`.
    pub ready: bool,
    /// A clock skew measured at a Lease change and not yet reported by a plan.
    pub skew: Option<jiff::SignedDuration>,
}

/// The stores and memories `observe` reads (see the module doc).
pub struct Caches {
    /// Worker pods.
    pub pods: Store<Pod>,
    /// Ring and heartbeat ConfigMaps.
    pub configmaps: Store<ConfigMap>,
    /// Metadata of the static children of the other kinds ([`Kind::BY_METADATA`]: RBAC, Service,
    /// key Secret (its data never read), NetworkPolicy), a store per kind.
    pub metas: BTreeMap<Kind, Store<Meta>>,
    /// What the watches keep of Kueue (`kueue.x-k8s.io/v1beta2`): the Workloads this operator
    /// created, the WorkloadPriorityClasses, the ResourceFlavors (none: the API server does not
    /// serve them, or they are not watched: [`Caches::keep_kueue`]).
    pub kueue: Option<crate::queue::Stores>,
    /// Per node name: its Lease and readiness.
    pub nodes: Mutex<BTreeMap<String, NodeSeen>>,
    /// Set when the controller stops: the watches are no longer polled ([`Caches::close`]).
    closing: watch::Sender<bool>,
    /// What each watch has delivered.
    pub seen: Arc<Seen>,
}

/// The writers of [`Caches`]' stores, fed by [`Caches::watches`] (or by hand in tests).
pub struct Writers {
    /// See [`Caches::pods`].
    pub pods: Writer<Pod>,
    /// See [`Caches::configmaps`].
    pub configmaps: Writer<ConfigMap>,
    /// See [`Caches::metas`].
    pub metas: BTreeMap<Kind, Writer<Meta>>,
}

/// A boxed stream of one watched kind's objects, for `Controller::owns_stream`.
pub type Objects<K> = futures::stream::BoxStream<'static, Result<K, watcher::Error>>;

/// The metadata of a child kept by metadata only (its kind: the store that holds it).
pub type Meta = PartialObjectMeta<DynamicObject>;

/// The child watches of [`Caches::watches`], each feeding its store.
pub struct Streams {
    /// Pods.
    pub pods: Objects<Pod>,
    /// ConfigMaps.
    pub configmaps: Objects<ConfigMap>,
    /// The children kept by metadata, by kind, with their API resource.
    pub metas: Vec<(ApiResource, Objects<Meta>)>,
    /// The jobs to reconcile for node events.
    pub nodes: futures::stream::BoxStream<'static, ObjectRef<DeserializeGuard<DiphomaJob>>>,
}

impl Caches {
    /// Empty caches and their writers.
    pub fn new() -> (Caches, Writers) {
        let (pods, pods_w) = reflector::store();
        let (configmaps, configmaps_w) = reflector::store();
        let (metas, metas_w) = Kind::BY_METADATA
            .iter()
            .map(|&k| {
                let w = Writer::new(k.resource());
                ((k, w.as_reader()), (k, w))
            })
            .unzip();
        let caches = Caches {
            pods,
            configmaps,
            metas,
            kueue: None,
            nodes: Mutex::default(),
            closing: watch::Sender::new(false),
            seen: Arc::default(),
        };
        let writers = Writers {
            pods: pods_w,
            configmaps: configmaps_w,
            metas: metas_w,
        };
        (caches, writers)
    }

    /// Caches fed by nothing, every watch counted as listed: every store reads empty and
    /// [`Caches::ready`] resolves at once (a context without watches).
    pub fn unwatched() -> Caches {
        let (caches, _) = Caches::new();
        caches.all_listed();
        caches
    }

    /// The watches these caches need listed before a plan.
    fn needed() -> Vec<Listed> {
        let children = [Kind::Pod, Kind::ConfigMap]
            .iter()
            .chain(&Kind::BY_METADATA);
        let mut all: Vec<_> = children.map(|&k| Listed::Kind(k)).collect();
        all.extend([Listed::Leases, Listed::Nodes]);
        all
    }

    /// Kueue's stores once their watches have listed (none before, or when Kueue is not watched):
    /// a job is not planned from a Kueue store still empty, nor held up by a Kueue watch that
    /// cannot list (its place in Kueue is then read by requests, [`crate::queue::observe`]).
    pub fn kueue_listed(&self) -> Option<&crate::queue::Stores> {
        let all = [
            Listed::Kind(Kind::KueueWorkload),
            Listed::PriorityClasses,
            Listed::Flavors,
        ];
        self.kueue.as_ref().filter(|_| self.seen.has_listed(&all))
    }

    /// Keeps Kueue's objects too ([`Caches::kueue`]): the writers of their stores, for
    /// [`Caches::watch_kueue`] (Workloads, WorkloadPriorityClasses, ResourceFlavors).
    pub fn keep_kueue(&mut self) -> [Writer<DynamicObject>; 3] {
        use crate::queue::{Stores, flavors, priority_classes, workloads};
        let writers = [
            Writer::new(workloads()),
            Writer::new(priority_classes()),
            Writer::new(flavors()),
        ];
        self.kueue = Some(Stores {
            workloads: writers[0].as_reader(),
            priority_classes: writers[1].as_reader(),
            flavors: writers[2].as_reader(),
        });
        writers
    }

    /// The watches of Kueue's objects, feeding `writers`' stores ([`Caches::keep_kueue`]):
    /// the WorkloadPriorityClasses and ResourceFlavors (all of them) polled by tasks of their
    /// own; the Workloads this operator created (by label `app.kubernetes.io/managed-by`)
    /// returned, the objects touched, for `owns_stream_with`. `managedFields` dropped.
    pub fn watch_kueue(
        &self,
        client: &Client,
        writers: [Writer<DynamicObject>; 3],
    ) -> Objects<DynamicObject> {
        use crate::queue::{flavors, priority_classes, workloads};
        let [w, p, f] = writers;
        let watch = |ar, cfg: watcher::Config, writer, listed| {
            let api = Api::<DynamicObject>::all_with(client.clone(), &ar);
            let stream = watcher(api, cfg)
                .default_backoff()
                .modify(|o: &mut DynamicObject| o.metadata.managed_fields = None);
            let seen = self.seen.clone();
            reflector::reflector(writer, stream).inspect(move |ev| {
                if let Ok(watcher::Event::InitDone) = ev {
                    seen.listed(listed);
                }
            })
        };
        let all = watcher::Config::default;
        for stream in [
            watch(priority_classes(), all(), p, Listed::PriorityClasses).boxed(),
            watch(flavors(), all(), f, Listed::Flavors).boxed(),
        ] {
            tokio::spawn(stream.for_each(|_| async {}));
        }
        let api = Api::<DynamicObject>::all_with(client.clone(), &workloads());
        let events = watcher(api, owned());
        let kind = Kind::KueueWorkload;
        observed(events, w, self.seen.clone(), kind, keep)
            .touched_objects()
            .boxed()
    }

    /// Counts every watch as listed (caches filled by hand).
    pub fn all_listed(&self) {
        for w in Caches::needed() {
            self.seen.listed(w);
        }
    }

    /// Tells the waits ([`Caches::ready`], [`Caches::caught_up`]) that the watches are no longer
    /// polled (the controller stops): they return at once.
    pub fn close(&self) {
        self.closing.send_replace(true);
    }

    /// Resolves once the controller stops ([`Caches::close`]).
    async fn closed(&self) {
        let _ = self.closing.subscribe().wait_for(|c| *c).await;
    }

    /// True once every store and the node memory hold a first complete list: before that, a
    /// missing object may only be unlisted yet.
    /// False when the controller stops first: nothing may be planned from these caches then.
    pub async fn ready(&self) -> bool {
        tokio::select! {
            _ = self.listed() => true,
            _ = self.closed() => false,
        }
    }

    /// See [`Caches::ready`].
    async fn listed(&self) {
        self.seen.all_listed(&Caches::needed()).await;
    }

    /// Waits, at most `limit` in all, until every watch has delivered the writes `w`; the kinds
    /// it has not caught up with by then are returned (none when the controller stops first).
    /// Kinds whose watch has not listed (Kueue's Workloads read by requests meanwhile, see
    /// [`Caches::kueue_listed`]) are not waited for.
    pub async fn caught_up(&self, w: &Written, limit: Duration) -> Vec<Kind> {
        let deadline = tokio::time::Instant::now() + limit;
        let mut late = vec![];
        for (kind, rv) in &w.0 {
            if !self.seen.has_listed(&[Listed::Kind(*kind)]) {
                continue;
            }
            let wait = tokio::time::timeout_at(deadline, self.seen.caught_up(*kind, *rv));
            tokio::select! {
                done = wait => if done.is_err() {
                    late.push(*kind);
                },
                _ = self.closed() => break,
            }
        }
        late
    }

    /// The health of node `name` as this operator knows it at `at` (the default, lost, for a
    /// node never seen); a pending clock skew is handed over once.
    pub fn node_health(&self, name: &str, at: Instant) -> NodeHealth {
        let mut nodes = self.nodes.lock().expect("nodes lock");
        let Some(n) = nodes.get_mut(name) else {
            return NodeHealth::default();
        };
        NodeHealth {
            lease_age: n.lease.map(|l| l.age(at)),
            lease_duration_seconds: n.duration_s,
            ready: n.ready,
            clock_skew: n.skew.take(),
        }
    }

    /// The jobs with a pod on node `node` (by the pods' controller owner references).
    pub fn jobs_on(&self, node: &str) -> HashSet<ObjectRef<DeserializeGuard<DiphomaJob>>> {
        let pods = self
            .pods
            .state_filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node));
        pods.iter()
            .flat_map(|p| {
                let ns = p.namespace();
                p.owner_references()
                    .iter()
                    .filter(|o| o.kind == DiphomaJob::kind(&()))
                    .map(move |o| {
                        let r = ObjectRef::new(&o.name);
                        match &ns {
                            Some(ns) => r.within(ns),
                            None => r,
                        }
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Takes in one Lease event at monotonic `at` and wall time `wall`: returns the nodes whose
    /// jobs are to be reconciled (see the module doc).
    pub fn on_lease(
        &self,
        ev: &watcher::Event<Lease>,
        at: Instant,
        wall: jiff::Timestamp,
    ) -> Vec<String> {
        let mut nodes = self.nodes.lock().expect("nodes lock");
        match ev {
            watcher::Event::Apply(l) | watcher::Event::InitApply(l) => {
                let name = l.name_any();
                let spec = l.spec.as_ref();
                let renewed = spec.and_then(|s| s.renew_time.as_ref()).map(|t| t.0);
                let duration_s = spec.and_then(|s| s.lease_duration_seconds);
                let n = nodes.entry(name.clone()).or_default();
                n.duration_s = duration_s;
                let had = n.lease.is_some();
                match renewed {
                    Some(renewed) => {
                        let (seen, skew) =
                            observe_lease(n.lease.as_ref(), renewed, duration_s, at, wall);
                        n.lease = Some(seen);
                        if skew.is_some() {
                            n.skew = skew;
                        }
                        if !had || skew.is_some() {
                            return vec![name];
                        }
                    }
                    None => {
                        n.lease = None;
                        return vec![name];
                    }
                }
                vec![]
            }
            watcher::Event::Delete(l) => {
                let name = l.name_any();
                if let Some(n) = nodes.get_mut(&name) {
                    n.lease = None;
                }
                vec![name]
            }
            watcher::Event::InitDone => {
                self.seen.listed(Listed::Leases);
                vec![]
            }
            watcher::Event::Init => vec![],
        }
    }

    /// Takes in one Node event: returns the node when its `Ready` condition flipped or it went.
    pub fn on_node(&self, ev: &watcher::Event<Node>) -> Vec<String> {
        let mut nodes = self.nodes.lock().expect("nodes lock");
        match ev {
            watcher::Event::Apply(node) | watcher::Event::InitApply(node) => {
                let name = node.name_any();
                let ready = node
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .into_iter()
                    .flatten()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                let n = nodes.entry(name.clone()).or_default();
                let flipped = n.ready != ready;
                n.ready = ready;
                if flipped { vec![name] } else { vec![] }
            }
            watcher::Event::Delete(node) => {
                let name = node.name_any();
                if let Some(n) = nodes.get_mut(&name) {
                    n.ready = false;
                }
                vec![name]
            }
            watcher::Event::InitDone => {
                self.seen.listed(Listed::Nodes);
                vec![]
            }
            watcher::Event::Init => vec![],
        }
    }

    /// Starts nothing: builds the watches that feed these caches from `writers` (children by
    /// label `app.kubernetes.io/managed-by`, node Leases and Nodes); polled by the controller.
    pub fn watches(self: &Arc<Self>, client: &Client, writers: Writers) -> Streams {
        let owned = owned();
        let seen = &self.seen;
        let leases = watcher(
            Api::<Lease>::namespaced(client.clone(), "kube-node-lease"),
            watcher::Config::default(),
        )
        .default_backoff()
        .map({
            let caches = self.clone();
            move |ev| match ev {
                Ok(ev) => caches.on_lease(&ev, Instant::now(), jiff::Timestamp::now()),
                Err(e) => {
                    tracing::warn!(error = %e, "watch of the node Leases");
                    vec![]
                }
            }
        });
        let nodes = watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
            .default_backoff()
            .map({
                let caches = self.clone();
                move |ev| match ev {
                    Ok(ev) => caches.on_node(&ev),
                    Err(e) => {
                        tracing::warn!(error = %e, "watch of the Nodes");
                        vec![]
                    }
                }
            });
        let caches = self.clone();
        let node_jobs = futures::stream::select(leases, nodes)
            .flat_map(move |names| {
                let jobs: HashSet<_> = names.iter().flat_map(|n| caches.jobs_on(n)).collect();
                futures::stream::iter(jobs)
            })
            .boxed();
        let metas = writers.metas.into_iter().map(|(kind, writer)| {
            let ar = kind.resource();
            let api = Api::<Meta>::all_with(client.clone(), &ar); // metadata-only requests
            let stream = watcher(api, owned.clone());
            (ar, observed(stream, writer, seen.clone(), kind, keep))
        });
        Streams {
            pods: watch_kind(client, &owned, writers.pods, seen, Kind::Pod, prune_pod),
            configmaps: watch_kind(
                client,
                &owned,
                writers.configmaps,
                seen,
                Kind::ConfigMap,
                keep,
            ),
            metas: metas
                .map(|(ar, events)| (ar, events.touched_objects().boxed()))
                .collect(),
            nodes: node_jobs,
        }
    }

    /// Whether the job has worker pods of its own (by owner UID) in the store.
    pub fn has_workers(&self, job: &DiphomaJob) -> bool {
        let uid = job.uid().unwrap_or_default();
        let name = job.name_any();
        !self
            .pods
            .state_filter(|p| {
                p.labels().get(diphoma_contract::LABEL_JOB_NAME) == Some(&name)
                    && owned_by(&p.metadata, &uid)
            })
            .is_empty()
    }

    /// The metadata of the `kind` object `name` in `ns` as its store holds it (none: not there,
    /// or a kind not kept here).
    pub fn child_meta(&self, kind: Kind, ns: &str, name: &str) -> Option<ObjectMeta> {
        let key = |ar| ObjectRef::new_with(name, ar).within(ns);
        match kind {
            Kind::Pod => self
                .pods
                .get(&ObjectRef::new(name).within(ns))
                .map(|o| o.metadata.clone()),
            Kind::ConfigMap => self
                .configmaps
                .get(&ObjectRef::new(name).within(ns))
                .map(|o| o.metadata.clone()),
            kind => {
                let found = self.metas.get(&kind)?.get(&key(kind.resource()));
                found.map(|o| o.metadata.clone())
            }
        }
    }

    /// The children of the kinds kept by metadata that `job` owns (by UID, with its name's
    /// label) and `children` no longer lists (`Kind`, name): to be deleted. A NetworkPolicy
    /// left from when the operator made them, or a kind an older operator made.
    pub fn orphans(&self, job: &DiphomaJob, children: &[build::Child]) -> Vec<(Kind, String)> {
        let ns = job.namespace().unwrap_or_default();
        let uid = job.uid().unwrap_or_default();
        let name = job.name_any();
        let mut all = Vec::new();
        for (&kind, store) in &self.metas {
            for o in store.state() {
                let mine = o.metadata.namespace.as_deref() == Some(ns.as_str())
                    && o.labels().get(diphoma_contract::LABEL_JOB_NAME) == Some(&name)
                    && owned_by(&o.metadata, &uid);
                let listed = children
                    .iter()
                    .any(|c| c.kind == kind && c.name() == o.name_any());
                if mine && !listed {
                    all.push((kind, o.name_any()));
                }
            }
        }
        all.sort();
        all
    }

    /// The job's static `children` ([`build::children`]) missing from the stores or not its own
    /// (`Kind/name`).
    pub fn missing(&self, job: &DiphomaJob, children: &[build::Child]) -> Vec<String> {
        let ns = job.namespace().unwrap_or_default();
        let uid = job.uid().unwrap_or_default();
        children
            .iter()
            .filter(|c| {
                let meta = self.child_meta(c.kind, &ns, &c.name());
                !meta.is_some_and(|m| owned_by(&m, &uid))
            })
            .map(|c| format!("{}/{}", c.kind.name(), c.name()))
            .collect()
    }
}

/// The watch configuration of the objects this operator created: label
/// `app.kubernetes.io/managed-by=diphoma-operator` (children, Kueue and gang Workloads).
pub fn owned() -> watcher::Config {
    watcher::Config::default().labels(&format!("app.kubernetes.io/managed-by={MANAGED_BY}"))
}

/// Whether the API server serves resource `plural` of `group_version` (e.g.
/// `kueue.x-k8s.io/v1beta2` `workloads`: a CRD that may not be installed, or an alpha API behind
/// a feature gate): then the controller watches it.
pub async fn serves(client: &Client, group_version: &str, plural: &str) -> bool {
    client
        .list_api_group_resources(group_version)
        .await
        .is_ok_and(|l| l.resources.iter().any(|r| r.name == plural))
}

/// Whether `meta` names `uid` among its owners.
pub fn owned_by(meta: &ObjectMeta, uid: &str) -> bool {
    meta.owner_references.iter().flatten().any(|o| o.uid == uid)
}

/// What to do with a child that is created once (the key Secret, the heartbeat ConfigMap),
/// given the metadata of the object of its name, if any ([`adoption`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adoption {
    /// None exists: create it.
    Create,
    /// The job's own: leave it (the key must not change under running workers, the heartbeat's
    /// data belongs to them).
    Keep,
    /// Orphaned (no owner) and made by this operator for a job of this name (`kubectl delete
    /// --cascade=orphan`, then the same manifest applied again): take it over, replacing its
    /// content (a fresh key, an empty heartbeat: nothing its previous job wrote is trusted),
    /// conditional on this `resourceVersion`.
    TakeOver(String),
    /// Owned by another object (a deleted job's child the garbage collector has not removed
    /// yet), or not made by this operator: left alone; the job reports it missing.
    Foreign,
}

/// [`Adoption`] of a child of `job` whose name is held by `existing` (none: no object);
/// `in_use`: the job's own workers already run on it (a key Secret once the job has workers),
/// so it is never replaced under them, orphaned or not.
pub fn adoption(existing: Option<&ObjectMeta>, job: &DiphomaJob, in_use: bool) -> Adoption {
    let Some(meta) = existing else {
        return Adoption::Create;
    };
    let uid = job.uid().unwrap_or_default();
    if owned_by(meta, &uid) {
        return Adoption::Keep;
    }
    let labels = meta.labels.clone().unwrap_or_default();
    let ours = labels
        .get("app.kubernetes.io/managed-by")
        .map(String::as_str)
        == Some(MANAGED_BY)
        && labels.get(diphoma_contract::LABEL_JOB_NAME) == Some(&job.name_any());
    let orphan = meta.owner_references.as_ref().is_none_or(Vec::is_empty);
    match (ours && orphan && !in_use, &meta.resource_version) {
        (true, Some(rv)) => Adoption::TakeOver(rv.clone()),
        _ => Adoption::Foreign,
    }
}

/// What the operator never reads of a worker pod, dropped before the pod store keeps it (the store
/// holds every worker pod: at 1,000 jobs, 4,000 of them, issue 14). The plan and the node → jobs
/// map read a pod's metadata (labels, annotations, owners, deletion), its `spec.nodeName`, and of
/// its status the phase, reason, message, conditions, pod IP, nominated node (a gang's worker held
/// at the scheduler's Permit stage: `plan::gang::waiting`) and the container statuses' name,
/// readiness, restarts and states; the rest (containers with their env, volumes, tolerations,
/// the statuses' images and IDs, host and pod IP lists, QoS class, ...) is dropped.
pub fn prune_pod(pod: &mut Pod) {
    if let Some(spec) = pod.spec.as_mut() {
        *spec = PodSpec {
            node_name: spec.node_name.take(),
            ..PodSpec::default()
        };
    }
    if let Some(st) = pod.status.as_mut() {
        let containers = |list: Option<Vec<ContainerStatus>>| {
            list.map(|l| {
                l.into_iter()
                    .map(|c| ContainerStatus {
                        name: c.name,
                        ready: c.ready,
                        restart_count: c.restart_count,
                        started: c.started,
                        state: c.state,
                        last_state: c.last_state,
                        ..ContainerStatus::default()
                    })
                    .collect()
            })
        };
        *st = PodStatus {
            phase: st.phase.take(),
            reason: st.reason.take(),
            message: st.message.take(),
            conditions: st.conditions.take(),
            pod_ip: st.pod_ip.take(),
            nominated_node_name: st.nominated_node_name.take(),
            container_statuses: containers(st.container_statuses.take()),
            init_container_statuses: containers(st.init_container_statuses.take()),
            ..PodStatus::default()
        };
    }
}

/// Keeps the whole object (what [`watch_kind`] keeps of kinds other than pods).
fn keep<K>(_: &mut K) {}

/// A kind of object the operator watches into a store of its own ([`watch_kind`]).
pub trait Watched:
    Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static
{
}

impl<K> Watched for K where
    K: Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static
{
}

/// A store of the `K` objects this operator created ([`owned`]), whole, and the watch that feeds
/// it, noting in `seen` (as `kind`) what it delivered; the objects touched, for `owns_stream`.
pub fn watch_owned<K>(client: &Client, seen: &Arc<Seen>, kind: Kind) -> (Store<K>, Objects<K>)
where
    K: Watched,
{
    let (store, writer) = reflector::store();
    let events = watch_kind(client, &owned(), writer, seen, kind, keep);
    (store, events)
}

/// A watch of the `K` objects matching `cfg` (their `managedFields` dropped, then `prune`d),
/// feeding `writer`'s store and noting in `seen` what it delivered; the objects touched, for
/// `owns_stream`.
fn watch_kind<K>(
    client: &Client,
    cfg: &watcher::Config,
    writer: Writer<K>,
    seen: &Arc<Seen>,
    kind: Kind,
    prune: fn(&mut K),
) -> Objects<K>
where
    K: Watched,
{
    let seen = seen.clone();
    observed(
        watcher(Api::<K>::all(client.clone()), cfg.clone()),
        writer,
        seen,
        kind,
        prune,
    )
    .touched_objects()
    .boxed()
}

/// `events` (of a watch) with back-off, `managedFields` dropped and the rest `prune`d (e.g.
/// [`prune_pod`]) before the store keeps it, feeding `writer`, and noting in `seen` (as `kind`)
/// each object once its store holds it.
pub fn observed<K>(
    events: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    writer: Writer<K>,
    seen: Arc<Seen>,
    kind: Kind,
    prune: fn(&mut K),
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static
where
    K: Resource + Clone + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Send + Sync,
{
    let stream = events.default_backoff().modify(move |o: &mut K| {
        o.meta_mut().managed_fields = None;
        prune(o);
    });
    reflector::reflector(writer, stream).inspect(move |ev| match ev {
        Ok(watcher::Event::Apply(o) | watcher::Event::Delete(o) | watcher::Event::InitApply(o)) => {
            seen.note(kind, o.meta())
        }
        Ok(watcher::Event::InitDone) => seen.listed(Listed::Kind(kind)),
        _ => {}
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use watcher::Event as Ev;

    fn lease(node: &str, renewed: jiff::Timestamp) -> Lease {
        serde_json::from_value(
            json!({"metadata": {"name": node, "namespace": "kube-node-lease"},
            "spec": {"renewTime": renewed.to_string(), "leaseDurationSeconds": 8}}),
        )
        .unwrap()
    }

    fn node(name: &str, ready: &str) -> Node {
        serde_json::from_value(json!({"metadata": {"name": name},
            "status": {"conditions": [{"type": "Ready", "status": ready}]}}))
        .unwrap()
    }

    /// A Lease's renewals trigger nothing (the job's own timer finds a missed one); its first
    /// sight, its loss and a Node's readiness flipping reconcile the jobs on that node, which are
    /// found from the pods' owners.
    #[test]
    fn node_events_reconcile_the_jobs_on_the_node_only_when_its_health_can_change() {
        let (caches, mut w) = Caches::new();
        let t0 = jiff::Timestamp::now();
        let at = Instant::now();
        let s = |d: i64| t0 + jiff::SignedDuration::from_secs(d);
        assert_eq!(
            caches.on_lease(&Ev::Apply(lease("n0", s(0))), at, s(0)),
            ["n0"]
        );
        let renewed = caches.on_lease(&Ev::Apply(lease("n0", s(2))), at, s(2));
        assert!(renewed.is_empty(), "a renewal reconciles nothing");
        let health = caches.node_health("n0", at + Duration::from_secs(1));
        assert_eq!(health.lease_age, Some(Duration::from_secs(1)));
        assert!(!health.ready);
        assert_eq!(caches.on_node(&Ev::Apply(node("n0", "True"))), ["n0"]);
        assert!(caches.on_node(&Ev::Apply(node("n0", "True"))).is_empty());
        assert_eq!(caches.on_node(&Ev::Apply(node("n0", "False"))), ["n0"]);
        assert_eq!(
            caches.on_lease(&Ev::Delete(lease("n0", s(2))), at, s(3)),
            ["n0"]
        );
        assert_eq!(caches.node_health("n0", at).lease_age, None);
        // A renewTime 30 s behind the operator's clock is a skew, handed to one plan once.
        assert_eq!(
            caches.on_lease(&Ev::Apply(lease("n1", s(0))), at, s(0)),
            ["n1"]
        );
        assert_eq!(
            caches.on_lease(&Ev::Apply(lease("n1", s(-28))), at, s(2)),
            ["n1"]
        );
        assert!(caches.node_health("n1", at).clock_skew.is_some());
        assert!(caches.node_health("n1", at).clock_skew.is_none());
        // The jobs on a node, by their pods' owners.
        let pod: Pod = serde_json::from_value(json!({"metadata": {"name": "train-worker-0",
            "namespace": "ml", "ownerReferences": [{"apiVersion": "diphoma.io/v1alpha1",
            "kind": "DiphomaJob", "name": "train", "uid": "u"}]}, "spec": {"nodeName": "n0",
            "containers": []}}))
        .unwrap();
        w.pods.apply_watcher_event(&Ev::Apply(pod));
        let jobs: Vec<_> = caches.jobs_on("n0").into_iter().collect();
        assert_eq!(jobs, [ObjectRef::new("train").within("ml")]);
        assert!(caches.jobs_on("n1").is_empty());
    }

    #[tokio::test]
    async fn a_reconcile_waits_until_the_watches_delivered_its_writes() {
        let caches = Caches::unwatched();
        let meta = |rv: &str| ObjectMeta {
            resource_version: Some(rv.into()),
            ..Default::default()
        };
        let mut w = Written::default();
        w.note(Kind::Pod, &meta("7"));
        w.note(Kind::Pod, &meta("5"));
        w.note(Kind::ConfigMap, &meta("not a number"));
        assert_eq!(w.0, BTreeMap::from([(Kind::Pod, 7)]));
        let limit = Duration::from_millis(50);
        assert_eq!(caches.caught_up(&w, limit).await, [Kind::Pod]);
        caches.seen.note(Kind::Pod, &meta("6"));
        assert_eq!(caches.caught_up(&w, limit).await, [Kind::Pod]);
        caches.seen.note(Kind::Pod, &meta("9"));
        assert!(caches.caught_up(&w, limit).await.is_empty());
    }

    /// The pod store keeps what the plan reads and drops the rest: a worker pod as the API server
    /// returns it (env, volumes, tolerations, images) shrinks, and the plan sees it the same
    /// (ready member, node, labels, annotations, the container's exit).
    #[test]
    fn pruned_pods_keep_what_the_plan_reads() {
        let mut pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "train-worker-0", "namespace": "ns",
                "labels": {"diphoma.io/rank": "0"},
                "annotations": {"diphoma.io/failure-counted": "ProcessExit"}},
            "spec": {"nodeName": "n0", "containers": [{"name": "worker", "image": "probe:1",
                "env": [{"name": "DIPHOMA_JOB", "value": "train"}],
                "volumeMounts": [{"name": "key", "mountPath": "/key"}]}],
                "volumes": [{"name": "key", "secret": {"secretName": "train-key"}}],
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
            "status": {"phase": "Running", "podIP": "127.0.1.2", "hostIP": "127.0.0.1",
                "nominatedNodeName": "n0",
                "podIPs": [{"ip": "127.0.1.2"}], "qosClass": "Guaranteed",
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{"name": "worker", "ready": true, "restartCount": 0,
                    "image": "probe:1", "imageID": "sha256:abc", "containerID": "kwok://1",
                    "lastState": {"terminated": {"exitCode": 137, "reason": "Error"}},
                    "state": {"running": {"startedAt": "2026-12-01T00:00:00Z"}}}]}
        }))
        .unwrap();
        let before = serde_json::to_string(&pod).unwrap().len();
        let was_ready = crate::plan::workers::ready_member(&pod);
        prune_pod(&mut pod);
        let after = serde_json::to_string(&pod).unwrap().len();
        assert!(after < before, "{after} >= {before}");
        assert!(was_ready && crate::plan::workers::ready_member(&pod));
        assert_eq!(pod.spec.as_ref().unwrap().node_name.as_deref(), Some("n0"));
        assert_eq!(
            pod.labels().get("diphoma.io/rank").map(String::as_str),
            Some("0")
        );
        assert_eq!(pod.annotations().len(), 1);
        let spec = pod.spec.as_ref().unwrap();
        assert!(spec.containers.is_empty() && spec.volumes.is_none() && spec.tolerations.is_none());
        let st = pod.status.as_ref().unwrap();
        assert!(st.pod_ips.is_none() && st.host_ip.is_none() && st.qos_class.is_none());
        assert_eq!(st.nominated_node_name.as_deref(), Some("n0"));
        let c = &st.container_statuses.as_ref().unwrap()[0];
        assert!(c.image.is_empty() && c.container_id.is_none());
        let exit = c.last_state.as_ref().and_then(|s| s.terminated.as_ref());
        assert_eq!(exit.map(|t| t.exit_code), Some(137));
    }
}
