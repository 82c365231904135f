//! Volumes as directories. A process has no mount namespace, so every volume becomes a directory
//! and each `volumeMount.mountPath` is rewritten to it in the container's env and arguments
//! ([`super::spec::rewrite_path`]):
//!
//! | volume | directory |
//! |---|---|
//! | `emptyDir` | `<root>/pods/<uid>/volumes/<name>`, removed with the pod |
//! | `hostPath` | the path itself (created for `DirectoryOrCreate`) |
//! | `persistentVolumeClaim` | the bound PersistentVolume's `hostPath`/`local` path |
//! | `configMap`, `secret`, `downwardAPI`, `projected` | files written into `<root>/pods/<uid>/volumes/<name>` |
//!
//! `projected` `serviceAccountToken` sources get a real token from the TokenRequest API, bound
//! to the pod. The same module writes the pod's kubeconfig (its ServiceAccount's token), which
//! stands in for the in-cluster mount so that RBAC applies to the process.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    DownwardAPIVolumeFile, KeyToPath, PersistentVolume, PersistentVolumeClaim, Pod, ServiceAccount,
    Volume,
};
use kube::api::PostParams;
use kube::{Api, Client};

use super::spec::{PodFacts, Sources, field_value};
use crate::Error;

/// Lifetime of the tokens the kubelet requests, in seconds.
const TOKEN_SECONDS: i64 = 24 * 3600;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_owned(),
        source,
    }
}

fn write(path: &Path, content: &str) -> Result<(), Error> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
    }
    std::fs::write(path, content).map_err(io(path))
}

/// Writes the selected keys of `map` (all of them without `items`) as files under `dir`.
fn write_keys(
    dir: &Path,
    map: Option<&BTreeMap<String, String>>,
    items: Option<&Vec<KeyToPath>>,
    what: &str,
    optional: bool,
) -> Result<(), Error> {
    let Some(map) = map else {
        return if optional {
            Ok(())
        } else {
            Err(Error::Config {
                field: "volumes".into(),
                message: format!("{what} not found"),
            })
        };
    };
    match items {
        None => map.iter().try_for_each(|(k, v)| write(&dir.join(k), v)),
        Some(items) => items.iter().try_for_each(|it| match map.get(&it.key) {
            Some(v) => write(&dir.join(&it.path), v),
            None => Err(Error::Config {
                field: "volumes".into(),
                message: format!("key {:?} not in {what}", it.key),
            }),
        }),
    }
}

/// Requests a token for the pod's ServiceAccount, bound to the pod (TokenRequest API).
pub async fn pod_token(
    client: &Client,
    pod: &Pod,
    audience: Option<&str>,
) -> Result<String, Error> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let sa = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.as_deref())
        .unwrap_or("default");
    let req = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: audience.map(|a| vec![a.to_owned()]),
            expiration_seconds: Some(TOKEN_SECONDS),
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: pod.metadata.name.clone(),
                uid: pod.metadata.uid.clone(),
            }),
        }),
        ..Default::default()
    };
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let resp = api
        .create_token_request(sa, &PostParams::default(), &req)
        .await?;
    Ok(resp.status.and_then(|s| s.token).unwrap_or_default())
}

/// Writes `<pod dir>/kubeconfig`: the API server at `server`, its CA, and the pod's token.
pub fn write_kubeconfig(
    path: &Path,
    server: &str,
    ca_file: &Path,
    token: &str,
) -> Result<(), Error> {
    // The CA inline, so that the file alone works wherever it is mounted (container mode).
    let ca = std::fs::read(ca_file).map_err(io(ca_file))?;
    let ca = serde_json::to_value(k8s_openapi::ByteString(ca)).expect("bytes serialize");
    let kc = serde_json::json!({
        "apiVersion": "v1", "kind": "Config", "current-context": "pod",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority-data": ca}}],
        "users": [{"name": "pod", "user": {"token": token}}],
        "contexts": [{"name": "pod", "context": {"cluster": "local", "user": "pod"}}],
    });
    write(path, &kc.to_string())
}

/// Makes every volume of `pod` a directory under `pod_dir` (see the module docs) and returns
/// volume name → directory.
///
/// Errors: [`Error::Unsupported`] for a volume type the process kubelet cannot provide,
/// [`Error::Config`] for a missing ConfigMap/Secret/key or an unbound claim, API and I/O errors.
pub async fn materialize(
    client: &Client,
    pod: &Pod,
    facts: &PodFacts,
    sources: &Sources,
    pod_dir: &Path,
) -> Result<BTreeMap<String, PathBuf>, Error> {
    let mut dirs = BTreeMap::new();
    for v in pod
        .spec
        .as_ref()
        .and_then(|s| s.volumes.as_ref())
        .into_iter()
        .flatten()
    {
        let dir = volume_dir(client, pod, facts, sources, pod_dir, v).await?;
        dirs.insert(v.name.clone(), dir);
    }
    Ok(dirs)
}

async fn volume_dir(
    client: &Client,
    pod: &Pod,
    facts: &PodFacts,
    sources: &Sources,
    pod_dir: &Path,
    v: &Volume,
) -> Result<PathBuf, Error> {
    let own = pod_dir.join("volumes").join(&v.name);
    std::fs::create_dir_all(&own).map_err(io(&own))?;
    if v.empty_dir.is_some() {
        // World-writable, as the real kubelet makes it: a container's non-root user writes it.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&own, std::fs::Permissions::from_mode(0o777)).map_err(io(&own))?;
    }
    if let Some(hp) = &v.host_path {
        let path = PathBuf::from(&hp.path);
        if hp.type_.as_deref() == Some("DirectoryOrCreate") {
            std::fs::create_dir_all(&path).map_err(io(&path))?;
        }
        return Ok(path);
    }
    if let Some(claim) = &v.persistent_volume_claim {
        return claim_dir(client, pod, &claim.claim_name).await;
    }
    let config_map = |name: &str, items: Option<&Vec<KeyToPath>>, optional: Option<bool>| {
        let what = format!("configmap {name:?}");
        write_keys(
            &own,
            sources.config_maps.get(name),
            items,
            &what,
            optional == Some(true),
        )
    };
    let secret = |name: &str, items: Option<&Vec<KeyToPath>>, optional: Option<bool>| {
        let what = format!("secret {name:?}");
        write_keys(
            &own,
            sources.secrets.get(name),
            items,
            &what,
            optional == Some(true),
        )
    };
    let downward = |items: &[DownwardAPIVolumeFile]| {
        items.iter().try_for_each(|item| {
            let value = item
                .field_ref
                .as_ref()
                .and_then(|f| field_value(pod, facts, &f.field_path));
            write(&own.join(&item.path), &value.unwrap_or_default())
        })
    };
    if let Some(cm) = &v.config_map {
        config_map(&cm.name, cm.items.as_ref(), cm.optional)?;
    } else if let Some(s) = &v.secret {
        secret(
            s.secret_name.as_deref().unwrap_or_default(),
            s.items.as_ref(),
            s.optional,
        )?;
    } else if let Some(d) = &v.downward_api {
        downward(d.items.as_deref().unwrap_or_default())?;
    } else if let Some(p) = &v.projected {
        for src in p.sources.iter().flatten() {
            if let Some(t) = &src.service_account_token {
                let token = pod_token(client, pod, t.audience.as_deref()).await?;
                write(&own.join(&t.path), &token)?;
            }
            if let Some(cm) = &src.config_map {
                config_map(&cm.name, cm.items.as_ref(), cm.optional)?;
            }
            if let Some(s) = &src.secret {
                secret(&s.name, s.items.as_ref(), s.optional)?;
            }
            if let Some(d) = &src.downward_api {
                downward(d.items.as_deref().unwrap_or_default())?;
            }
        }
    } else if v.empty_dir.is_none() {
        return Err(Error::Unsupported {
            pod: super::pod_key(pod),
            what: format!(
                "volume {:?}: only emptyDir, hostPath, persistentVolumeClaim, configMap, secret, downwardAPI and projected volumes are supported",
                v.name
            ),
        });
    }
    Ok(own)
}

/// The directory of the PersistentVolume bound to a claim (`hostPath.path` or `local.path`).
async fn claim_dir(client: &Client, pod: &Pod, claim: &str) -> Result<PathBuf, Error> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let pvc = Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns)
        .get(claim)
        .await?;
    let unbound = || Error::Config {
        field: format!("persistentvolumeclaim {claim:?}"),
        message: "is not bound to a hostPath or local PersistentVolume".into(),
    };
    let pv_name = pvc.spec.and_then(|s| s.volume_name).ok_or_else(unbound)?;
    let pv = Api::<PersistentVolume>::all(client.clone())
        .get(&pv_name)
        .await?;
    let spec = pv.spec.ok_or_else(unbound)?;
    let path = spec
        .host_path
        .map(|h| h.path)
        .or(spec.local.map(|l| l.path))
        .ok_or_else(unbound)?;
    let path = PathBuf::from(path);
    std::fs::create_dir_all(&path).map_err(io(&path))?;
    Ok(path)
}
