//! The image table: which binary of this workspace a container image runs as. A pod's image
//! reference is reduced to its repository's last path segment (registry, tag and digest dropped),
//! so `ghcr.io/acme/diphoma-worker:0.1` and `diphoma-worker` both run `<bin dir>/diphoma-worker`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::Error;

/// The images every Diphoma cluster maps by default, each to the binary of the same name.
pub const DEFAULT_IMAGES: [&str; 3] = ["diphoma-operator", "diphoma-worker", "diphoma-probe"];

/// Maps image repositories (last path segment) to executables.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageTable {
    entries: BTreeMap<String, PathBuf>,
}

impl ImageTable {
    /// The default table: each of [`DEFAULT_IMAGES`] to `<bin_dir>/<name>`.
    pub fn with_defaults(bin_dir: &Path) -> Self {
        let mut t = ImageTable::default();
        for name in DEFAULT_IMAGES {
            t.insert(name, bin_dir.join(name));
        }
        t
    }

    /// Adds or replaces one entry; `repository` is reduced like a pod's image.
    pub fn insert(&mut self, repository: &str, binary: PathBuf) {
        self.entries
            .insert(repository_of(repository).to_owned(), binary);
    }

    /// Parses `NAME=PATH` (the `--image` flag).
    ///
    /// Errors: [`Error::Config`] naming `--image` when there is no `=`.
    pub fn insert_spec(&mut self, spec: &str) -> Result<(), Error> {
        let (name, path) = spec.split_once('=').ok_or_else(|| Error::Config {
            field: "--image".into(),
            message: format!("{spec:?} is not NAME=PATH"),
        })?;
        self.insert(name, PathBuf::from(path));
        Ok(())
    }

    /// The executable for a pod's image.
    ///
    /// Errors: [`Error::UnknownImage`] (naming the image and the known ones) or
    /// [`Error::MissingBinary`] (naming the path) when the mapped file does not exist.
    pub fn resolve(&self, image: &str) -> Result<PathBuf, Error> {
        let path = self
            .entries
            .get(repository_of(image))
            .ok_or_else(|| Error::UnknownImage {
                image: image.to_owned(),
                known: self.entries.keys().cloned().collect::<Vec<_>>().join(", "),
            })?;
        if !path.is_file() {
            return Err(Error::MissingBinary {
                image: image.to_owned(),
                path: path.clone(),
            });
        }
        Ok(path.clone())
    }
}

/// `registry:5000/org/name:tag@sha256:…` → `name`.
pub fn repository_of(image: &str) -> &str {
    let no_digest = image.split('@').next().unwrap_or(image);
    let last = no_digest.rsplit('/').next().unwrap_or(no_digest);
    last.split(':').next().unwrap_or(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repository_drops_registry_tag_and_digest() {
        assert_eq!(repository_of("diphoma-worker"), "diphoma-worker");
        assert_eq!(
            repository_of("localhost:5000/acme/diphoma-worker:0.1"),
            "diphoma-worker"
        );
        assert_eq!(
            repository_of("ghcr.io/x/diphoma-probe@sha256:abcd"),
            "diphoma-probe"
        );
    }

    #[test]
    fn unknown_image_names_itself_and_the_table() {
        let t = ImageTable::with_defaults(Path::new("/nonexistent"));
        let e = t.resolve("busybox:1.36").unwrap_err().to_string();
        assert!(
            e.contains("busybox:1.36") && e.contains("diphoma-worker"),
            "{e}"
        );
    }

    #[test]
    fn missing_binary_names_the_path() {
        let t = ImageTable::with_defaults(Path::new("/nonexistent"));
        let e = t.resolve("diphoma-worker:latest").unwrap_err().to_string();
        assert!(e.contains("/nonexistent/diphoma-worker"), "{e}");
    }

    #[test]
    fn image_spec_needs_a_path() {
        let mut t = ImageTable::default();
        assert!(
            t.insert_spec("sh")
                .unwrap_err()
                .to_string()
                .contains("--image")
        );
        t.insert_spec("sh=/bin/sh").unwrap();
        assert_eq!(
            t.resolve("docker.io/library/sh:5").unwrap(),
            PathBuf::from("/bin/sh")
        );
    }
}
