//! The training data and its order: loading the scikit-learn `digits` set, the seeded synthetic
//! set of the bandwidth model ([`synthetic`]), the deterministic test split, the seeded per-epoch
//! permutation, and the split of a global batch over ranks.
//!
//! Everything but [`load_digits`] is a pure function, so the data order of step `s` is the same
//! whatever the world size, the generation or the process that computes it.

use std::ops::Range;
use std::path::{Path, PathBuf};

/// Pixels per image (8×8).
pub const FEATURES: usize = 64;
/// Number of classes (digits 0–9).
pub const CLASSES: usize = 10;
/// Largest pixel value of the digits set; pixels are scaled by its inverse into `[0, 1]`.
pub const PIXEL_MAX: f32 = 16.0;
/// Every `TEST_EVERY`-th sample (index ≡ 0 mod 5) is held out for testing: 20 %.
pub const TEST_EVERY: usize = 5;

/// Labelled samples: `x` is row-major `len × features`, `y` the class labels. For the digits
/// set `features` is [`FEATURES`], pixels are in `[0, 1]` and labels in `0..CLASSES`.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// Inputs, `len × features`, row-major.
    pub x: Vec<f32>,
    /// Labels, `len`.
    pub y: Vec<u32>,
    /// Input values per sample (the row length of `x`).
    pub features: usize,
}

/// Why the data file could not be used. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file could not be read or is not gzip.
    #[error("data file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// A line is not 64 pixels in `0..=16` followed by a label in `0..=9`.
    #[error("data file {path}, line {line}: {problem}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// 1-based line number (0 for the file as a whole).
        line: usize,
        /// What is wrong with it.
        problem: String,
    },
}

/// Reads the gzip-compressed digits CSV at `path` (64 pixel columns in `0..=16`, then the label).
///
/// # Errors
/// [`DataError::Io`] when the file is missing, unreadable or not gzip; [`DataError::Malformed`]
/// naming the line when a row is wrong or the file holds no sample.
pub fn load_digits(path: &Path) -> Result<Dataset, DataError> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let f = std::fs::File::open(path).map_err(io)?;
    decode_digits(f, path)
}

/// The digits set shipped in the repository (`data/digits.csv.gz`, 57 KB), compiled into the
/// binary so that a worker image needs no data file and no path refers to the build machine.
pub const EMBEDDED_DIGITS: &[u8] = include_bytes!("../../data/digits.csv.gz");

/// Name of [`EMBEDDED_DIGITS`] in errors and logs.
pub const EMBEDDED_DIGITS_NAME: &str = "<embedded data/digits.csv.gz>";

/// [`load_digits`] of [`EMBEDDED_DIGITS`]: the 1,797 samples of the scikit-learn digits set.
///
/// # Errors
/// As [`load_digits`] (only if the embedded file were corrupt).
pub fn embedded_digits() -> Result<Dataset, DataError> {
    decode_digits(EMBEDDED_DIGITS, Path::new(EMBEDDED_DIGITS_NAME))
}

/// Gunzips `gz` and parses it; `path` only names the source in errors.
fn decode_digits(gz: impl std::io::Read, path: &Path) -> Result<Dataset, DataError> {
    use std::io::Read;
    let mut text = String::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_string(&mut text)
        .map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    parse_digits_csv(&text, path)
}

/// Parses the decompressed CSV text (see [`load_digits`]); `path` only names the file in errors.
///
/// # Errors
/// [`DataError::Malformed`] naming the first bad line, or line 0 when there are no rows.
pub fn parse_digits_csv(text: &str, path: &Path) -> Result<Dataset, DataError> {
    let mut d = Dataset {
        x: Vec::new(),
        y: Vec::new(),
        features: FEATURES,
    };
    for (i, line) in text.lines().enumerate() {
        let bad = |problem: String| DataError::Malformed {
            path: path.to_path_buf(),
            line: i + 1,
            problem,
        };
        if line.trim().is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(',').collect();
        if fields.len() != FEATURES + 1 {
            return Err(bad(format!(
                "{} columns, expected {} pixels and a label",
                fields.len(),
                FEATURES + 1
            )));
        }
        for (c, f) in fields.iter().enumerate() {
            let v: f32 = f
                .trim()
                .parse()
                .map_err(|_| bad(format!("column {}: {f:?} is not a number", c + 1)))?;
            let max = if c == FEATURES { 9.0 } else { PIXEL_MAX };
            if !(0.0..=max).contains(&v) || v.fract() != 0.0 {
                return Err(bad(format!(
                    "column {}: {f:?} is not an integer in 0..={max}",
                    c + 1
                )));
            }
            if c == FEATURES {
                d.y.push(v as u32);
            } else {
                d.x.push(v / PIXEL_MAX);
            }
        }
    }
    if d.y.is_empty() {
        return Err(DataError::Malformed {
            path: path.to_path_buf(),
            line: 0,
            problem: "no samples".into(),
        });
    }
    Ok(d)
}

impl Dataset {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.y.len()
    }

    /// True when there is no sample.
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }

    /// The deterministic split `(train, test)`: sample `i` is a test sample iff
    /// `i % TEST_EVERY == 0` (digits are roughly cyclic by class in the file, so each class is
    /// held out in proportion).
    pub fn split(&self) -> (Dataset, Dataset) {
        let (test, train): (Vec<usize>, Vec<usize>) =
            (0..self.len()).partition(|i| i % TEST_EVERY == 0);
        (self.gather(&train), self.gather(&test))
    }

    /// The samples at `idx`, in that order.
    pub fn gather(&self, idx: &[usize]) -> Dataset {
        let f = self.features;
        let mut x = Vec::with_capacity(idx.len() * f);
        for &i in idx {
            x.extend_from_slice(&self.x[i * f..(i + 1) * f]);
        }
        Dataset {
            x,
            y: idx.iter().map(|&i| self.y[i]).collect(),
            features: f,
        }
    }
}

/// A seeded synthetic classification set of `n` samples (the data of the bandwidth model):
/// `classes` centres drawn uniformly from `[-1, 1]^features`, and sample `i` is the centre of a
/// uniformly drawn label plus independent noise uniform in `[-2, 2]` on every input, all from
/// one [`SplitMix64`] seeded from `seed`. The same arguments give the same set in every
/// process. Learnable (the centres are far apart in many dimensions) but not linearly trivial
/// at the first step, so the loss curve is a real one.
///
/// # Panics
/// When `classes` is 0 or does not fit a `u32`.
pub fn synthetic(n: usize, features: usize, classes: usize, seed: u64) -> Dataset {
    let classes32 = u32::try_from(classes).expect("classes fit u32");
    assert!(classes32 > 0, "at least one class");
    let mut rng = SplitMix64::new(seed ^ 0x7379_6E74_6865_7469);
    let centres: Vec<f32> = (0..classes * features)
        .map(|_| rng.next_f32() * 2.0 - 1.0)
        .collect();
    let mut x = Vec::with_capacity(n * features);
    let mut y = Vec::with_capacity(n);
    for _ in 0..n {
        let c = rng.below(classes);
        y.push(c as u32);
        x.extend(
            centres[c * features..(c + 1) * features]
                .iter()
                .map(|m| m + (rng.next_f32() * 4.0 - 2.0)),
        );
    }
    Dataset { x, y, features }
}

/// SplitMix64: a tiny, fully specified generator, so data order and initial weights never
/// depend on a library's choice of algorithm.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 24 random bits.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in `0..n` (`n > 0`; the modulo bias is below 2⁻⁴⁰ for data-set sizes).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// The permutation of `0..n` used in epoch `epoch` (Fisher–Yates driven by SplitMix64 seeded
/// from `seed` and `epoch`).
pub fn permutation(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut rng = SplitMix64::new(seed ^ epoch.wrapping_mul(0xD1B5_4A32_D192_ED03));
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        p.swap(i, rng.below(i + 1));
    }
    p
}

/// The sample indices of global step `step`: positions `[step·batch, (step+1)·batch)` of the
/// concatenation of the per-epoch permutations of `0..n`. Independent of the world size.
pub fn step_indices(n: usize, batch: usize, seed: u64, step: u64) -> Vec<usize> {
    let mut out = Vec::with_capacity(batch);
    let mut pos = step * batch as u64;
    let end = pos + batch as u64;
    let mut cached: Option<(u64, Vec<usize>)> = None;
    while pos < end && n > 0 {
        let epoch = pos / n as u64;
        if cached.as_ref().is_none_or(|(e, _)| *e != epoch) {
            cached = Some((epoch, permutation(n, seed, epoch)));
        }
        let perm = &cached.as_ref().expect("just set").1;
        out.push(perm[(pos % n as u64) as usize]);
        pos += 1;
    }
    out
}

/// The part of a batch of `len` samples that rank `rank` of `world` processes: contiguous
/// ranges, the first `len % world` ranks one sample longer. Ranges of all ranks tile `0..len`;
/// ranks beyond `len` get an empty range.
pub fn shard(len: usize, world: usize, rank: usize) -> Range<usize> {
    let (q, r) = (len / world, len % world);
    let start = rank * q + rank.min(r);
    start..start + q + usize::from(rank < r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_digits_are_the_shipped_file() {
        let file =
            load_digits(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/digits.csv.gz"))
                .unwrap();
        let embedded = embedded_digits().unwrap();
        assert_eq!(embedded.len(), 1797);
        assert_eq!(embedded.x, file.x);
        assert_eq!(embedded.y, file.y);
    }

    #[test]
    fn shards_tile_the_batch() {
        for len in [0, 1, 7, 64] {
            for world in 1..=9 {
                let mut next = 0;
                for r in 0..world {
                    let s = shard(len, world, r);
                    assert_eq!(s.start, next);
                    assert!(s.len() <= len.div_ceil(world));
                    next = s.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn permutation_is_seeded_and_complete() {
        let p = permutation(100, 7, 0);
        let mut s = p.clone();
        s.sort();
        assert_eq!(s, (0..100).collect::<Vec<_>>());
        assert_eq!(p, permutation(100, 7, 0));
        assert_ne!(p, permutation(100, 7, 1));
        assert_ne!(p, permutation(100, 8, 0));
    }

    #[test]
    fn steps_walk_through_epochs() {
        let (n, b) = (10, 4);
        let all: Vec<usize> = (0..5).flat_map(|s| step_indices(n, b, 3, s)).collect();
        assert_eq!(all.len(), 20);
        assert_eq!(&all[..10], &permutation(n, 3, 0)[..]);
        assert_eq!(&all[10..], &permutation(n, 3, 1)[..]);
    }

    #[test]
    fn csv_errors_name_file_and_line() {
        let p = Path::new("d.csv.gz");
        let row = |label: &str| format!("{}{label}\n", "1,".repeat(FEATURES));
        let ok = parse_digits_csv(&(row("3") + &row("9")), p).unwrap();
        assert_eq!(ok.y, vec![3, 9]);
        assert_eq!(ok.x[0], 1.0 / 16.0);
        let e = parse_digits_csv(&(row("3") + &row("10")), p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("d.csv.gz") && e.contains("line 2"), "{e}");
        let e = parse_digits_csv("1,2,3\n", p).unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("columns"), "{e}");
        assert!(parse_digits_csv("", p).is_err());
    }

    #[test]
    fn split_holds_out_a_fifth() {
        let d = Dataset {
            x: (0..10 * FEATURES).map(|i| i as f32).collect(),
            y: (0..10).collect(),
            features: FEATURES,
        };
        let (train, test) = d.split();
        assert_eq!(test.y, vec![0, 5]);
        assert_eq!(train.len(), 8);
        assert_eq!(train.x[..FEATURES], d.x[FEATURES..2 * FEATURES]);
    }

    #[test]
    fn synthetic_set_is_seeded_and_shaped() {
        let d = synthetic(50, 7, 3, 11);
        assert_eq!((d.len(), d.x.len(), d.features), (50, 350, 7));
        assert!(d.y.iter().all(|&c| c < 3));
        assert!(d.x.iter().all(|v| (-3.0..3.0).contains(v)));
        assert_eq!(d, synthetic(50, 7, 3, 11));
        assert_ne!(d, synthetic(50, 7, 3, 12));
        // Every class occurs: a real classification problem.
        assert!((0..3).all(|c| d.y.contains(&c)));
    }
}
