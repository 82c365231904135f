//! The ring-membership document the operator publishes in `<job>-ring` (one generation of the
//! ring), and the per-job key file's check. Serde types and pure validation; no I/O.

use serde::{Deserialize, Serialize};

use crate::{MAX_JOB_UID, MIN_KEY_LEN};

/// Key inside the membership ConfigMap under which [`Membership`] JSON is stored.
pub const MEMBERSHIP_KEY: &str = "membership.json";

/// Name of the membership ConfigMap of job `job`: `<job>-ring`.
pub fn membership_configmap_name(job: &str) -> String {
    format!("{job}-ring")
}

/// One generation of the ring, as published by the operator (its single writer).
///
/// Invariants (checked by [`Membership::parse`]): ranks are exactly `0..members.len()` in order,
/// pod names are unique, there is at least one member.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Membership {
    /// Generation number; strictly increases with every change.
    pub generation: u64,
    /// The job's `metadata.uid`.
    pub job_uid: String,
    /// The members, ordered by rank.
    pub members: Vec<Member>,
}

/// One member of a ring generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Member {
    /// Rank in this generation, `0..world`.
    pub rank: u32,
    /// Pod name.
    pub pod: String,
    /// Pod IP.
    pub address: std::net::IpAddr,
    /// Ring port.
    pub port: u16,
}

/// Why a membership document or a key file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ContractError {
    /// Not valid membership JSON.
    #[error("membership is not valid JSON")]
    Json(#[source] serde_json::Error),
    /// A field violates the invariants.
    #[error("membership field {field}: {problem}")]
    Invalid {
        /// JSON path of the offending field, e.g. `members[2].rank`.
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// The key is shorter than [`MIN_KEY_LEN`].
    #[error("key file holds {0} bytes, need at least {MIN_KEY_LEN}")]
    KeyTooShort(usize),
}

impl Membership {
    /// Parses and validates membership JSON.
    ///
    /// # Errors
    /// [`ContractError::Json`] on bad JSON, [`ContractError::Invalid`] naming the field when an
    /// invariant fails.
    pub fn parse(json: &str) -> Result<Membership, ContractError> {
        let m: Membership = serde_json::from_str(json).map_err(ContractError::Json)?;
        m.validate()?;
        Ok(m)
    }

    /// Checks the invariants.
    ///
    /// # Errors
    /// [`ContractError::Invalid`] naming the offending field.
    pub fn validate(&self) -> Result<(), ContractError> {
        let bad = |field: String, problem: &str| {
            Err(ContractError::Invalid {
                field,
                problem: problem.to_string(),
            })
        };
        if self.members.is_empty() {
            return bad("members".into(), "must not be empty");
        }
        if self.job_uid.is_empty() || self.job_uid.len() > MAX_JOB_UID {
            return bad("jobUid".into(), "must be 1..=128 bytes");
        }
        let mut pods = std::collections::HashSet::new();
        for (i, m) in self.members.iter().enumerate() {
            if m.rank as usize != i {
                return bad(format!("members[{i}].rank"), "ranks must be 0..n in order");
            }
            if !pods.insert(m.pod.as_str()) {
                return bad(format!("members[{i}].pod"), "duplicate pod name");
            }
            if m.port == 0 {
                return bad(format!("members[{i}].port"), "must not be 0");
            }
        }
        Ok(())
    }

    /// The rank of pod `pod` in this generation, if it is a member.
    pub fn rank_of(&self, pod: &str) -> Option<usize> {
        self.members.iter().position(|m| m.pod == pod)
    }

    /// The members' socket addresses, indexed by rank.
    pub fn addresses(&self) -> Vec<std::net::SocketAddr> {
        self.members
            .iter()
            .map(|m| std::net::SocketAddr::new(m.address, m.port))
            .collect()
    }
}

/// Validates the bytes of a key file and returns them as the HMAC key.
///
/// # Errors
/// [`ContractError::KeyTooShort`] below [`MIN_KEY_LEN`] bytes.
pub fn parse_key(bytes: Vec<u8>) -> Result<Vec<u8>, ContractError> {
    if bytes.len() < MIN_KEY_LEN {
        return Err(ContractError::KeyTooShort(bytes.len()));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn membership_roundtrip_and_validation() {
        let json = r#"{"generation":3,"jobUid":"u-1","members":[
            {"rank":0,"pod":"j-0","address":"127.0.0.2","port":29500},
            {"rank":1,"pod":"j-1","address":"127.0.0.3","port":29500}]}"#;
        let m = Membership::parse(json).unwrap();
        assert_eq!(m.rank_of("j-1"), Some(1));
        assert_eq!(m.addresses()[0].to_string(), "127.0.0.2:29500");
        assert_eq!(
            Membership::parse(&serde_json::to_string(&m).unwrap()).unwrap(),
            m
        );
        let swapped = json.replace(r#""rank":1"#, r#""rank":5"#);
        match Membership::parse(&swapped) {
            Err(ContractError::Invalid { field, .. }) => assert_eq!(field, "members[1].rank"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            Membership::parse("{"),
            Err(ContractError::Json(_))
        ));
        assert!(matches!(
            parse_key(vec![0; 5]),
            Err(ContractError::KeyTooShort(5))
        ));
        assert_eq!(membership_configmap_name("demo"), "demo-ring");
    }
}
