//! Checkpoints: the model's parameters, the optimizer's state, the step and the data-order seed
//! in one `safetensors` file, written atomically and verified by a SHA-256 stored in the file's
//! metadata.
//!
//! File `ckpt-<step, 12 digits>.safetensors` in the checkpoint directory. Format [`FORMAT`]:
//! tensors named as [`crate::model::param_names`] (f32, shapes of
//! [`crate::model::param_shapes`]); for AdamW also `adamw.m.<name>` and `adamw.v.<name>` (the
//! first and second moments, same shapes); metadata `format`, `step`, `seed`, `widths` (the
//! layer widths, comma-separated), `optimizer` (`sgd` or `adamw`), `optimizer_step` (AdamW's
//! update count; `0` for SGD), and `sha256`: the hex SHA-256 of `step`, `seed`, the number of
//! widths and each width (u64 LE each), the optimizer's name (its length as u64 LE, then its
//! bytes), `optimizer_step` (u64 LE), then every tensor's bytes in the order above.
//!
//! Identity: in Kubernetes every checkpoint belongs to one job, its [`Owner`] (namespace, name,
//! uid), written in its metadata (`job_namespace`, `job_name`, `job_uid`, outside the checksum:
//! the path holds them too) and in its path, `<root>/<namespace>/<name>/<uid>/`
//! ([`Owner::dir`]). A job writes and prunes only its own directory and loads only checkpoints
//! whose metadata names it ([`load_own`]); another job's are loaded only when asked for by name
//! ([`load_other`]: `spec.checkpoint.resumeFrom`). A suspended and resumed job keeps its uid, so
//! it resumes its own. A checkpoint without an owner (a standalone run) has none of these keys.
//!
//! Files of the previous format [`FORMAT_V1`] (digits MLP, metadata `hidden`, no optimizer
//! state) are still read: they hold SGD runs, and SGD has no state, so they resume an SGD run
//! exactly. An AdamW run refuses them (skipped with a warning, like a checkpoint of another
//! seed), since their moments are unknown.
//!
//! Writing: a temporary file in the same directory, `fsync`, `rename`, `fsync` of the directory,
//! so a crash leaves either the old set of files or the new one, never a partial checkpoint
//! under a final name. Reading: the newest file that decodes and verifies wins; others are
//! skipped with a warning, never loaded.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use sha2::{Digest, Sha256};

use crate::model::{digits_widths, param_names, param_shapes, unfuse};
use crate::optim::{OptState, OptimizerKind};

/// Value of the `format` metadata key of the checkpoints written.
pub const FORMAT: &str = "diphoma-mlp-v2";
/// The previous format (digits MLP and SGD only), still read.
pub const FORMAT_V1: &str = "diphoma-mlp-v1";
/// Checkpoints kept in the directory after a write (the newest ones).
pub const KEEP: usize = 3;

/// What a checkpoint holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// Steps committed when it was taken.
    pub step: u64,
    /// Data-order (and initialisation) seed of the run.
    pub seed: u64,
    /// Layer widths of the MLP `[input, hidden…, classes]` (fix the parameter shapes).
    pub widths: Vec<usize>,
    /// All parameters, flattened in [`param_names`] order.
    pub params: Vec<f32>,
    /// The optimizer's state, flattened in the same order.
    pub optimizer: OptState,
    /// The job it belongs to (none: a standalone run).
    pub owner: Option<Owner>,
}

/// The job a checkpoint belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// The job's namespace.
    pub namespace: String,
    /// The job's name.
    pub name: String,
    /// The job's `metadata.uid`: a job deleted and created again under the same name is
    /// another owner.
    pub uid: String,
}

/// Metadata keys of the owner's namespace, name and uid.
const OWNER_KEYS: [&str; 3] = ["job_namespace", "job_name", "job_uid"];

/// `part` when it can name one directory (not empty, `.`, `..`, nor holding a `/`); `what`
/// names it in the error.
fn path_part<'a>(what: &str, part: &'a str) -> Result<&'a str, CheckpointError> {
    if part.is_empty() || part == "." || part == ".." || part.contains(['/', '\\', '\0']) {
        return Err(CheckpointError::Invalid(format!(
            "{what} {part:?} cannot name a checkpoint directory"
        )));
    }
    Ok(part)
}

impl Owner {
    /// The owner `namespace/name` with `uid`.
    ///
    /// # Errors
    /// [`CheckpointError::Invalid`] naming the part that cannot name a directory.
    pub fn new(namespace: &str, name: &str, uid: &str) -> Result<Owner, CheckpointError> {
        Ok(Owner {
            namespace: path_part("namespace", namespace)?.to_owned(),
            name: path_part("job name", name)?.to_owned(),
            uid: path_part("job uid", uid)?.to_owned(),
        })
    }

    /// This owner's checkpoint directory under `root`: `<root>/<namespace>/<name>/<uid>`.
    pub fn dir(&self, root: &Path) -> PathBuf {
        root.join(&self.namespace).join(&self.name).join(&self.uid)
    }
}

/// Why a checkpoint file was refused.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading or writing failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// Not a valid safetensors file (e.g. truncated).
    #[error("not a valid safetensors file: {0}")]
    Format(#[from] safetensors::SafeTensorError),
    /// A metadata key or a tensor is missing or wrong.
    #[error("{0}")]
    Invalid(String),
    /// The stored checksum does not match the contents.
    #[error("checksum mismatch: the file is corrupt")]
    Checksum,
}

/// [`FORMAT_V1`]'s checksum: step, seed, hidden (u64 LE each), the tensors.
fn checksum_v1(step: u64, seed: u64, hidden: usize, tensors: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    h.update(step.to_le_bytes());
    h.update(seed.to_le_bytes());
    h.update((hidden as u64).to_le_bytes());
    for t in tensors {
        h.update(t);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// [`FORMAT`]'s checksum (see the module docs).
fn checksum_v2(
    step: u64,
    seed: u64,
    widths: &[usize],
    optimizer: &str,
    opt_step: u64,
    tensors: &[&[u8]],
) -> String {
    let mut h = Sha256::new();
    h.update(step.to_le_bytes());
    h.update(seed.to_le_bytes());
    h.update((widths.len() as u64).to_le_bytes());
    for &w in widths {
        h.update((w as u64).to_le_bytes());
    }
    h.update((optimizer.len() as u64).to_le_bytes());
    h.update(optimizer.as_bytes());
    h.update(opt_step.to_le_bytes());
    for t in tensors {
        h.update(t);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn f32_bytes(xs: &[f32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Names of the tensors of a checkpoint of an MLP of `layers` layers with `kind`, in order.
fn tensor_names(layers: usize, kind: OptimizerKind) -> Vec<String> {
    let names = param_names(layers);
    let mut all = names.clone();
    if kind == OptimizerKind::AdamW {
        for prefix in ["adamw.m.", "adamw.v."] {
            all.extend(names.iter().map(|n| format!("{prefix}{n}")));
        }
    }
    all
}

impl Checkpoint {
    /// The safetensors bytes of this checkpoint (always [`FORMAT`]).
    ///
    /// # Errors
    /// [`CheckpointError::Invalid`] when `params` or the optimizer state does not fit `widths`.
    pub fn encode(&self) -> Result<Vec<u8>, CheckpointError> {
        let shapes = param_shapes(&self.widths);
        let lens: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
        let n = lens.iter().sum::<usize>();
        if self.widths.len() < 2 || n != self.params.len() {
            return Err(CheckpointError::Invalid(format!(
                "{} parameters for widths {:?}",
                self.params.len(),
                self.widths
            )));
        }
        let mut flats: Vec<&[f32]> = vec![&self.params];
        let opt_step = match &self.optimizer {
            OptState::Sgd => 0,
            OptState::AdamW { step, m, v } => {
                if m.len() != n || v.len() != n {
                    return Err(CheckpointError::Invalid(format!(
                        "AdamW moments of {} and {} values for {n} parameters",
                        m.len(),
                        v.len()
                    )));
                }
                flats.extend([m.as_slice(), v.as_slice()]);
                *step
            }
        };
        let parts: Vec<Vec<u8>> = flats
            .iter()
            .flat_map(|f| unfuse(f, &lens).into_iter().take(lens.len()))
            .map(f32_bytes)
            .collect();
        let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let kind = self.optimizer.kind();
        let widths: Vec<String> = self.widths.iter().map(usize::to_string).collect();
        let sum = checksum_v2(
            self.step,
            self.seed,
            &self.widths,
            kind.name(),
            opt_step,
            &refs,
        );
        let owner = self.owner.iter().flat_map(|o| {
            OWNER_KEYS
                .iter()
                .zip([&o.namespace, &o.name, &o.uid])
                .map(|(k, v)| (k.to_string(), v.clone()))
        });
        let meta = HashMap::from_iter(owner.chain([
            ("format".to_string(), FORMAT.to_string()),
            ("step".to_string(), self.step.to_string()),
            ("seed".to_string(), self.seed.to_string()),
            ("widths".to_string(), widths.join(",")),
            ("optimizer".to_string(), kind.name().to_string()),
            ("optimizer_step".to_string(), opt_step.to_string()),
            ("sha256".to_string(), sum),
        ]));
        let names = tensor_names(self.widths.len() - 1, kind);
        let all_shapes = shapes.iter().cycle().take(names.len());
        let views = names
            .iter()
            .zip(all_shapes)
            .zip(&parts)
            .map(|((n, s), d)| Ok((n.as_str(), TensorView::new(Dtype::F32, s.clone(), d)?)))
            .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
        Ok(safetensors::serialize(views, Some(meta))?)
    }

    /// Decodes and verifies checkpoint bytes ([`FORMAT`] or [`FORMAT_V1`]).
    ///
    /// # Errors
    /// [`CheckpointError::Format`] for a truncated or malformed file,
    /// [`CheckpointError::Invalid`] for a missing key or tensor, a wrong shape or an unknown
    /// format or optimizer, [`CheckpointError::Checksum`] when the contents do not match the
    /// stored SHA-256.
    pub fn decode(bytes: &[u8]) -> Result<Checkpoint, CheckpointError> {
        let st = SafeTensors::deserialize(bytes)?;
        let (_, meta) = SafeTensors::read_metadata(bytes)?;
        let meta = meta
            .metadata()
            .clone()
            .ok_or_else(|| CheckpointError::Invalid("no metadata".into()))?;
        let get = |k: &str| {
            meta.get(k)
                .ok_or_else(|| CheckpointError::Invalid(format!("metadata {k} missing")))
        };
        let bad_num = |k: &str| CheckpointError::Invalid(format!("metadata {k} is not a number"));
        let num = |k: &str| get(k)?.parse::<u64>().map_err(|_| bad_num(k));
        let format = get("format")?.as_str();
        let (step, seed) = (num("step")?, num("seed")?);
        let (widths, kind, opt_step) = match format {
            FORMAT => {
                let widths = get("widths")?
                    .split(',')
                    .map(|w| w.parse::<usize>().map_err(|_| bad_num("widths")))
                    .collect::<Result<Vec<_>, _>>()?;
                let name = get("optimizer")?;
                let kind = OptimizerKind::from_name(name).ok_or_else(|| {
                    CheckpointError::Invalid(format!("unknown optimizer {name:?}"))
                })?;
                (widths, kind, num("optimizer_step")?)
            }
            FORMAT_V1 => (
                digits_widths(num("hidden")? as usize),
                OptimizerKind::Sgd,
                0,
            ),
            other => {
                return Err(CheckpointError::Invalid(format!(
                    "format {other:?}, expected {FORMAT} or {FORMAT_V1}"
                )));
            }
        };
        if widths.len() < 2 || widths.contains(&0) {
            return Err(CheckpointError::Invalid(format!("widths {widths:?}")));
        }
        let shapes = param_shapes(&widths);
        let names = tensor_names(widths.len() - 1, kind);
        let mut datas = Vec::new();
        for (name, shape) in names.iter().zip(shapes.iter().cycle()) {
            let t = st.tensor(name)?;
            if t.dtype() != Dtype::F32 || t.shape() != shape.as_slice() {
                return Err(CheckpointError::Invalid(format!(
                    "tensor {name}: {:?} {:?}, expected F32 {shape:?}",
                    t.dtype(),
                    t.shape()
                )));
            }
            datas.push(t.data());
        }
        let sum = if format == FORMAT_V1 {
            checksum_v1(step, seed, widths[1], &datas)
        } else {
            checksum_v2(step, seed, &widths, kind.name(), opt_step, &datas)
        };
        if sum != *get("sha256")? {
            return Err(CheckpointError::Checksum);
        }
        let floats = |ds: &[&[u8]]| -> Vec<f32> {
            ds.iter()
                .flat_map(|d| d.chunks_exact(4))
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect()
        };
        let k = shapes.len();
        let optimizer = match kind {
            OptimizerKind::Sgd => OptState::Sgd,
            OptimizerKind::AdamW => OptState::AdamW {
                step: opt_step,
                m: floats(&datas[k..2 * k]),
                v: floats(&datas[2 * k..]),
            },
        };
        let owner = match OWNER_KEYS.map(|k| meta.get(k)) {
            [Some(ns), Some(name), Some(uid)] => Some(Owner::new(ns, name, uid)?),
            [None, None, None] => None,
            _ => return Err(CheckpointError::Invalid("a partial job identity".into())),
        };
        Ok(Checkpoint {
            step,
            seed,
            widths,
            params: floats(&datas[..k]),
            optimizer,
            owner,
        })
    }
}

/// File name of the checkpoint of `step`.
pub fn file_name(step: u64) -> String {
    format!("ckpt-{step:012}.safetensors")
}

/// The step encoded in a checkpoint file name, if it is one.
pub fn step_of(name: &str) -> Option<u64> {
    name.strip_prefix("ckpt-")?
        .strip_suffix(".safetensors")?
        .parse()
        .ok()
}

/// Writes `c` into `dir` atomically (temporary file, fsync, rename, fsync of the directory),
/// then deletes all but the [`KEEP`] newest checkpoints. Returns the final path.
///
/// # Errors
/// [`CheckpointError::Io`] when the directory cannot be written.
pub fn write_atomic(dir: &Path, c: &Checkpoint) -> Result<PathBuf, CheckpointError> {
    let bytes = c.encode()?;
    std::fs::create_dir_all(dir)?;
    let path = dir.join(file_name(c.step));
    let tmp = dir.join(format!(".{}.tmp-{}", file_name(c.step), std::process::id()));
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, &path)?;
    std::fs::File::open(dir)?.sync_all()?;
    let mut steps = list(dir)?;
    steps.sort_unstable_by(|a, b| b.cmp(a));
    for s in steps.iter().skip(KEEP) {
        let _ = std::fs::remove_file(dir.join(file_name(*s)));
    }
    Ok(path)
}

fn list(dir: &Path) -> std::io::Result<Vec<u64>> {
    let mut steps = Vec::new();
    for e in std::fs::read_dir(dir)? {
        if let Some(s) = e?.file_name().to_str().and_then(step_of) {
            steps.push(s);
        }
    }
    Ok(steps)
}

/// The newest checkpoint in `dir` that decodes, verifies and passes `accept` (e.g. same seed
/// and model size); each refused newer file is reported on stderr and skipped. `None` when the
/// directory does not exist or holds no usable checkpoint.
///
/// # Errors
/// [`CheckpointError::Io`] when the directory exists but cannot be listed.
pub fn load_newest(
    dir: &Path,
    accept: impl Fn(&Checkpoint) -> Result<(), String>,
) -> Result<Option<(PathBuf, Checkpoint)>, CheckpointError> {
    let mut steps = match list(dir) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    steps.sort_unstable_by(|a, b| b.cmp(a));
    for s in steps {
        let path = dir.join(file_name(s));
        let r = std::fs::read(&path)
            .map_err(CheckpointError::from)
            .and_then(|b| Checkpoint::decode(&b))
            .and_then(|c| match accept(&c) {
                Ok(()) if c.step == s => Ok(c),
                Ok(()) => Err(CheckpointError::Invalid(format!(
                    "holds step {}, its name says {s}",
                    c.step
                ))),
                Err(why) => Err(CheckpointError::Invalid(why)),
            });
        match r {
            Ok(c) => return Ok(Some((path, c))),
            Err(e) => tracing::warn!("skipping checkpoint {}: {e}", path.display()),
        }
    }
    Ok(None)
}

/// The newest checkpoint of `owner` in its directory under `root` ([`Owner::dir`]) that
/// passes `accept` ([`load_newest`]); a file there that names another owner (or none) is
/// refused and skipped.
///
/// # Errors
/// As [`load_newest`].
pub fn load_own(
    root: &Path,
    owner: &Owner,
    accept: impl Fn(&Checkpoint) -> Result<(), String>,
) -> Result<Option<(PathBuf, Checkpoint)>, CheckpointError> {
    load_newest(&owner.dir(root), |c| {
        owned_by(c, owner)?;
        accept(c)
    })
}

/// The newest (highest step) checkpoint, over every incarnation (uid) of the job `name` in
/// `namespace` under `root`, that passes `accept`: what `spec.checkpoint.resumeFrom` asks for.
/// Only read, never pruned.
///
/// # Errors
/// [`CheckpointError::Invalid`] when `namespace` or `name` cannot name a directory; otherwise
/// as [`load_newest`].
pub fn load_other(
    root: &Path,
    namespace: &str,
    name: &str,
    accept: impl Fn(&Checkpoint) -> Result<(), String>,
) -> Result<Option<(PathBuf, Checkpoint)>, CheckpointError> {
    let jobs = root
        .join(path_part("namespace", namespace)?)
        .join(path_part("job name", name)?);
    let uids = match std::fs::read_dir(&jobs) {
        Ok(entries) => entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect::<Vec<_>>(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let mut newest: Option<(PathBuf, Checkpoint)> = None;
    for uid in uids {
        let Ok(owner) = Owner::new(namespace, name, &uid) else {
            continue;
        };
        if let Some(found) = load_own(root, &owner, &accept)?
            && newest.as_ref().is_none_or(|(_, c)| found.1.step > c.step)
        {
            newest = Some(found);
        }
    }
    Ok(newest)
}

/// Ok when `c` names `owner` as its owner.
fn owned_by(c: &Checkpoint, owner: &Owner) -> Result<(), String> {
    match &c.owner {
        Some(o) if o == owner => Ok(()),
        Some(o) => Err(format!(
            "it belongs to job {}/{} (uid {}), not to {}/{} (uid {})",
            o.namespace, o.name, o.uid, owner.namespace, owner.name, owner.uid
        )),
        None => Err("it names no job".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(step: u64) -> Checkpoint {
        let widths = digits_widths(4);
        let n = crate::model::count_params(&widths);
        Checkpoint {
            step,
            seed: 9,
            widths,
            params: (0..n).map(|i| i as f32 * 0.25 - 3.0).collect(),
            optimizer: OptState::Sgd,
            owner: None,
        }
    }

    fn sample_adamw(step: u64) -> Checkpoint {
        let widths = vec![5, 3, 3, 2];
        let n = crate::model::count_params(&widths);
        Checkpoint {
            step,
            seed: 9,
            widths,
            params: (0..n).map(|i| i as f32 * 0.5).collect(),
            optimizer: OptState::AdamW {
                step,
                m: (0..n).map(|i| i as f32 * -0.25).collect(),
                v: (0..n).map(|i| i as f32 * 0.125).collect(),
            },
            owner: Some(Owner::new("ns", "job", "uid-1").unwrap()),
        }
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("diphoma-ckpt-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn roundtrip() {
        let c = sample(7);
        assert_eq!(Checkpoint::decode(&c.encode().unwrap()).unwrap(), c);
        let c = sample_adamw(7);
        assert_eq!(Checkpoint::decode(&c.encode().unwrap()).unwrap(), c);
        // Moments that do not fit the widths are refused at encoding.
        let mut bad = c.clone();
        if let OptState::AdamW { m, .. } = &mut bad.optimizer {
            m.pop();
        }
        assert!(matches!(bad.encode(), Err(CheckpointError::Invalid(_))));
        assert_eq!(step_of(&file_name(42)), Some(42));
        assert_eq!(step_of("ckpt-x.safetensors"), None);
    }

    /// A file of the previous format, as the previous version wrote it.
    fn v1_bytes(c: &Checkpoint) -> Vec<u8> {
        let shapes = param_shapes(&c.widths);
        let lens: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
        let parts: Vec<Vec<u8>> = unfuse(&c.params, &lens)
            .into_iter()
            .take(lens.len())
            .map(f32_bytes)
            .collect();
        let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let meta = HashMap::from([
            ("format".to_string(), FORMAT_V1.to_string()),
            ("step".to_string(), c.step.to_string()),
            ("seed".to_string(), c.seed.to_string()),
            ("hidden".to_string(), c.widths[1].to_string()),
            (
                "sha256".to_string(),
                checksum_v1(c.step, c.seed, c.widths[1], &refs),
            ),
        ]);
        let names = param_names(2);
        let views: Vec<_> = names
            .iter()
            .zip(shapes)
            .zip(&parts)
            .map(|((n, s), d)| (n.as_str(), TensorView::new(Dtype::F32, s, d).unwrap()))
            .collect();
        safetensors::serialize(views, Some(meta)).unwrap()
    }

    #[test]
    fn previous_format_reads_as_an_sgd_checkpoint() {
        let c = sample(5);
        let bytes = v1_bytes(&c);
        assert_eq!(Checkpoint::decode(&bytes).unwrap(), c);
        let mut flipped = bytes.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(matches!(
            Checkpoint::decode(&flipped),
            Err(CheckpointError::Checksum)
        ));
    }

    #[test]
    fn corrupt_and_truncated_are_refused() {
        let bytes = sample_adamw(7).encode().unwrap();
        let mut flipped = bytes.clone();
        let last = flipped.len() - 3;
        flipped[last] ^= 0x40;
        assert!(matches!(
            Checkpoint::decode(&flipped),
            Err(CheckpointError::Checksum)
        ));
        for cut in [0, 7, bytes.len() / 2, bytes.len() - 1] {
            assert!(Checkpoint::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn newest_valid_wins_and_old_ones_are_pruned() {
        let dir = scratch("newest");
        for s in [10, 20, 30, 40] {
            write_atomic(&dir, &sample(s)).unwrap();
        }
        let mut left = list(&dir).unwrap();
        left.sort();
        assert_eq!(left, vec![20, 30, 40]);
        // The newest is truncated, the next one corrupt: the third is loaded.
        let p40 = dir.join(file_name(40));
        let b = std::fs::read(&p40).unwrap();
        std::fs::write(&p40, &b[..b.len() - 10]).unwrap();
        let p30 = dir.join(file_name(30));
        let mut b = std::fs::read(&p30).unwrap();
        let i = b.len() - 1;
        b[i] ^= 1;
        std::fs::write(&p30, &b).unwrap();
        let (p, c) = load_newest(&dir, |_| Ok(())).unwrap().unwrap();
        assert_eq!((p, c.step), (dir.join(file_name(20)), 20));
        // A checkpoint the caller refuses (another seed) is skipped too.
        assert!(
            load_newest(&dir, |_| Err("other seed".into()))
                .unwrap()
                .is_none()
        );
        assert!(
            load_newest(&dir.join("absent"), |_| Ok(()))
                .unwrap()
                .is_none()
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Two jobs of one name (the second created after the first was deleted: another uid) and a
    /// third job share one checkpoint directory.
    #[test]
    fn a_job_loads_and_prunes_only_its_own_checkpoints_unless_it_resumes_another_by_name() {
        let root = scratch("owners");
        let owned = |owner: &Owner, step| Checkpoint {
            owner: Some(owner.clone()),
            ..sample(step)
        };
        let first = Owner::new("ns", "train", "uid-a").unwrap();
        let second = Owner::new("ns", "train", "uid-b").unwrap();
        let other = Owner::new("ns", "tune", "uid-c").unwrap();
        for s in [10, 20, 30, 40, 50] {
            write_atomic(&first.dir(&root), &owned(&first, s)).unwrap();
        }
        for s in [1, 2, 3, 4] {
            write_atomic(&other.dir(&root), &owned(&other, s)).unwrap();
        }
        // Each pruned its own directory only.
        assert_eq!(list(&first.dir(&root)).unwrap().len(), KEEP);
        assert_eq!(list(&other.dir(&root)).unwrap().len(), KEEP);
        // A new job of the same name (another uid) and another job find nothing of their own.
        assert!(load_own(&root, &second, |_| Ok(())).unwrap().is_none());
        let (_, c) = load_own(&root, &other, |_| Ok(())).unwrap().unwrap();
        assert_eq!((c.step, c.owner.as_ref()), (4, Some(&other)));
        // A file copied into a job's directory that names another job is refused.
        std::fs::create_dir_all(second.dir(&root)).unwrap();
        std::fs::copy(
            first.dir(&root).join(file_name(50)),
            second.dir(&root).join(file_name(50)),
        )
        .unwrap();
        assert!(load_own(&root, &second, |_| Ok(())).unwrap().is_none());
        // resumeFrom: the newest checkpoint of any incarnation of the named job.
        let (p, c) = load_other(&root, "ns", "train", |_| Ok(()))
            .unwrap()
            .unwrap();
        assert_eq!((p, c.step), (first.dir(&root).join(file_name(50)), 50));
        assert_eq!(c.owner, Some(first.clone()));
        assert!(
            load_other(&root, "ns", "absent", |_| Ok(()))
                .unwrap()
                .is_none()
        );
        assert!(load_other(&root, "ns", "..", |_| Ok(())).is_err());
        assert!(Owner::new("ns", "a/b", "u").is_err());
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn the_owner_roundtrips_in_the_metadata() {
        let c = sample_adamw(3);
        assert_eq!(Checkpoint::decode(&c.encode().unwrap()).unwrap(), c);
        assert_eq!(
            Checkpoint::decode(&sample(3).encode().unwrap())
                .unwrap()
                .owner,
            None
        );
    }
}
