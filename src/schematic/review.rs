//! Schematic files kept in Git for review (`schematic --all --write`): the
//! canonical bytes under two comment lines naming the ID and the installer,
//! so `schematic id` on the file gives the same ID.

use super::SchematicId;
use std::path::{Path, PathBuf};

/// One node's (or `base`'s) schematic as a reviewable file.
#[derive(Debug, Clone)]
pub struct ReviewFile {
    pub name: String,
    pub id: SchematicId,
    /// The installer image reference for this schematic.
    pub installer: String,
    pub canonical: String,
}

impl ReviewFile {
    /// The file's text: ID and installer in leading comments, then the
    /// canonical bytes.
    pub fn text(&self) -> String {
        format!(
            "# imgbuild schematic for {}\n# id: {}\n# installer: {}\n{}",
            self.name, self.id, self.installer, self.canonical
        )
    }
}

/// A review file that could not be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {}", path.display())]
pub struct WriteError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Writes each file as `<dir>/<name>.yaml` (atomically, only when its text
/// changed); returns each path and whether it changed.
pub fn write_review_files(
    files: &[ReviewFile],
    dir: &Path,
) -> Result<Vec<(PathBuf, bool)>, WriteError> {
    std::fs::create_dir_all(dir).map_err(|source| WriteError {
        path: dir.to_owned(),
        source,
    })?;
    files
        .iter()
        .map(|f| {
            let path = dir.join(format!("{}.yaml", f.name));
            crate::atomic::write_if_changed(&path, f.text().as_bytes(), false)
                .map(|changed| (path.clone(), changed))
                .map_err(|source| WriteError { path, source })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_written_once_and_read_back_to_the_same_id() {
        let dir = tempfile::tempdir().unwrap();
        let canonical = "customization: {}\n".to_owned();
        let f = ReviewFile {
            name: "base".into(),
            id: super::super::id_of(&canonical),
            installer: "factory.example/metal-installer/x:v1.11.2".into(),
            canonical,
        };
        let first = write_review_files(std::slice::from_ref(&f), dir.path()).unwrap();
        assert_eq!(first, vec![(dir.path().join("base.yaml"), true)]);
        let again = write_review_files(std::slice::from_ref(&f), dir.path()).unwrap();
        assert!(!again[0].1, "unchanged text is not rewritten");
        let text = std::fs::read_to_string(dir.path().join("base.yaml")).unwrap();
        let parsed = super::super::Schematic::parse(&text).unwrap();
        assert_eq!(parsed.id().unwrap(), f.id);
        let blocked = dir.path().join("base.yaml/sub");
        let err = write_review_files(&[f], &blocked).unwrap_err();
        assert!(err.to_string().contains("base.yaml/sub"), "{err}");
    }
}
