//! Reconciles against a mocked API server (tower-test), with caches filled by hand as the
//! watches would fill them: which requests one reconcile makes, in which order. A steady job
//! must make no request at all; a lost worker is counted in the status before its pod is touched.

use std::sync::{Arc, Mutex};

use http::{Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{Value, json};

use super::*;
use crate::build::tests::basic;

/// (method, path) of every request the reconcile made.
type Log = Arc<Mutex<Vec<(String, String)>>>;

/// A mocked API server answering GETs from `objects` (path → JSON, 404 otherwise) and every write
/// with its own body echoed back.
fn mock(objects: Vec<(String, Value)>) -> (Client, Log) {
    mock_refusing(objects, None)
}

/// [`mock`], refusing (403, as a ResourceQuota does) every server-side apply to a path that
/// starts with `refuse`.
fn mock_refusing(objects: Vec<(String, Value)>, refuse: Option<&'static str>) -> (Client, Log) {
    let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let log: Log = Arc::default();
    let seen = log.clone();
    tokio::spawn(async move {
        while let Some((req, send)) = handle.next_request().await {
            let (method, path) = (req.method().to_string(), req.uri().path().to_owned());
            seen.lock().unwrap().push((method.clone(), path.clone()));
            let apply = req
                .headers()
                .get(http::header::CONTENT_TYPE)
                .is_some_and(|c| c.as_bytes().starts_with(b"application/apply-patch"));
            let refused = apply && refuse.is_some_and(|r| path.starts_with(r));
            let body = req.into_body().collect_bytes().await.unwrap_or_default();
            let found = objects
                .iter()
                .find(|(p, _)| *p == path)
                .map(|(_, v)| v.clone());
            let parent = path
                .strip_suffix("/status")
                .and_then(|p| objects.iter().find(|(o, _)| o == p))
                .map(|(_, v)| v.clone());
            let (status, reply) = match (method.as_str(), found) {
                _ if refused => (
                    StatusCode::FORBIDDEN,
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403, "message": "exceeded quota"}),
                ),
                ("GET", Some(v)) => (StatusCode::OK, v),
                ("PATCH", None) if parent.is_some() => (StatusCode::OK, parent.unwrap()),
                ("GET", None) => (
                    StatusCode::NOT_FOUND,
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"}),
                ),
                _ => {
                    let mut v: Value = serde_json::from_slice(&body).unwrap_or(json!({}));
                    if v.get("metadata").is_none() {
                        v["metadata"] = json!({"name": "x", "namespace": "ml"});
                    }
                    (StatusCode::OK, v)
                }
            };
            let resp = Response::builder()
                .status(status)
                .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                .unwrap();
            send.send_response(resp);
        }
    });
    (Client::new(svc, "ml"), log)
}

fn worker(job: &DiphomaJob, i: i32, phase: &str, exit: Option<i32>) -> Value {
    let mut p = serde_json::to_value(build::worker_pod(job, i, 0).unwrap()).unwrap();
    p["spec"]["nodeName"] = json!("n0");
    p["metadata"]["uid"] = json!(format!("uid-worker-{i}")); // as the API server sets one
    if exit.is_none() {
        // As the operator labelled it in generation 1 of [`world`].
        p["metadata"]["labels"][contract::LABEL_RANK] = json!(i.to_string());
        p["metadata"]["labels"][contract::LABEL_GENERATION] = json!("1");
    }
    p["status"] = match exit {
        None => json!({"phase": phase, "podIP": format!("127.0.0.{}", i + 2),
            "conditions": [{"type": "Ready", "status": "True"}]}),
        Some(code) => {
            json!({"phase": "Failed", "containerStatuses": [{"name": "w", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": code, "reason": "Error"}}}]})
        }
    };
    p
}

fn world(job: &DiphomaJob, pods: Vec<Value>) -> Vec<(String, Value)> {
    let ring = Membership {
        generation: 1,
        job_uid: "uid-1".into(),
        members: (0..4)
            .map(|i| contract::Member {
                rank: i as u32,
                pod: build::pod_name("train", i, 0),
                address: format!("127.0.0.{}", i + 2).parse().unwrap(),
                port: 29500,
            })
            .collect(),
    };
    let now = jiff::Timestamp::now().to_string();
    vec![
        (
            "/api/v1/namespaces/ml/pods".into(),
            json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": pods}),
        ),
        (
            "/api/v1/namespaces/ml/configmaps/train-ring".into(),
            serde_json::to_value(build::ring_configmap(job, &ring)).unwrap(),
        ),
        (
            "/api/v1/namespaces/ml/configmaps/train-heartbeat".into(),
            serde_json::to_value(build::heartbeat_configmap(job)).unwrap(),
        ),
        (
            "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/n0".into(),
            json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "n0"}, "spec": {"renewTime": now}}),
        ),
        (
            "/api/v1/nodes/n0".into(),
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n0"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}),
        ),
    ]
}

/// Caches holding `objects` (the pods of a pod list, ConfigMaps, node Leases and Nodes) and all
/// of `job`'s metadata-only children, each store listed, as the watches leave them.
fn caches(job: &DiphomaJob, objects: &[(String, Value)]) -> Arc<Caches> {
    caches_built(job, objects, false)
}

/// [`caches`], the children as an operator that made NetworkPolicies (`network_policy`) left them.
fn caches_built(
    job: &DiphomaJob,
    objects: &[(String, Value)],
    network_policy: bool,
) -> Arc<Caches> {
    use kube::core::PartialObjectMetaExt;
    use kube::runtime::watcher::Event as Ev;
    let (caches, mut w) = Caches::new();
    let at = std::time::Instant::now();
    w.pods.apply_watcher_event(&Ev::Init);
    w.configmaps.apply_watcher_event(&Ev::Init);
    for (path, v) in objects {
        if path.ends_with("/pods") {
            for p in v["items"].as_array().unwrap() {
                w.pods.apply_watcher_event(&Ev::InitApply(
                    serde_json::from_value(p.clone()).unwrap(),
                ));
            }
        } else if path.contains("/configmaps/") {
            w.configmaps
                .apply_watcher_event(&Ev::InitApply(serde_json::from_value(v.clone()).unwrap()));
        } else if path.contains("/leases/") {
            let lease = serde_json::from_value(v.clone()).unwrap();
            caches.on_lease(&Ev::InitApply(lease), at, jiff::Timestamp::now());
        } else if path.starts_with("/api/v1/nodes/") {
            caches.on_node(&Ev::InitApply(serde_json::from_value(v.clone()).unwrap()));
        }
    }
    w.pods.apply_watcher_event(&Ev::InitDone);
    w.configmaps.apply_watcher_event(&Ev::InitDone);
    let children = build::children(job, network_policy, vec![0; 32]);
    for (kind, w) in &mut w.metas {
        w.apply_watcher_event(&Ev::Init);
        for c in children.iter().filter(|c| c.kind == *kind) {
            let meta = c.object.metadata.clone().into_response_partial();
            w.apply_watcher_event(&Ev::InitApply(meta));
        }
        w.apply_watcher_event(&Ev::InitDone);
    }
    caches.all_listed();
    Arc::new(caches)
}

/// A context on `client` whose caches hold `objects` ([`caches`]).
fn context(client: Client, job: &DiphomaJob, objects: &[(String, Value)]) -> Arc<Context> {
    Arc::new(Context {
        caches: caches(job, objects),
        ..Context::new(client, Metrics::default())
    })
}

/// The job as the operator left it after the previous reconcile of `objects`.
fn settled(job: DiphomaJob, objects: &[(String, Value)]) -> DiphomaJob {
    let children = build::children(&job, false, vec![]);
    let obs = observe(&caches(&job, objects), &job, &children).unwrap();
    let mut j = job;
    j.status = Some(plan::plan(&j, &obs, &Memory::default()).0.status);
    j
}

#[tokio::test]
async fn a_steady_job_makes_no_request() {
    let job = basic();
    let objects = world(
        &job,
        (0..4).map(|i| worker(&job, i, "Running", None)).collect(),
    );
    let job = settled(job, &objects);
    let (client, log) = mock(objects.clone());
    let ctx = context(client, &job, &objects);
    let action = reconcile(Arc::new(DeserializeGuard(Ok(job))), ctx)
        .await
        .unwrap();
    let log = log.lock().unwrap().clone();
    assert!(log.is_empty(), "a steady job made requests: {log:?}");
    // Looked at again when its node would be lost without a renewal (a 40 s Lease: after two
    // missed 10 s renewals), not polled every detectionSeconds / 3 as before.
    assert!(
        ["Some(20.", "Some(19."]
            .iter()
            .any(|d| format!("{action:?}").contains(d)),
        "requeued when the node would be lost: {action:?}"
    );
}

/// The NetworkPolicy an operator with `networkPolicy.enabled` made is pruned once the operator
/// no longer makes them, and only then; nothing else is touched.
#[tokio::test]
async fn a_child_no_longer_built_is_pruned() {
    let job = basic();
    let objects = world(
        &job,
        (0..4).map(|i| worker(&job, i, "Running", None)).collect(),
    );
    let job = settled(job, &objects);
    for network_policy in [true, false] {
        let (client, log) = mock(objects.clone());
        let ctx = Arc::new(Context {
            caches: caches_built(&job, &objects, true),
            network_policy,
            ..Context::new(client, Metrics::default())
        });
        reconcile(Arc::new(DeserializeGuard(Ok(job.clone()))), ctx)
            .await
            .unwrap();
        let log = log.lock().unwrap().clone();
        let pruned = [(
            "DELETE".to_owned(),
            "/apis/networking.k8s.io/v1/namespaces/ml/networkpolicies/train".to_owned(),
        )];
        match network_policy {
            true => assert!(log.is_empty(), "a steady job made requests: {log:?}"),
            false => assert_eq!(log, pruned),
        }
    }
}

/// A node whose kubelet's clock is a minute behind the operator's: its Lease's `renewTime` reads
/// a minute old on every look. The operator judges the Lease by when it saw it (a Lease first seen
/// gets a full grace window), so the steady job still only reads, and no node is lost.
#[tokio::test]
async fn a_lease_renewed_by_a_clock_behind_the_operators_is_not_lost() {
    let job = basic();
    let mut objects = world(
        &job,
        (0..4).map(|i| worker(&job, i, "Running", None)).collect(),
    );
    let behind = (jiff::Timestamp::now() - jiff::SignedDuration::from_secs(60)).to_string();
    for (path, obj) in &mut objects {
        if path.ends_with("/leases/n0") {
            obj["spec"]["renewTime"] = json!(behind);
        }
    }
    let job = settled(job, &objects);
    assert_eq!(job.status.as_ref().unwrap().failures.total, 0);
    let (client, log) = mock(objects.clone());
    let ctx = context(client, &job, &objects);
    reconcile(Arc::new(DeserializeGuard(Ok(job))), ctx)
        .await
        .unwrap();
    let log = log.lock().unwrap().clone();
    assert!(
        log.is_empty(),
        "a healthy node's job made requests: {log:?}"
    );
}

#[tokio::test]
async fn a_lost_worker_is_counted_before_its_pod_is_touched() {
    let job = basic();
    let healthy = world(
        &job,
        (0..4).map(|i| worker(&job, i, "Running", None)).collect(),
    );
    let job = settled(job, &healthy);
    let mut pods: Vec<Value> = (0..4).map(|i| worker(&job, i, "Running", None)).collect();
    pods[2] = worker(&job, 2, "Failed", Some(137));
    let mut objects = world(&job, pods);
    objects.push((
        "/apis/diphoma.io/v1alpha1/namespaces/ml/diphomajobs/train".into(),
        serde_json::to_value(&job).unwrap(),
    ));
    let (client, log) = mock(objects.clone());
    let ctx = context(client, &job, &objects);
    reconcile(Arc::new(DeserializeGuard(Ok(job))), ctx)
        .await
        .unwrap();
    let writes: Vec<(String, String)> = log
        .lock()
        .unwrap()
        .iter()
        .filter(|(m, p)| m != "GET" && !p.contains("events"))
        .cloned()
        .collect();
    let pos = |m: &str, p: &str| {
        writes
            .iter()
            .position(|w| w.0 == m && w.1 == p)
            .unwrap_or_else(|| panic!("no {m} {p} in {writes:?}"))
    };
    let status = pos(
        "PATCH",
        "/apis/diphoma.io/v1alpha1/namespaces/ml/diphomajobs/train/status",
    );
    let annotate = pos("PATCH", "/api/v1/namespaces/ml/pods/train-worker-2");
    let create = pos("PATCH", "/api/v1/namespaces/ml/pods/train-worker-2-1");
    assert!(status < annotate && annotate < create, "order: {writes:?}");
    assert!(
        !writes.iter().any(|w| w.0 == "DELETE"),
        "the failed pod stays for its logs: {writes:?}"
    );
    assert!(
        !writes
            .iter()
            .any(|w| w.1.ends_with("/configmaps/train-ring")),
        "a fixed-size ring waits for the replacement"
    );
}

#[tokio::test]
async fn run_serves_health_on_the_injected_listener_and_stops_on_shutdown() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (client, _) = mock(vec![]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(run(client, Options::default(), Some(listener), async {
        let _ = stopped.await;
    }));
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut reply = String::new();
    conn.read_to_string(&mut reply).await.unwrap();
    assert!(
        reply.starts_with("HTTP/1.1 200") && reply.ends_with("ok"),
        "{reply}"
    );
    stop.send(()).unwrap();
    let done = tokio::time::timeout(Duration::from_secs(10), task).await;
    assert!(matches!(done, Ok(Ok(Ok(())))), "{done:?}");
}

#[tokio::test]
async fn a_job_that_does_not_decode_gets_a_status_and_an_event_and_nothing_else() {
    let path = "/apis/diphoma.io/v1alpha1/namespaces/ml/diphomajobs/train";
    let mut raw = serde_json::to_value(basic()).unwrap();
    raw["spec"]["template"]["spec"]["hostNetwork"] = json!("yes");
    let guard: DeserializeGuard<DiphomaJob> = serde_json::from_value(raw.clone()).unwrap();
    assert!(guard.0.is_err());
    let list = json!({"apiVersion": "diphoma.io/v1alpha1", "kind": "DiphomaJobList", "metadata": {}, "items": [raw.clone()]});
    let (client, log) = mock(vec![
        (
            "/apis/diphoma.io/v1alpha1/namespaces/ml/diphomajobs".into(),
            list,
        ),
        (path.into(), raw),
    ]);
    let ctx = Arc::new(Context::new(client, Metrics::default()));
    let action = reconcile(Arc::new(guard), ctx).await.unwrap();
    assert_eq!(action, Action::await_change());
    let writes: Vec<(String, String)> = log
        .lock()
        .unwrap()
        .iter()
        .filter(|(m, _)| m != "GET")
        .cloned()
        .collect();
    assert_eq!(writes[0], ("PATCH".into(), format!("{path}/status")));
    assert!(
        writes[1..].iter().all(|(_, p)| p.contains("/events")) && writes.len() > 1,
        "only the status and the event: {writes:?}"
    );
}

/// A refused worker does not fail the reconcile (the job keeps its usual cadence: progress,
/// node loss and hangs are still looked at), and is not tried again before its back-off ends.
#[tokio::test]
async fn a_refused_worker_backs_off_alone() {
    let mut job = basic();
    let objects = world(
        &job,
        (0..4).map(|i| worker(&job, i, "Running", None)).collect(),
    );
    job.spec.replicas = 5; // worker 4 is refused
    let job = settled(job, &objects);
    let mut objects = objects;
    objects.push((
        "/apis/diphoma.io/v1alpha1/namespaces/ml/diphomajobs/train".into(),
        serde_json::to_value(&job).unwrap(),
    ));
    let ctx = context(mock(vec![]).0, &job, &objects);
    let job = Arc::new(DeserializeGuard(Ok(job)));
    let (client, log) = mock_refusing(objects, Some("/api/v1/namespaces/ml/pods/train-worker-4"));
    let ctx = Arc::new(Context {
        caches: ctx.caches.clone(),
        ..Context::new(client, Metrics::default())
    });
    let creates = |log: &Log| {
        log.lock()
            .unwrap()
            .iter()
            .filter(|(m, p)| m == "PATCH" && p.ends_with("/pods/train-worker-4"))
            .count()
    };
    let first = reconcile(job.clone(), ctx.clone()).await;
    assert!(first.is_ok(), "{first:?}");
    assert_eq!(creates(&log), 1);
    // Tried again when its back-off ends (2 s), not at the safety net.
    let action = format!("{:?}", first.unwrap());
    assert!(action.contains("requeue_after: Some(1."), "{action}");
    let again = reconcile(job, ctx.clone()).await;
    assert!(again.is_ok(), "{again:?}");
    assert_eq!(creates(&log), 1, "retried before its back-off ended");
    let held = ctx.memories.get(&basic()).refused.rounds;
    assert_eq!(held, 1);
}

#[test]
fn an_orphaned_child_of_a_job_of_the_same_name_is_taken_over_and_nothing_else_is() {
    let job = basic(); // uid "uid-1"
    let meta = |labels: serde_json::Value,
                owners: serde_json::Value|
     -> k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        serde_json::from_value(json!({
            "name": "train-key", "resourceVersion": "42", "labels": labels, "ownerReferences": owners
        }))
        .unwrap()
    };
    let ours =
        json!({"app.kubernetes.io/managed-by": "diphoma-operator", "diphoma.io/job-name": "train"});
    let owner = |uid: &str| json!([{"apiVersion": "diphoma.io/v1alpha1", "kind": "DiphomaJob", "name": "train", "uid": uid, "controller": true}]);
    assert_eq!(
        caches::adoption(None, &job, false),
        caches::Adoption::Create
    );
    assert_eq!(
        caches::adoption(Some(&meta(ours.clone(), owner("uid-1"))), &job, false),
        caches::Adoption::Keep
    );
    // `kubectl delete --cascade=orphan` removed the owner: taken over at the version seen.
    assert_eq!(
        caches::adoption(Some(&meta(ours.clone(), json!([]))), &job, false),
        caches::Adoption::TakeOver("42".into())
    );
    assert_eq!(
        caches::adoption(Some(&meta(ours.clone(), json!(null))), &job, false),
        caches::Adoption::TakeOver("42".into())
    );
    // Never re-keyed under the job's own running workers.
    assert_eq!(
        caches::adoption(Some(&meta(ours.clone(), json!([]))), &job, true),
        caches::Adoption::Foreign
    );
    // A deleted job's child still owned (the garbage collector will remove it), a user's object
    // of the same name, another job's child: never touched.
    for m in [
        meta(ours.clone(), owner("uid-0")),
        meta(json!({"app": "mine"}), json!([])),
        meta(
            json!({"app.kubernetes.io/managed-by": "diphoma-operator", "diphoma.io/job-name": "other"}),
            json!([]),
        ),
    ] {
        assert_eq!(
            caches::adoption(Some(&m), &job, false),
            caches::Adoption::Foreign,
            "{m:?}"
        );
    }
}

#[test]
fn records_of_another_job_in_the_heartbeat_are_ignored() {
    let progress = |uid: Option<&str>| {
        serde_json::to_string(&ProgressReport {
            step: 7,
            time: "2027-01-15T08:01:30Z".into(),
            job_uid: uid.map(str::to_owned),
            ..ProgressReport::default()
        })
        .unwrap()
    };
    let report = |uid: Option<&str>| {
        serde_json::to_string(&FailureReport {
            generation: 1,
            reporter: "train-worker-0".into(),
            suspect: None,
            error: "PeerLost".into(),
            time: "2027-01-15T08:01:30Z".into(),
            job_uid: uid.map(str::to_owned),
        })
        .unwrap()
    };
    let restart = |uid: Option<&str>| {
        serde_json::to_string(&contract::RestartReport {
            by_cause: [("MemberLost".to_owned(), 1)].into(),
            generation: 2,
            time: "2027-01-15T08:01:30Z".into(),
            job_uid: uid.map(str::to_owned),
        })
        .unwrap()
    };
    for (uid, kept) in [(Some("uid-1"), true), (None, true), (Some("uid-0"), false)] {
        let data = std::collections::BTreeMap::from([
            (contract::PROGRESS_KEY.to_owned(), progress(uid)),
            (
                format!("{}train-worker-0", contract::REPORT_KEY_PREFIX),
                report(uid),
            ),
            (
                format!("{}train-worker-1", contract::RESTARTS_KEY_PREFIX),
                restart(uid),
            ),
        ]);
        let (p, r, n) = read_heartbeat(data, "uid-1");
        assert_eq!(
            (p.is_some(), r.len() == 1, n.len() == 1),
            (kept, kept, kept),
            "{uid:?}"
        );
    }
}

/// A gang job deleted while its gang was being repaired: the gangs not yet placed stop yielding
/// to it at once (its memory is forgotten when the job store no longer holds it), instead of
/// yielding until the operator restarts.
#[tokio::test]
async fn a_gang_job_deleted_during_its_repair_is_yielded_to_no_more() {
    use kube::runtime::watcher::Event as Ev;
    let mut job = basic();
    job.spec.gang = Some(crate::api::Gang {
        scheduler: crate::api::GangScheduler::Kubernetes,
    });
    let mut other = basic();
    other.metadata.name = Some("other".into());
    other.metadata.uid = Some("uid-other".into());
    let objects = vec![
        (
            "/api/v1/namespaces/ml/pods".to_string(),
            json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": []}),
        ),
        (
            "/apis/diphoma.io/v1alpha1/namespaces/ml/diphomajobs/train".into(),
            serde_json::to_value(&job).unwrap(),
        ),
    ];
    // `other`'s last reconcile saw its gang being repaired; `present`: whether the job store
    // still holds it. The worker pods `job` creates (none while it yields).
    let created = |present: bool| {
        let (job, other, objects) = (job.clone(), other.clone(), objects.clone());
        async move {
            let (client, log) = mock(objects.clone());
            let (jobs, mut writer) = reflector::store();
            writer.apply_watcher_event(&Ev::Apply(DeserializeGuard(Ok(job.clone()))));
            if present {
                writer.apply_watcher_event(&Ev::Apply(DeserializeGuard(Ok(other.clone()))));
            }
            let gangs = crate::gang::Stores {
                native: Some(crate::gang::Native {
                    workloads: reflector::store().0,
                    pod_groups: reflector::store().0,
                }),
                coscheduling: None,
            };
            let ctx = Arc::new(Context {
                caches: caches(&job, &objects),
                jobs: Some(jobs),
                gangs,
                ..Context::new(client, Metrics::default())
            });
            let repairing = Memory {
                repairing: true,
                ..Memory::default()
            };
            ctx.memories.put(&other, repairing);
            reconcile(Arc::new(DeserializeGuard(Ok(job))), ctx.clone())
                .await
                .unwrap();
            let log = log.lock().unwrap().clone();
            log.iter()
                .filter(|(m, p)| {
                    m == "PATCH" && p.starts_with("/api/v1/namespaces/ml/pods/train-worker-")
                })
                .count()
        }
    };
    assert_eq!(
        created(true).await,
        0,
        "a gang not yet placed yields to a repair"
    );
    assert_eq!(
        created(false).await,
        4,
        "it yields to a deleted job's repair"
    );
}
