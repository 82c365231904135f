//! What a container's process gets from its pod spec, as pure functions: environment variables
//! (`env`, `envFrom`, downward API `fieldRef`/`resourceFieldRef`, ConfigMap and Secret keys),
//! `$(VAR)` expansion, and the rewriting of volume mount paths to the directories that stand in
//! for them. The kubelet gathers the ConfigMaps and Secrets first ([`references`]), then calls these.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Container, Pod};

use crate::Error;

/// Facts about a running pod that the downward API exposes and the spec does not hold.
#[derive(Debug, Clone)]
pub struct PodFacts {
    /// The pod's loopback IP.
    pub pod_ip: String,
    /// The node's loopback IP.
    pub host_ip: String,
}

/// Contents of the ConfigMaps and Secrets a pod references, by name; values are decoded text.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    /// ConfigMap name → key → value (`data` and UTF-8 `binaryData`).
    pub config_maps: BTreeMap<String, BTreeMap<String, String>>,
    /// Secret name → key → value (decoded `data`).
    pub secrets: BTreeMap<String, BTreeMap<String, String>>,
}

/// Names of the ConfigMaps and Secrets a pod references from env, envFrom and volumes.
pub fn references(pod: &Pod) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut cms, mut secrets) = (BTreeSet::new(), BTreeSet::new());
    let Some(spec) = &pod.spec else {
        return (cms, secrets);
    };
    for c in spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
    {
        for e in c.env.iter().flatten() {
            if let Some(vf) = &e.value_from {
                if let Some(r) = &vf.config_map_key_ref {
                    cms.insert(r.name.clone());
                }
                if let Some(r) = &vf.secret_key_ref {
                    secrets.insert(r.name.clone());
                }
            }
        }
        for ef in c.env_from.iter().flatten() {
            if let Some(r) = &ef.config_map_ref {
                cms.insert(r.name.clone());
            }
            if let Some(r) = &ef.secret_ref {
                secrets.insert(r.name.clone());
            }
        }
    }
    for v in spec.volumes.iter().flatten() {
        if let Some(cm) = &v.config_map {
            cms.insert(cm.name.clone());
        }
        if let Some(s) = v.secret.as_ref().and_then(|s| s.secret_name.clone()) {
            secrets.insert(s);
        }
        for src in v.projected.iter().flat_map(|p| p.sources.iter().flatten()) {
            if let Some(cm) = &src.config_map {
                cms.insert(cm.name.clone());
            }
            if let Some(s) = &src.secret {
                secrets.insert(s.name.clone());
            }
        }
    }
    (cms, secrets)
}

/// The value of a downward-API `fieldRef` path (`metadata.name`, `metadata.labels['k']`,
/// `spec.nodeName`, `status.podIP`, …), or `None` for a path the kubelet does not know.
pub fn field_value(pod: &Pod, facts: &PodFacts, path: &str) -> Option<String> {
    let m = &pod.metadata;
    let spec = pod.spec.as_ref();
    let keyed = |prefix: &str, map: Option<&BTreeMap<String, String>>| {
        let key = path.strip_prefix(prefix)?.strip_suffix("']")?;
        Some(map.and_then(|m| m.get(key)).cloned().unwrap_or_default())
    };
    match path {
        "metadata.name" => m.name.clone(),
        "metadata.namespace" => m.namespace.clone(),
        "metadata.uid" => m.uid.clone(),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()),
        "spec.serviceAccountName" => spec.and_then(|s| s.service_account_name.clone()),
        "status.podIP" | "status.podIPs" => Some(facts.pod_ip.clone()),
        "status.hostIP" | "status.hostIPs" => Some(facts.host_ip.clone()),
        _ => keyed("metadata.labels['", m.labels.as_ref())
            .or_else(|| keyed("metadata.annotations['", m.annotations.as_ref())),
    }
}

/// The environment of `container` in the order the kubelet builds it: `envFrom` sources, then
/// `env` entries (each `$(VAR)`-expanded against the variables before it), then `extra` (what the
/// kubelet itself adds: `KUBECONFIG`, `CUDA_VISIBLE_DEVICES`, …). Later entries win.
///
/// Errors: [`Error::Config`] naming the field (`spec.containers[NAME].env[VAR]…`) when a
/// non-optional ConfigMap, Secret or key is missing or a `fieldRef` path is unknown.
pub fn container_env(
    pod: &Pod,
    container: &Container,
    facts: &PodFacts,
    sources: &Sources,
    extra: &[(String, String)],
) -> Result<Vec<(String, String)>, Error> {
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    let field = |suffix: String| format!("spec.containers[{}].{suffix}", container.name);
    let missing = |f: String, what: String| Error::Config {
        field: f,
        message: what,
    };

    for (i, ef) in container.env_from.iter().flatten().enumerate() {
        let prefix = ef.prefix.clone().unwrap_or_default();
        let (kind, name, optional, map) = if let Some(r) = &ef.config_map_ref {
            (
                "configmap",
                &r.name,
                r.optional,
                sources.config_maps.get(&r.name),
            )
        } else if let Some(r) = &ef.secret_ref {
            ("secret", &r.name, r.optional, sources.secrets.get(&r.name))
        } else {
            continue;
        };
        match map {
            Some(map) => env.extend(map.iter().map(|(k, v)| (format!("{prefix}{k}"), v.clone()))),
            None if optional == Some(true) => {}
            None => {
                return Err(missing(
                    field(format!("envFrom[{i}]")),
                    format!("{kind} {name:?} not found"),
                ));
            }
        }
    }
    for e in container.env.iter().flatten() {
        let f = field(format!("env[{}]", e.name));
        let value = if let Some(vf) = &e.value_from {
            if let Some(r) = &vf.field_ref {
                Some(field_value(pod, facts, &r.field_path).ok_or_else(|| {
                    missing(
                        f.clone() + ".valueFrom.fieldRef",
                        format!("unsupported fieldPath {:?}", r.field_path),
                    )
                })?)
            } else if let Some(r) = &vf.resource_field_ref {
                Some(resource_value(container, &r.resource))
            } else if let Some(r) = &vf.config_map_key_ref {
                key_value(
                    &sources.config_maps,
                    "configmap",
                    &r.name,
                    &r.key,
                    r.optional,
                )
                .map_err(|m| missing(f.clone() + ".valueFrom.configMapKeyRef", m))?
            } else if let Some(r) = &vf.secret_key_ref {
                key_value(&sources.secrets, "secret", &r.name, &r.key, r.optional)
                    .map_err(|m| missing(f.clone() + ".valueFrom.secretKeyRef", m))?
            } else {
                None
            }
        } else {
            Some(expand(e.value.as_deref().unwrap_or_default(), &env))
        };
        if let Some(v) = value {
            env.insert(e.name.clone(), v);
        }
    }
    env.extend(extra.iter().cloned());
    Ok(env.into_iter().collect())
}

fn key_value(
    maps: &BTreeMap<String, BTreeMap<String, String>>,
    kind: &str,
    name: &str,
    key: &str,
    optional: Option<bool>,
) -> Result<Option<String>, String> {
    match maps.get(name).map(|m| m.get(key)) {
        Some(Some(v)) => Ok(Some(v.clone())),
        _ if optional == Some(true) => Ok(None),
        None => Err(format!("{kind} {name:?} not found")),
        Some(None) => Err(format!("key {key:?} not found in {kind} {name:?}")),
    }
}

/// `resourceFieldRef` (`limits.cpu`, `requests.memory`, `limits.nvidia.com/gpu`, …): the
/// container's quantity as written in the spec, or `"0"` when unset.
fn resource_value(c: &Container, resource: &str) -> String {
    let res = c.resources.as_ref();
    let (map, name) = match resource.split_once('.') {
        Some(("limits", n)) => (res.and_then(|r| r.limits.as_ref()), n),
        Some(("requests", n)) => (res.and_then(|r| r.requests.as_ref()), n),
        _ => (None, resource),
    };
    map.and_then(|m| m.get(name))
        .map(|q| q.0.clone())
        .unwrap_or_else(|| "0".into())
}

/// Kubernetes' `$(VAR)` expansion (k8s.io/kubernetes third_party/forked/golang/expansion):
/// `$(NAME)` becomes the value of a defined variable, an undefined reference stays as written, and
/// `$$` is an escaped `$`.
pub fn expand(input: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(close) = after.strip_prefix('(').and_then(|s| s.find(')')) {
            let name = &after[1..=close];
            match vars.get(name) {
                Some(v) => out.push_str(v),
                None => out.push_str(&rest[i..i + close + 3]),
            }
            rest = &after[close + 2..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// Rewrites a path-like string for a process that has no mount namespace: if `s` (or the value
/// after the first `=`, as in `--key-file=/etc/key`) is a mount path or lies below one, the mount
/// path is replaced by the host directory standing in for it. Longest mount path wins.
pub fn rewrite_path(s: &str, mounts: &[(String, PathBuf)]) -> String {
    let (head, path) = match s.split_once('=') {
        Some((h, p)) if p.starts_with('/') => (format!("{h}="), p),
        _ => (String::new(), s),
    };
    let best = mounts
        .iter()
        .filter(|(mp, _)| {
            let mp = mp.trim_end_matches('/');
            path == mp || path.strip_prefix(mp).is_some_and(|r| r.starts_with('/'))
        })
        .max_by_key(|(mp, _)| mp.len());
    match best {
        Some((mp, host)) => {
            let rest = path[mp.trim_end_matches('/').len()..].trim_start_matches('/');
            let joined = if rest.is_empty() {
                host.clone()
            } else {
                host.join(rest)
            };
            format!("{head}{}", joined.display())
        }
        None => s.to_owned(),
    }
}

/// A container's `command` (none or empty: the image's entrypoint) and `args`, each
/// `$(VAR)`-expanded against `env`. Returns (command, args).
pub fn command_args(
    container: &Container,
    env: &[(String, String)],
) -> (Option<Vec<String>>, Vec<String>) {
    let vars: BTreeMap<String, String> = env.iter().cloned().collect();
    let x = |l: &Option<Vec<String>>| -> Vec<String> {
        l.iter().flatten().map(|s| expand(s, &vars)).collect()
    };
    let command = Some(x(&container.command)).filter(|c| !c.is_empty());
    (command, x(&container.args))
}

/// The command line of a container: `command` (or the image's binary) followed by `args`, each
/// `$(VAR)`-expanded against `env` and path-rewritten. Returns (program, arguments).
pub fn command_line(
    container: &Container,
    binary: &Path,
    env: &[(String, String)],
    mounts: &[(String, PathBuf)],
) -> (PathBuf, Vec<String>) {
    let fix = |s: String| rewrite_path(&s, mounts);
    let (command, args) = command_args(container, env);
    let mut argv: Vec<String> = command.into_iter().flatten().map(fix).collect();
    // The image *is* the binary: a command naming the image's program (or none) runs it.
    let program = if argv.is_empty() {
        binary.to_owned()
    } else {
        let first = argv.remove(0);
        let named = Path::new(&first).file_name() == binary.file_name();
        if named {
            binary.to_owned()
        } else {
            PathBuf::from(first)
        }
    };
    argv.extend(args.into_iter().map(fix));
    (program, argv)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(json: serde_json::Value) -> Pod {
        serde_json::from_value(json).unwrap()
    }

    fn facts() -> PodFacts {
        PodFacts {
            pod_ip: "127.5.0.2".into(),
            host_ip: "127.5.0.1".into(),
        }
    }

    fn test_pod() -> Pod {
        pod(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"app": "x"}},
            "spec": {"nodeName": "n0", "serviceAccountName": "sa", "containers": [{
                "name": "c", "image": "diphoma-probe",
                "resources": {"limits": {"nvidia.com/gpu": "2"}},
                "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
                "env": [
                    {"name": "A", "value": "a"},
                    {"name": "B", "value": "$(A)-$(NOPE)-$$(A)"},
                    {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                    {"name": "GPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.nvidia.com/gpu"}}},
                    {"name": "S", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "k"}}},
                    {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k", "optional": true}}}
                ]}],
                "volumes": [{"name": "v", "configMap": {"name": "cm2"}},
                            {"name": "t", "projected": {"sources": [{"secret": {"name": "sec2"}}]}}]}
        }))
    }

    fn sources() -> Sources {
        let one = |k: &str, v: &str| BTreeMap::from([(k.to_owned(), v.to_owned())]);
        Sources {
            config_maps: BTreeMap::from([("cm".into(), one("X", "1"))]),
            secrets: BTreeMap::from([("sec".into(), one("k", "s3cret"))]),
        }
    }

    #[test]
    fn env_resolves_every_source_in_kubelet_order() {
        let p = test_pod();
        let c = &p.spec.as_ref().unwrap().containers[0];
        let extra = [("KUBECONFIG".to_owned(), "/k".to_owned())];
        let env: BTreeMap<_, _> = container_env(&p, c, &facts(), &sources(), &extra)
            .unwrap()
            .into_iter()
            .collect();
        assert_eq!(env["CM_X"], "1");
        assert_eq!(env["B"], "a-$(NOPE)-$(A)");
        assert_eq!(env["POD"], "p");
        assert_eq!(env["IP"], "127.5.0.2");
        assert_eq!(env["APP"], "x");
        assert_eq!(env["GPUS"], "2");
        assert_eq!(env["S"], "s3cret");
        assert_eq!(env["KUBECONFIG"], "/k");
        assert!(!env.contains_key("OPT"));
    }

    #[test]
    fn missing_secret_names_the_field() {
        let p = test_pod();
        let c = &p.spec.as_ref().unwrap().containers[0];
        let mut s = sources();
        s.secrets.clear();
        let e = container_env(&p, c, &facts(), &s, &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("spec.containers[c].env[S].valueFrom.secretKeyRef") && e.contains("\"sec\""),
            "{e}"
        );
    }

    #[test]
    fn references_cover_env_env_from_and_volumes() {
        let (cms, secrets) = references(&test_pod());
        assert_eq!(cms.into_iter().collect::<Vec<_>>(), ["cm", "cm2"]);
        assert_eq!(
            secrets.into_iter().collect::<Vec<_>>(),
            ["gone", "sec", "sec2"]
        );
    }

    #[test]
    fn expansion_handles_escapes_and_unterminated_references() {
        let vars = BTreeMap::from([("A".to_owned(), "1".to_owned())]);
        assert_eq!(expand("$(A)$(A)", &vars), "11");
        assert_eq!(expand("$$", &vars), "$");
        assert_eq!(expand("$(A", &vars), "$(A");
        assert_eq!(expand("cost $5", &vars), "cost $5");
        assert_eq!(expand("", &vars), "");
    }

    #[test]
    fn mount_paths_are_rewritten_longest_first() {
        let mounts = vec![
            ("/etc/diphoma".to_owned(), PathBuf::from("/tmp/pod/a")),
            ("/etc/diphoma/key/".to_owned(), PathBuf::from("/tmp/pod/k")),
        ];
        assert_eq!(rewrite_path("/etc/diphoma/x", &mounts), "/tmp/pod/a/x");
        assert_eq!(
            rewrite_path("/etc/diphoma/key/key", &mounts),
            "/tmp/pod/k/key"
        );
        assert_eq!(
            rewrite_path("--key=/etc/diphoma/key", &mounts),
            "--key=/tmp/pod/k"
        );
        assert_eq!(rewrite_path("/etc/diphomax", &mounts), "/etc/diphomax");
        assert_eq!(rewrite_path("plain", &mounts), "plain");
    }

    #[test]
    fn command_naming_the_image_binary_runs_it() {
        let c: Container = serde_json::from_value(serde_json::json!({
            "name": "c", "command": ["diphoma-probe"], "args": ["--read", "$(DIR)/f"]
        }))
        .unwrap();
        let env = vec![("DIR".to_owned(), "/data".to_owned())];
        let mounts = vec![("/data".to_owned(), PathBuf::from("/tmp/d"))];
        let (prog, args) = command_line(&c, Path::new("/bin/x/diphoma-probe"), &env, &mounts);
        assert_eq!(prog, PathBuf::from("/bin/x/diphoma-probe"));
        assert_eq!(args, ["--read", "/tmp/d/f"]);
    }
}
