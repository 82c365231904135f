//! Node and Lease objects as a kubelet registers and renews them (pure builders), after kwok's
//! `node-initialize` stage and `node_lease_controller.go`. No I/O here.

use std::collections::BTreeMap;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{
    DaemonEndpoint, Node, NodeAddress, NodeCondition, NodeDaemonEndpoints, NodeSpec, NodeStatus,
    NodeSystemInfo,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference, Time};
use serde::{Deserialize, Serialize};

/// Namespace of node heartbeat Leases.
pub const LEASE_NAMESPACE: &str = "kube-node-lease";
/// Extended resource name of NVIDIA GPUs, as the device plugin advertises it.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// One simulated node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeConfig {
    /// Node name, e.g. `gpu-node-0`.
    pub name: String,
    /// Number of `nvidia.com/gpu` devices (0 = a CPU node without GPU labels).
    pub gpus: u32,
    /// `nvidia.com/gpu.product` label, e.g. `NVIDIA-H100-80GB-HBM3`.
    pub gpu_product: String,
    /// Allocatable CPU cores.
    pub cpu: u32,
    /// Allocatable memory in GiB.
    pub memory_gib: u32,
    /// Maximum pods on the node.
    pub max_pods: u32,
    /// How far the node's clock is from this machine's, in seconds (negative: behind): its
    /// Lease's `renewTime` is written at now plus this.
    #[serde(default)]
    pub clock_offset_seconds: i64,
}

impl NodeConfig {
    /// A GPU node with generous CPU and memory.
    pub fn gpu(name: &str, gpus: u32) -> Self {
        NodeConfig {
            name: name.to_owned(),
            gpus,
            gpu_product: "NVIDIA-H100-80GB-HBM3".to_owned(),
            cpu: 64,
            memory_gib: 512,
            max_pods: 110,
            clock_offset_seconds: 0,
        }
    }
}

fn now() -> Time {
    Time(jiff::Timestamp::now())
}

/// The Node object, status included (the API accepts status on create), with GPU labels,
/// capacity/allocatable for cpu, memory, pods and `nvidia.com/gpu`, and a Ready condition.
/// `ip` is the node's InternalIP (a loopback address); `pod_cidr` its pod range; `kubelet_port`
/// the port of its kubelet API on `ip` (`status.daemonEndpoints.kubeletEndpoint.port`).
pub fn node_object(cfg: &NodeConfig, ip: &str, pod_cidr: &str, kubelet_port: u16) -> Node {
    let q = |s: String| Quantity(s);
    let mut res = BTreeMap::from([
        ("cpu".to_owned(), q(cfg.cpu.to_string())),
        ("memory".to_owned(), q(format!("{}Gi", cfg.memory_gib))),
        ("pods".to_owned(), q(cfg.max_pods.to_string())),
        ("ephemeral-storage".to_owned(), q("1Ti".to_owned())),
    ]);
    let mut labels = BTreeMap::from([
        ("kubernetes.io/hostname".to_owned(), cfg.name.clone()),
        ("kubernetes.io/os".to_owned(), "linux".to_owned()),
        ("kubernetes.io/arch".to_owned(), "amd64".to_owned()),
    ]);
    if cfg.gpus > 0 {
        res.insert(GPU_RESOURCE.to_owned(), q(cfg.gpus.to_string()));
        labels.insert("nvidia.com/gpu.present".to_owned(), "true".to_owned());
        labels.insert("nvidia.com/gpu.count".to_owned(), cfg.gpus.to_string());
        labels.insert("nvidia.com/gpu.product".to_owned(), cfg.gpu_product.clone());
    }
    let cond = |t: &str, s: &str, reason: &str, msg: &str| NodeCondition {
        type_: t.into(),
        status: s.into(),
        reason: Some(reason.into()),
        message: Some(msg.into()),
        last_heartbeat_time: Some(now()),
        last_transition_time: Some(now()),
    };
    Node {
        metadata: ObjectMeta {
            name: Some(cfg.name.clone()),
            labels: Some(labels),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            pod_cidr: Some(pod_cidr.into()),
            pod_cidrs: Some(vec![pod_cidr.into()]),
            ..Default::default()
        }),
        status: Some(NodeStatus {
            capacity: Some(res.clone()),
            allocatable: Some(res),
            conditions: Some(vec![
                cond(
                    "Ready",
                    "True",
                    "KubeletReady",
                    "kubelet is posting ready status",
                ),
                cond(
                    "MemoryPressure",
                    "False",
                    "KubeletHasSufficientMemory",
                    "kubelet has sufficient memory available",
                ),
                cond(
                    "DiskPressure",
                    "False",
                    "KubeletHasNoDiskPressure",
                    "kubelet has no disk pressure",
                ),
                cond(
                    "PIDPressure",
                    "False",
                    "KubeletHasSufficientPID",
                    "kubelet has sufficient PID available",
                ),
            ]),
            addresses: Some(vec![
                NodeAddress {
                    type_: "InternalIP".into(),
                    address: ip.into(),
                },
                NodeAddress {
                    type_: "Hostname".into(),
                    address: cfg.name.clone(),
                },
            ]),
            daemon_endpoints: Some(NodeDaemonEndpoints {
                kubelet_endpoint: Some(DaemonEndpoint {
                    port: kubelet_port.into(),
                }),
            }),
            node_info: Some(NodeSystemInfo {
                architecture: "amd64".into(),
                operating_system: "linux".into(),
                kubelet_version: "v1.36.3-diphoma-process".into(),
                container_runtime_version: "process://0.1".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
    }
}

/// The Lease duration, in whole seconds, that a kubelet renewing every `renew` announces: four
/// intervals, as the kubelet's `nodeLeaseRenewIntervalFraction` (0.25) implies (40 s for its
/// default 10 s). The operator infers the renewal interval back from it.
pub fn lease_duration_seconds(renew: std::time::Duration) -> i32 {
    (renew.as_secs_f64() * 4.0).ceil().max(1.0) as i32
}

/// The node's heartbeat Lease in `kube-node-lease`, renewed every `renew` and last at `renewed`
/// (by the node's clock), owned by the Node (so it is garbage-collected with it). `node_uid` is
/// the registered Node's UID.
pub fn lease_object(
    node: &str,
    node_uid: &str,
    renew: std::time::Duration,
    renewed: jiff::Timestamp,
) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(node.to_owned()),
            namespace: Some(LEASE_NAMESPACE.to_owned()),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: node.to_owned(),
                uid: node_uid.to_owned(),
                ..Default::default()
            }]),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node.to_owned()),
            lease_duration_seconds: Some(lease_duration_seconds(renew)),
            renew_time: Some(MicroTime(renewed)),
            ..Default::default()
        }),
    }
}

/// The JSON merge patch that renews a Lease at `at` (by the node's clock).
pub fn lease_renewal(at: jiff::Timestamp) -> serde_json::Value {
    serde_json::json!({"spec": {"renewTime": MicroTime(at)}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_node_advertises_gpus_and_labels() {
        let n = node_object(
            &NodeConfig::gpu("g0", 4),
            "127.9.0.1",
            "127.9.0.0/24",
            10250,
        );
        let st = n.status.unwrap();
        assert_eq!(st.allocatable.unwrap()[GPU_RESOURCE].0, "4");
        let port = st
            .daemon_endpoints
            .and_then(|d| d.kubelet_endpoint)
            .map(|e| e.port);
        assert_eq!(port, Some(10250));
        let labels = n.metadata.labels.unwrap();
        assert_eq!(labels["nvidia.com/gpu.count"], "4");
        assert_eq!(labels["nvidia.com/gpu.present"], "true");
        assert_eq!(st.addresses.unwrap()[0].address, "127.9.0.1");
    }

    #[test]
    fn cpu_node_has_no_gpu_resource() {
        let n = node_object(
            &NodeConfig::gpu("c0", 0),
            "127.9.1.1",
            "127.9.1.0/24",
            10250,
        );
        assert!(
            !n.status
                .unwrap()
                .capacity
                .unwrap()
                .contains_key(GPU_RESOURCE)
        );
        assert!(
            !n.metadata
                .labels
                .unwrap()
                .contains_key("nvidia.com/gpu.present")
        );
    }

    #[test]
    fn lease_is_owned_by_its_node() {
        let l = lease_object(
            "g0",
            "uid-1",
            std::time::Duration::from_millis(2_500),
            jiff::Timestamp::now(),
        );
        let owner = &l.metadata.owner_references.unwrap()[0];
        assert_eq!((owner.kind.as_str(), owner.uid.as_str()), ("Node", "uid-1"));
        let spec = l.spec.unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some("g0"));
        assert_eq!(
            spec.lease_duration_seconds,
            Some(10),
            "four renewal intervals"
        );
    }
}
