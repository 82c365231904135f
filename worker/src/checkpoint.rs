//! Checkpoints: the model's parameters, the step and the data-order seed in one `safetensors`
//! file, written atomically and verified by a SHA-256 stored in the file's metadata.
//!
//! File `ckpt-<step, 12 digits>.safetensors` in the checkpoint directory; tensors named as
//! [`crate::model::PARAM_NAMES`] (f32, shapes of [`crate::model::param_shapes`]); metadata
//! `format` = [`FORMAT`], `step`, `seed`, `hidden`, and `sha256`: the hex SHA-256 of `step`,
//! `seed`, `hidden` (u64 LE each) followed by every tensor's bytes in order. Plain SGD has no
//! optimizer state, so nothing else is needed to resume exactly.
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

use crate::model::{PARAM_NAMES, param_shapes};

/// Value of the `format` metadata key.
pub const FORMAT: &str = "diphoma-mlp-v1";
/// Checkpoints kept in the directory after a write (the newest ones).
pub const KEEP: usize = 3;

/// What a checkpoint holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// Steps committed when it was taken.
    pub step: u64,
    /// Data-order (and initialisation) seed of the run.
    pub seed: u64,
    /// Hidden units of the MLP (fixes the parameter shapes).
    pub hidden: usize,
    /// All parameters, flattened in [`PARAM_NAMES`] order.
    pub params: Vec<f32>,
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

fn checksum(step: u64, seed: u64, hidden: usize, tensors: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    h.update(step.to_le_bytes());
    h.update(seed.to_le_bytes());
    h.update((hidden as u64).to_le_bytes());
    for t in tensors {
        h.update(t);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn f32_bytes(xs: &[f32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

impl Checkpoint {
    /// The safetensors bytes of this checkpoint.
    ///
    /// # Errors
    /// [`CheckpointError::Invalid`] when `params` does not fit `hidden`.
    pub fn encode(&self) -> Result<Vec<u8>, CheckpointError> {
        let shapes = param_shapes(self.hidden);
        let lens: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
        if lens.iter().sum::<usize>() != self.params.len() {
            return Err(CheckpointError::Invalid(format!(
                "{} parameters for hidden {}",
                self.params.len(),
                self.hidden
            )));
        }
        let parts: Vec<Vec<u8>> = crate::model::unfuse(&self.params, &lens)
            .into_iter()
            .take(lens.len())
            .map(f32_bytes)
            .collect();
        let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let meta = HashMap::from([
            ("format".to_string(), FORMAT.to_string()),
            ("step".to_string(), self.step.to_string()),
            ("seed".to_string(), self.seed.to_string()),
            ("hidden".to_string(), self.hidden.to_string()),
            (
                "sha256".to_string(),
                checksum(self.step, self.seed, self.hidden, &refs),
            ),
        ]);
        let views = PARAM_NAMES
            .iter()
            .zip(shapes)
            .zip(&parts)
            .map(|((n, s), d)| Ok((*n, TensorView::new(Dtype::F32, s, d)?)))
            .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
        Ok(safetensors::serialize(views, Some(meta))?)
    }

    /// Decodes and verifies checkpoint bytes.
    ///
    /// # Errors
    /// [`CheckpointError::Format`] for a truncated or malformed file,
    /// [`CheckpointError::Invalid`] for a missing key or tensor or a wrong shape,
    /// [`CheckpointError::Checksum`] when the contents do not match the stored SHA-256.
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
        let num = |k: &str| {
            get(k)?
                .parse::<u64>()
                .map_err(|_| CheckpointError::Invalid(format!("metadata {k} is not a number")))
        };
        if get("format")? != FORMAT {
            return Err(CheckpointError::Invalid(format!(
                "format {:?}, expected {FORMAT}",
                get("format")?
            )));
        }
        let (step, seed, hidden) = (num("step")?, num("seed")?, num("hidden")? as usize);
        let mut datas = Vec::new();
        for (name, shape) in PARAM_NAMES.iter().zip(param_shapes(hidden)) {
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
        if checksum(step, seed, hidden, &datas) != *get("sha256")? {
            return Err(CheckpointError::Checksum);
        }
        let params = datas
            .iter()
            .flat_map(|d| d.chunks_exact(4))
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        Ok(Checkpoint {
            step,
            seed,
            hidden,
            params,
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
            Err(e) => eprintln!(
                "diphoma-worker: warning: skipping checkpoint {}: {e}",
                path.display()
            ),
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(step: u64) -> Checkpoint {
        let n: usize = param_shapes(4)
            .iter()
            .map(|s| s.iter().product::<usize>())
            .sum();
        Checkpoint {
            step,
            seed: 9,
            hidden: 4,
            params: (0..n).map(|i| i as f32 * 0.25 - 3.0).collect(),
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
        assert_eq!(step_of(&file_name(42)), Some(42));
        assert_eq!(step_of("ckpt-x.safetensors"), None);
    }

    #[test]
    fn corrupt_and_truncated_are_refused() {
        let bytes = sample(7).encode().unwrap();
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
}
