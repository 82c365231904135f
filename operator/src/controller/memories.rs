//! The reconciler's memory of each job ([`Memory`], the plan's), kept by job UID between its
//! reconciles and forgotten with the job: at its Delete event, when it is seen being deleted,
//! and when a look at another job's finds it no longer in the job store (a Delete missed while
//! the watch re-listed). A job of the same name created again is a new UID: it starts afresh.

use std::collections::BTreeMap;
use std::sync::Mutex;

use kube::{Resource, ResourceExt};

use crate::plan::memory::Memory;

/// One job's memory, with the job it is of.
#[derive(Debug, Clone)]
struct Entry {
    namespace: String,
    name: String,
    memory: Memory,
}

/// The memories of every job, by UID.
#[derive(Debug, Default)]
pub struct Memories {
    by_uid: Mutex<BTreeMap<String, Entry>>,
}

/// The UID of `job` (empty for an object without one: never one the API server stored).
fn uid(job: &impl Resource) -> String {
    job.meta().uid.clone().unwrap_or_default()
}

impl Memories {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        self.by_uid.lock().expect("memories lock")
    }

    /// `job`'s memory (the default when none is kept).
    pub fn get(&self, job: &impl Resource) -> Memory {
        self.lock()
            .get(&uid(job))
            .map(|e| e.memory.clone())
            .unwrap_or_default()
    }

    /// Keeps `memory` for `job`; a default memory is nothing to keep.
    pub fn put<K: Resource<DynamicType = ()>>(&self, job: &K, memory: Memory) {
        if memory == Memory::default() {
            self.clear(job);
            return;
        }
        let entry = Entry {
            namespace: job.namespace().unwrap_or_default(),
            name: job.name_any(),
            memory,
        };
        self.lock().insert(uid(job), entry);
    }

    /// Forgets `job`.
    pub fn clear(&self, job: &impl Resource) {
        self.lock().remove(&uid(job));
    }

    /// Counts a failed reconcile of `job`; the failures in a row, this one included.
    pub fn failed<K: Resource<DynamicType = ()>>(&self, job: &K) -> u32 {
        let mut memory = self.get(job);
        memory.retries += 1;
        let n = memory.retries;
        self.put(job, memory);
        n
    }

    /// A reconcile of `job` succeeded: its failures in a row are forgotten.
    pub fn succeeded<K: Resource<DynamicType = ()>>(&self, job: &K) {
        let memory = self.get(job);
        if memory.retries > 0 {
            self.put(
                job,
                Memory {
                    retries: 0,
                    ..memory
                },
            );
        }
    }

    /// Another job than `job` whose gang is being repaired, as `namespace/name`
    /// ([`Memory::repairing`]). A job for which `exists(namespace, name, uid)` is false is
    /// deleted: its memory is forgotten here.
    pub fn repairing_other(
        &self,
        job: &impl Resource,
        exists: impl Fn(&str, &str, &str) -> bool,
    ) -> Option<String> {
        let me = uid(job);
        let mut all = self.lock();
        all.retain(|u, e| *u == me || exists(&e.namespace, &e.name, u));
        all.iter()
            .find(|(u, e)| **u != me && e.memory.repairing)
            .map(|(_, e)| format!("{}/{}", e.namespace, e.name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::build::tests::basic;

    fn named(name: &str, uid: &str) -> crate::api::DiphomaJob {
        let mut j = basic();
        j.metadata.name = Some(name.into());
        j.metadata.uid = Some(uid.into());
        j
    }

    #[test]
    fn a_deleted_job_being_repaired_is_forgotten_and_nobody_yields_to_it() {
        let (a, b) = (named("a", "uid-a"), named("b", "uid-b"));
        let m = Memories::default();
        m.put(
            &a,
            Memory {
                repairing: true,
                ..Memory::default()
            },
        );
        assert_eq!(
            m.repairing_other(&b, |_, _, _| true).as_deref(),
            Some("ml/a")
        );
        assert_eq!(m.repairing_other(&a, |_, _, _| true), None); // not itself
        // Job a is gone from the job store (or replaced by a job of its name with another UID).
        assert_eq!(
            m.repairing_other(&b, |_, n, u| n == "a" && u == "uid-a2"),
            None
        );
        assert_eq!(m.get(&a), Memory::default());
    }

    #[test]
    fn retries_count_up_and_a_success_forgets_them() {
        let (a, again) = (named("a", "uid-a"), named("a", "uid-a2"));
        let m = Memories::default();
        assert_eq!((m.failed(&a), m.failed(&a)), (1, 2));
        assert_eq!(m.failed(&again), 1); // a new job of the same name starts afresh
        m.succeeded(&a);
        assert_eq!(m.get(&a), Memory::default());
        m.failed(&a);
        m.clear(&a);
        assert_eq!(m.get(&a).retries, 0);
    }
}
