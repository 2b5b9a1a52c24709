//! Query strings as the API reads them: label selectors, pagination
//! (`page`, `per_page`, `meta.pagination`) and `sort`, per docs.hetzner.cloud.

use super::labels;
use super::labels::Term;
use super::state::*;
use serde_json::{Value, json};

/// A request's query: repeated keys kept in order.
pub(crate) struct Query(Vec<(String, String)>);

pub(crate) fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = s
            .get(i + 1..i + 3)
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (b[i], hex) {
            (b'+', _) => out.push(b' '),
            (b'%', Some(v)) => {
                out.push(v);
                i += 2;
            }
            (c, _) => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl Query {
    pub(crate) fn parse(q: &str) -> Query {
        Query(
            q.split('&')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap_or((p, ""));
                    (percent_decode(k), percent_decode(v))
                })
                .collect(),
        )
    }

    pub(crate) fn all(&self, key: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    pub(crate) fn one(&self, key: &str) -> Option<&str> {
        self.all(key).first().copied()
    }

    pub(crate) fn selector(&self) -> Result<Option<Vec<Term>>, ApiError> {
        self.one("label_selector")
            .map(|s| labels::parse_selector(s).map_err(|m| field_error("label_selector", m)))
            .transpose()
    }

    pub(crate) fn number(&self, key: &str, default: u64) -> Result<u64, ApiError> {
        match self.one(key) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|_| field_error(key, "is not a valid integer")),
        }
    }
}

/// One page of `items` under `key`, with `meta.pagination`.
pub(crate) fn list(q: &Query, key: &str, items: Vec<Value>) -> Answer {
    let (items, meta) = paginate(q, items)?;
    Ok((200, json!({ key: items, "meta": {"pagination": meta} })))
}

/// A list endpoint's answer, the way every Hetzner `GET /<resources>`
/// treats its query: `label_selector` parsed first (a bad one is 422
/// `invalid_input` before anything else), then the resources whose name
/// equals `name` (when given), whose labels match the selector, and which
/// `keep` accepts (the endpoint's own filters), as JSON, sorted by the
/// `sort` parameters (each one of `sortable`), one page of them. `named`
/// reads a resource's name and labels.
pub(crate) fn list_matching<'r, R: 'r>(
    q: &Query,
    key: &str,
    sortable: &[&str],
    resources: impl Iterator<Item = &'r R>,
    named: fn(&R) -> (Option<&str>, &Labels),
    keep: impl Fn(&R) -> bool,
    to_json: impl Fn(&R) -> Value,
) -> Answer {
    let selector = q.selector()?;
    let mut items: Vec<Value> = resources
        .filter(|r| {
            let (name, labels) = named(r);
            q.one("name").is_none_or(|n| name == Some(n))
                && selector.as_ref().is_none_or(|s| labels::matches(s, labels))
                && keep(r)
        })
        .map(to_json)
        .collect();
    sort(q, &mut items, sortable)?;
    list(q, key, items)
}

pub(crate) fn paginate(q: &Query, items: Vec<Value>) -> Result<(Vec<Value>, Value), ApiError> {
    let page = q.number("page", 1)?;
    let per_page = q.number("per_page", 25)?;
    if page < 1 {
        return Err(field_error("page", "must be at least 1"));
    }
    if !(1..=50).contains(&per_page) {
        return Err(field_error("per_page", "must be between 1 and 50"));
    }
    let total = items.len() as u64;
    let last = total.div_ceil(per_page).max(1);
    let start = ((page - 1) * per_page).min(total) as usize;
    let end = (page * per_page).min(total) as usize;
    let opt = |p: u64, ok: bool| if ok { json!(p) } else { Value::Null };
    let meta = json!({
        "page": page,
        "per_page": per_page,
        "previous_page": opt(page.saturating_sub(1), page > 1),
        "next_page": opt(page + 1, page < last),
        "last_page": last,
        "total_entries": total,
    });
    Ok((items[start..end].to_vec(), meta))
}

/// Sorts by the `sort` parameters (`field`, `field:asc`, `field:desc`).
pub(crate) fn sort(q: &Query, items: &mut [Value], allowed: &[&str]) -> Result<(), ApiError> {
    let mut keys = Vec::new();
    for s in q.all("sort") {
        let (field, desc) = match s.split_once(':') {
            Some((f, "asc")) => (f, false),
            Some((f, "desc")) => (f, true),
            None => (s, false),
            Some(_) => return Err(field_error("sort", format!("invalid sort {s:?}"))),
        };
        if !allowed.contains(&field) {
            return Err(field_error("sort", format!("cannot sort by {field:?}")));
        }
        keys.push((field.to_owned(), desc));
    }
    items.sort_by(|a, b| {
        for (field, desc) in &keys {
            let (x, y) = (&a[field.as_str()], &b[field.as_str()]);
            let o = match (x.as_u64(), y.as_u64()) {
                (Some(x), Some(y)) => x.cmp(&y),
                _ => x.as_str().unwrap_or("").cmp(y.as_str().unwrap_or("")),
            };
            let o = if *desc { o.reverse() } else { o };
            if o.is_ne() {
                return o;
            }
        }
        std::cmp::Ordering::Equal
    });
    Ok(())
}
