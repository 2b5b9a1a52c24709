//! Label selectors as the API server reads a list's `labelSelector`
//! (kubernetes/kubernetes `staging/src/k8s.io/apimachinery/pkg/labels/
//! selector.go` `Parse`): requirements joined by `,`, each `key` (exists),
//! `!key` (does not exist), `key=value`, `key==value`, `key!=value`,
//! `key in (a,b)`, `key notin (a,b)`, `key>N`, `key<N`; spaces around the
//! tokens are allowed. `!=` and `notin` also select objects without the
//! label (`Requirement.Matches`). A selector that does not parse is a 400
//! (`get.go` `ListResource`: `metainternalversion.ParseListOptions`).
//!
//! Simplified: keys and values are not checked against the label syntax
//! (`validateLabelKey`/`validateLabelValue`); the error texts keep
//! selector.go's prefix, not its token positions.

use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    Not,
    Eq,
    DoubleEq,
    NotEq,
    Open,
    Close,
    Comma,
    Gt,
    Lt,
}

/// One requirement of a selector.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Requirement {
    Exists(String),
    DoesNotExist(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Gt(String, i64),
    Lt(String, i64),
}

fn tokens(s: &str) -> Vec<Token> {
    let mut out = Vec::new();
    let chars: Vec<char> = s.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let (t, step) = match c {
            ' ' | '\t' | '\n' => {
                i += 1;
                continue;
            }
            '!' if next == Some('=') => (Token::NotEq, 2),
            '!' => (Token::Not, 1),
            '=' if next == Some('=') => (Token::DoubleEq, 2),
            '=' => (Token::Eq, 1),
            '(' => (Token::Open, 1),
            ')' => (Token::Close, 1),
            ',' => (Token::Comma, 1),
            '>' => (Token::Gt, 1),
            '<' => (Token::Lt, 1),
            _ => {
                let start = i;
                while i < chars.len() && !" \t\n!=(),<>".contains(chars[i]) {
                    i += 1;
                }
                out.push(Token::Ident(chars[start..i].iter().collect()));
                continue;
            }
        };
        out.push(t);
        i += step;
    }
    out
}

/// Parses `labelSelector` (empty: selects everything).
pub(crate) fn parse(selector: &str) -> Result<Vec<Requirement>, String> {
    let t = tokens(selector);
    let mut out = Vec::new();
    let mut i = 0;
    let err = |what: String| format!("unable to parse requirement: {what}");
    if t.is_empty() {
        return Ok(out);
    }
    loop {
        let requirement = match t.get(i) {
            Some(Token::Not) => match t.get(i + 1) {
                Some(Token::Ident(k)) => {
                    i += 2;
                    Requirement::DoesNotExist(k.clone())
                }
                other => return Err(err(format!("found {other:?}, expected: identifier"))),
            },
            Some(Token::Ident(k)) => {
                let key = k.clone();
                i += 1;
                match t.get(i) {
                    None | Some(Token::Comma) => Requirement::Exists(key),
                    Some(op @ (Token::Eq | Token::DoubleEq | Token::NotEq)) => {
                        i += 1;
                        let value = match t.get(i) {
                            Some(Token::Ident(v)) => {
                                i += 1;
                                v.clone()
                            }
                            None | Some(Token::Comma) => String::new(),
                            other => {
                                return Err(err(format!(
                                    "found {other:?}, expected: identifier for value"
                                )));
                            }
                        };
                        if *op == Token::NotEq {
                            Requirement::NotIn(key, vec![value])
                        } else {
                            Requirement::In(key, vec![value])
                        }
                    }
                    Some(Token::Ident(op)) if op == "in" || op == "notin" => {
                        let negated = op == "notin";
                        i += 1;
                        if t.get(i) != Some(&Token::Open) {
                            return Err(err(format!("found {:?}, expected: '('", t.get(i))));
                        }
                        i += 1;
                        let mut values = Vec::new();
                        loop {
                            match t.get(i) {
                                Some(Token::Ident(v)) => {
                                    values.push(v.clone());
                                    i += 1;
                                }
                                Some(Token::Comma | Token::Close) => values.push(String::new()),
                                other => {
                                    return Err(err(format!(
                                        "found {other:?}, expected: ',', ')' or identifier"
                                    )));
                                }
                            }
                            match t.get(i) {
                                Some(Token::Comma) => i += 1,
                                Some(Token::Close) => {
                                    i += 1;
                                    break;
                                }
                                other => {
                                    return Err(err(format!(
                                        "found {other:?}, expected: ',' or ')'"
                                    )));
                                }
                            }
                        }
                        if negated {
                            Requirement::NotIn(key, values)
                        } else {
                            Requirement::In(key, values)
                        }
                    }
                    Some(op @ (Token::Gt | Token::Lt)) => {
                        let gt = *op == Token::Gt;
                        i += 1;
                        let n = match t.get(i) {
                            Some(Token::Ident(v)) => v.parse::<i64>().map_err(|_| {
                                err(format!(
                                    "for 'Gt', 'Lt' operators, the value must be an integer: {v:?}"
                                ))
                            })?,
                            other => {
                                return Err(err(format!("found {other:?}, expected: integer")));
                            }
                        };
                        i += 1;
                        if gt {
                            Requirement::Gt(key, n)
                        } else {
                            Requirement::Lt(key, n)
                        }
                    }
                    other => {
                        return Err(err(format!(
                            "found {other:?}, expected: in, notin, =, ==, !=, gt, lt"
                        )));
                    }
                }
            }
            other => return Err(err(format!("found {other:?}, expected: !, identifier"))),
        };
        out.push(requirement);
        match t.get(i) {
            None => return Ok(out),
            Some(Token::Comma) if i + 1 < t.len() => i += 1,
            other => {
                return Err(err(format!(
                    "found {other:?}, expected: ',' or 'end of string'"
                )));
            }
        }
    }
}

/// Whether `object`'s `metadata.labels` meet every requirement.
pub(crate) fn matches(requirements: &[Requirement], object: &Value) -> bool {
    let labels = &object["metadata"]["labels"];
    let label = |k: &str| labels[k].as_str();
    requirements.iter().all(|r| match r {
        Requirement::Exists(k) => label(k).is_some(),
        Requirement::DoesNotExist(k) => label(k).is_none(),
        Requirement::In(k, vs) => label(k).is_some_and(|v| vs.iter().any(|x| x == v)),
        Requirement::NotIn(k, vs) => label(k).is_none_or(|v| vs.iter().all(|x| x != v)),
        Requirement::Gt(k, n) => label(k)
            .and_then(|v| v.parse::<i64>().ok())
            .is_some_and(|v| v > *n),
        Requirement::Lt(k, n) => label(k)
            .and_then(|v| v.parse::<i64>().ok())
            .is_some_and(|v| v < *n),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn with(labels: Value) -> Value {
        json!({"metadata": {"labels": labels}})
    }

    fn selects(sel: &str, labels: Value) -> bool {
        matches(&parse(sel).unwrap(), &with(labels))
    }

    /// selector.go's forms, as talosctl and kubectl send them.
    #[test]
    fn equality_existence_and_set_forms_select_as_the_api_server_does() {
        let proxy = json!({"k8s-app": "kube-proxy", "tier": "node"});
        assert!(
            selects("k8s-app = kube-proxy", proxy.clone()),
            "talosctl's spaces"
        );
        assert!(selects("k8s-app==kube-proxy,tier", proxy.clone()));
        assert!(!selects("k8s-app=kube-dns", proxy.clone()));
        assert!(selects("!missing", proxy.clone()));
        assert!(!selects("!tier", proxy.clone()));
        assert!(!selects("missing", proxy.clone()));
        assert!(
            selects("missing!=x", proxy.clone()),
            "!= selects the unlabelled"
        );
        assert!(!selects("tier!=node", proxy.clone()));
        assert!(selects("tier in (control, node)", proxy.clone()));
        assert!(!selects("tier notin (node)", proxy.clone()));
        assert!(selects("missing notin (node)", proxy.clone()));
        assert!(selects("", proxy.clone()), "empty selects everything");
        assert!(selects("k=", json!({"k": ""})));
        assert!(selects("n>3,n<5", json!({"n": "4"})));
    }

    #[test]
    fn a_selector_that_does_not_parse_is_refused() {
        for bad in ["=x", "a in b", "a in (b", "a b", "a,", "!", "n>x"] {
            let e = parse(bad).unwrap_err();
            assert!(e.starts_with("unable to parse requirement: "), "{bad}: {e}");
        }
    }
}
