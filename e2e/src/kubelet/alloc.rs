//! Per-node allocators (pure): loopback pod IPs from the node's range and GPU indices, the way
//! kwok's IP pool and the NVIDIA device plugin hand them out.

use std::collections::BTreeSet;

/// Loopback addresses of one node: the node is `127.<cluster>.<node>.1`, its pods take
/// `.2 ..= .254`. Every address lies in 127.0.0.0/8, so each pod can bind its own IP.
#[derive(Debug, Clone)]
pub struct IpPool {
    prefix: [u8; 3],
    used: BTreeSet<u8>,
}

impl IpPool {
    /// The pool of node `node` (0-based) in cluster `cluster` (second octet).
    pub fn new(cluster: u8, node: u8) -> Self {
        IpPool {
            prefix: [127, cluster, node],
            used: BTreeSet::new(),
        }
    }

    fn addr(&self, last: u8) -> String {
        let [a, b, c] = self.prefix;
        format!("{a}.{b}.{c}.{last}")
    }

    /// The node's own address (its InternalIP and every pod's hostIP).
    pub fn node_ip(&self) -> String {
        self.addr(1)
    }

    /// The node's pod CIDR.
    pub fn cidr(&self) -> String {
        self.addr(0) + "/24"
    }

    /// Takes the lowest free pod address, or `None` when all 253 are in use.
    pub fn allocate(&mut self) -> Option<String> {
        let last = (2..=254).find(|i| !self.used.contains(i))?;
        self.used.insert(last);
        Some(self.addr(last))
    }

    /// Returns an address to the pool (ignores addresses it never gave out).
    pub fn release(&mut self, ip: &str) {
        if let Ok(ip) = ip.parse::<std::net::Ipv4Addr>() {
            let [a, b, c, last] = ip.octets();
            if [a, b, c] == self.prefix {
                self.used.remove(&last);
            }
        }
    }
}

/// GPU indices `0..count` of one node.
#[derive(Debug, Clone)]
pub struct GpuPool {
    free: BTreeSet<u32>,
}

impl GpuPool {
    /// A node with `count` GPUs, all free.
    pub fn new(count: u32) -> Self {
        GpuPool {
            free: (0..count).collect(),
        }
    }

    /// Takes the `n` lowest free indices, or `None` (and takes nothing) when fewer are free.
    pub fn allocate(&mut self, n: u32) -> Option<Vec<u32>> {
        if (self.free.len() as u32) < n {
            return None;
        }
        let got: Vec<u32> = self.free.iter().copied().take(n as usize).collect();
        for g in &got {
            self.free.remove(g);
        }
        Some(got)
    }

    /// Returns indices to the pool.
    pub fn release(&mut self, gpus: &[u32]) {
        self.free.extend(gpus.iter().copied());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ip_pool_hands_out_distinct_loopback_addresses_and_reuses_released_ones() {
        let mut p = IpPool::new(42, 3);
        assert_eq!(p.node_ip(), "127.42.3.1");
        assert_eq!(p.cidr(), "127.42.3.0/24");
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert_eq!((a.as_str(), b.as_str()), ("127.42.3.2", "127.42.3.3"));
        p.release(&a);
        assert_eq!(p.allocate().unwrap(), a);
        assert_eq!((0..251).filter_map(|_| p.allocate()).count(), 251);
        assert_eq!(p.allocate(), None);
    }

    #[test]
    fn gpu_pool_is_all_or_nothing() {
        let mut g = GpuPool::new(4);
        assert_eq!(g.allocate(3), Some(vec![0, 1, 2]));
        assert_eq!(g.allocate(2), None);
        g.release(&[1]);
        assert_eq!(g.allocate(2), Some(vec![1, 3]));
        assert_eq!(g.allocate(0), Some(vec![]));
    }
}
