//! The operator's writes, and the one place that reads the API server's "already" answers: a
//! creation that finds its object there (409), a conditional replace that finds it changed
//! (409) and a deletion or patch that finds it gone (404) have nothing left to do, as every
//! write of the operator is idempotent and planned again from the watches. Used alike for the
//! static children, the pods, and the gang and Kueue Workloads. Decides nothing.

use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::api::FIELD_MANAGER;

/// The answer `code` (404, 409) read as "already done": none.
fn already<T>(r: Result<T, kube::Error>, code: u16) -> Result<Option<T>, kube::Error> {
    match r {
        Err(kube::Error::Api(s)) if s.code == code => Ok(None),
        r => r.map(Some),
    }
}

/// Server-side applies `obj` (forced, as [`FIELD_MANAGER`]); the object as stored.
pub async fn apply<K>(api: &Api<K>, obj: &K) -> Result<K, kube::Error>
where
    K: Resource + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    let params = PatchParams::apply(FIELD_MANAGER).force();
    api.patch(&name, &params, &Patch::Apply(obj)).await
}

/// Creates `obj`; the object as stored (none: one of its name is already there, 409).
pub async fn create<K>(api: &Api<K>, obj: &K) -> Result<Option<K>, kube::Error>
where
    K: Resource + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    already(api.create(&PostParams::default(), obj).await, 409)
}

/// Replaces `obj` (conditional on its `resourceVersion`); the object as stored (none: it
/// changed meanwhile, 409).
pub async fn replace<K>(api: &Api<K>, obj: &K) -> Result<Option<K>, kube::Error>
where
    K: Resource + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    already(api.replace(&name, &PostParams::default(), obj).await, 409)
}

/// Deletes `name`; the object as stored when its deletion is pending (none: deleted at once,
/// or already gone, 404).
pub async fn delete<K>(
    api: &Api<K>,
    name: &str,
    dp: &DeleteParams,
) -> Result<Option<K>, kube::Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    Ok(already(api.delete(name, dp).await, 404)?.and_then(|e| e.left()))
}

/// Merge-patches `body` into `name`; the object as stored (none: already gone, 404).
pub async fn merge<K>(
    api: &Api<K>,
    name: &str,
    params: &PatchParams,
    body: &serde_json::Value,
) -> Result<Option<K>, kube::Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    already(api.patch(name, params, &Patch::Merge(body)).await, 404)
}
