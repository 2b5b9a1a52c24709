//! A node that lies in what it says: a compromised or impostor node
//! answers `machine.proto` strings with any bytes it likes, and Talos's
//! client API checks none of them.
//! With `--hostile-text TEXT` every etcd member hostname (talos
//! `internal/app/machined/pkg/system/services/etcd.go` reports the
//! member's name) and every non-empty service health message
//! (`internal/app/machined/pkg/system/health`) this simulator reports
//! carries TEXT after what it would say. An honest run never sets it.

/// What the node says: `honest`, then the hostile text when one is set.
pub(crate) fn said(hostile: Option<&str>, honest: &str) -> String {
    match hostile {
        Some(text) if !honest.is_empty() => format!("{honest}{text}"),
        _ => honest.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_hostile_node_adds_text_and_never_to_an_empty_message() {
        assert_eq!(said(None, "cp-01"), "cp-01");
        assert_eq!(said(Some("\r\nx"), "cp-01"), "cp-01\r\nx");
        assert_eq!(said(Some("\r\nx"), ""), "");
    }
}
