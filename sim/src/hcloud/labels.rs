//! Hetzner Cloud labels: the validity rules for keys and values and the
//! label selector query language, as the API reference's "Labels" and
//! "Label Selector" sections describe them (vendored OpenAPI document,
//! `info.description`).

use std::collections::BTreeMap;

/// One term of a selector; a selector matches when every term does.
#[derive(Debug, PartialEq)]
pub enum Term {
    Eq(String, String),
    Ne(String, String),
    Has(String),
    Lacks(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// Parses `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`,
/// joined by commas (commas inside parentheses belong to the set).
pub fn parse_selector(s: &str) -> Result<Vec<Term>, String> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if depth < 0 {
            return Err(format!("unbalanced ')' in label selector {s:?}"));
        }
    }
    if depth != 0 {
        return Err(format!("unbalanced '(' in label selector {s:?}"));
    }
    parts.push(&s[start..]);
    parts.into_iter().map(parse_term).collect()
}

fn parse_term(t: &str) -> Result<Term, String> {
    let t = t.trim();
    let bad = || format!("invalid label selector term {t:?}");
    if t.is_empty() {
        return Err(bad());
    }
    if let Some((k, v)) = t.split_once("!=") {
        return Ok(Term::Ne(key(k).ok_or_else(bad)?, v.trim().into()));
    }
    if let Some((k, v)) = t.split_once("==").or_else(|| t.split_once('=')) {
        return Ok(Term::Eq(key(k).ok_or_else(bad)?, v.trim().into()));
    }
    if let Some(k) = t.strip_prefix('!') {
        return Ok(Term::Lacks(key(k).ok_or_else(bad)?));
    }
    if let Some(open) = t.find('(') {
        let (head, set) = (&t[..open], &t[open..]);
        let set = set
            .strip_prefix('(')
            .and_then(|s| s.strip_suffix(')'))
            .ok_or_else(bad)?;
        let values = set.split(',').map(|v| v.trim().to_owned()).collect();
        let mut words = head.split_whitespace();
        let (k, op) = (words.next().ok_or_else(bad)?, words.next().ok_or_else(bad)?);
        if words.next().is_some() {
            return Err(bad());
        }
        let k = key(k).ok_or_else(bad)?;
        return match op {
            "in" => Ok(Term::In(k, values)),
            "notin" => Ok(Term::NotIn(k, values)),
            _ => Err(bad()),
        };
    }
    Ok(Term::Has(key(t).ok_or_else(bad)?))
}

fn key(k: &str) -> Option<String> {
    let k = k.trim();
    (!k.is_empty() && !k.contains(char::is_whitespace)).then(|| k.to_owned())
}

/// Whether `labels` satisfy every term.
pub fn matches(terms: &[Term], labels: &BTreeMap<String, String>) -> bool {
    terms.iter().all(|t| match t {
        Term::Eq(k, v) => labels.get(k) == Some(v),
        Term::Ne(k, v) => labels.get(k) != Some(v),
        Term::Has(k) => labels.contains_key(k),
        Term::Lacks(k) => !labels.contains_key(k),
        Term::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
        Term::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
    })
}

/// A name segment or value: ≤ 63 characters, alphanumeric at both ends,
/// `-_.` and alphanumerics between (values may also be empty).
fn segment_ok(s: &str) -> bool {
    let alnum = |c: char| c.is_ascii_alphanumeric();
    s.len() <= 63
        && s.chars().all(|c| alnum(c) || "-_.".contains(c))
        && s.starts_with(alnum)
        && s.ends_with(alnum)
}

/// The first broken rule of a label set, naming the key (values are named
/// too: labels are not secret).
pub fn check_labels(labels: &BTreeMap<String, String>) -> Result<(), String> {
    for (k, v) in labels {
        let name = match k.rsplit_once('/') {
            Some((prefix, name)) => {
                let dns = prefix.len() <= 253
                    && prefix.split('.').all(|l| {
                        !l.is_empty()
                            && l.len() <= 63
                            && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                    });
                if !dns {
                    return Err(format!("label key {k:?}: prefix is not a DNS subdomain"));
                }
                if prefix == "hetzner.cloud" {
                    return Err(format!(
                        "label key {k:?}: prefix hetzner.cloud/ is reserved"
                    ));
                }
                name
            }
            None => k.as_str(),
        };
        if !segment_ok(name) {
            return Err(format!("label key {k:?} is invalid"));
        }
        if !v.is_empty() && !segment_ok(v) {
            return Err(format!("label value {v:?} of key {k:?} is invalid"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn parses_every_form() {
        let t = parse_selector("a=1,b==2,c!=3,d,!e,f in (x, y),g notin (z)").unwrap();
        assert_eq!(
            t,
            vec![
                Term::Eq("a".into(), "1".into()),
                Term::Eq("b".into(), "2".into()),
                Term::Ne("c".into(), "3".into()),
                Term::Has("d".into()),
                Term::Lacks("e".into()),
                Term::In("f".into(), vec!["x".into(), "y".into()]),
                Term::NotIn("g".into(), vec!["z".into()]),
            ]
        );
    }

    #[test]
    fn refuses_broken_selectors() {
        for s in ["", "a=1,", "k in (a,b", "k in a,b)", "k within (a)", "a b"] {
            assert!(parse_selector(s).is_err(), "{s:?} was accepted");
        }
    }

    #[test]
    fn matching() {
        let l = labels(&[("os", "talos"), ("arch", "amd64")]);
        let m = |s: &str| matches(&parse_selector(s).unwrap(), &l);
        assert!(m("os=talos,arch=amd64"));
        assert!(!m("os=talos,arch=arm64"));
        assert!(m("arch!=arm64") && !m("arch!=amd64"));
        assert!(m("os") && !m("team"));
        assert!(m("!team") && !m("!os"));
        assert!(m("arch in (arm64,amd64)") && !m("arch in (arm64)"));
        assert!(m("arch notin (arm64)") && !m("arch notin (amd64)"));
        assert!(m("team notin (infra)"), "a missing key is not in any set");
        assert!(m("team!=infra"));
    }

    #[test]
    fn label_rules() {
        assert!(check_labels(&labels(&[("example.com/my", "label"), ("k", "")])).is_ok());
        assert!(check_labels(&labels(&[("hetzner.cloud/x", "1")])).is_err());
        assert!(check_labels(&labels(&[("k", &"a".repeat(64))])).is_err());
        assert!(check_labels(&labels(&[("k", &"a".repeat(63))])).is_ok());
        assert!(check_labels(&labels(&[("-k", "v")])).is_err());
        assert!(check_labels(&labels(&[("k", "v-")])).is_err());
    }
}
