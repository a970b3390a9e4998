//! Label selectors as kubectl takes them (`-l`, `?labelSelector=`): requirements joined by
//! commas, each `key`, `!key`, `key=value`, `key==value`, `key!=value`, `key in (a,b)` or
//! `key notin (a,b)`. As in Kubernetes, `!=` and `notin` also match objects without the key.

use std::collections::BTreeMap;

use crate::manifest::{label_key_ok, label_value_ok};

/// Every requirement must hold; none: everything matches.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selector(Vec<Requirement>);

#[derive(Clone, Debug, PartialEq, Eq)]
enum Requirement {
    Exists(String),
    Absent(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

impl Selector {
    /// Parse `text`; the error names the requirement that is wrong and why.
    pub fn parse(text: &str) -> Result<Self, String> {
        split_top(text)?
            .into_iter()
            .map(str::trim)
            .filter(|r| !r.is_empty())
            .map(|r| requirement(r).map_err(|why| format!("{r:?}: {why}")))
            .collect::<Result<Vec<_>, _>>()
            .map(Selector)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.0.iter().all(|r| match r {
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::Absent(k) => !labels.contains_key(k),
            Requirement::In(k, values) => labels.get(k).is_some_and(|v| values.contains(v)),
            Requirement::NotIn(k, values) => labels.get(k).is_none_or(|v| !values.contains(v)),
        })
    }
}

/// `text` cut at the commas outside parentheses.
fn split_top(text: &str) -> Result<Vec<&str>, String> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0u32, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.checked_sub(1).ok_or("a ')' without its '('")?,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth > 0 {
        return Err("a '(' without its ')'".into());
    }
    parts.push(&text[start..]);
    Ok(parts)
}

fn requirement(text: &str) -> Result<Requirement, String> {
    const RULE: &str = "letters, digits, '-', '_', '.', at most 63, beginning and ending with a letter or digit";
    let checked = |part: &str, ok: fn(&str) -> bool, what: &str| -> Result<String, String> {
        let part = part.trim();
        match ok(part) {
            true => Ok(part.to_string()),
            false => Err(format!("{part:?} is not a label {what}: {RULE}")),
        }
    };
    let key = |k: &str| {
        checked(
            k,
            label_key_ok,
            "key ([prefix/]name, the name's rule below; the prefix at most 253)",
        )
    };
    let value = |v: &str| checked(v, label_value_ok, "value");
    if let Some((k, v)) = text.split_once("!=") {
        return Ok(Requirement::NotIn(key(k)?, vec![value(v)?]));
    }
    if let Some((k, v)) = text.split_once("==").or_else(|| text.split_once('=')) {
        return Ok(Requirement::In(key(k)?, vec![value(v)?]));
    }
    if let Some(k) = text.strip_prefix('!') {
        return Ok(Requirement::Absent(key(k)?));
    }
    if let Some(open) = text.find('(') {
        let (head, set) = text.split_at(open);
        let set = set
            .strip_prefix('(')
            .and_then(|s| s.trim_end().strip_suffix(')'))
            .ok_or("expected a set in parentheses at the end")?;
        let values = set
            .split(',')
            .map(|v| match v.trim() {
                "" => Err("an empty value in the set".to_string()),
                v => value(v),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut words = head.split_whitespace();
        let (k, op) = (words.next().unwrap_or(""), words.next());
        if words.next().is_some() {
            return Err("expected KEY in (VALUES) or KEY notin (VALUES)".into());
        }
        return match op {
            Some("in") => Ok(Requirement::In(key(k)?, values)),
            Some("notin") => Ok(Requirement::NotIn(key(k)?, values)),
            _ => Err("expected KEY in (VALUES) or KEY notin (VALUES)".into()),
        };
    }
    Ok(Requirement::Exists(key(text)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn every_kind_of_requirement_matches_as_kubectl_does() {
        let demo = labels(&[("suite", "demo"), ("tier", "a")]);
        let other = labels(&[("suite", "prod")]);
        let none = labels(&[]);
        let cases: &[(&str, [bool; 3])] = &[
            ("", [true, true, true]),
            ("suite=demo", [true, false, false]),
            ("suite==demo", [true, false, false]),
            ("suite!=demo", [false, true, true]),
            ("suite", [true, true, false]),
            ("!suite", [false, false, true]),
            ("suite in (demo, prod)", [true, true, false]),
            ("suite notin (demo)", [false, true, true]),
            ("suite=demo,tier=a", [true, false, false]),
            ("suite in (demo,prod),!tier", [false, true, false]),
            (" suite = demo ", [true, false, false]),
            ("example.com/suite", [false, false, false]),
        ];
        for (text, want) in cases {
            let s = Selector::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            let got = [s.matches(&demo), s.matches(&other), s.matches(&none)];
            assert_eq!(&got, want, "{text}");
        }
    }

    #[test]
    fn a_wrong_requirement_is_refused_and_named() {
        for (text, says) in [
            ("su ite=demo", "not a label key"),
            ("a=b=c", "not a label value"),
            ("=demo", "not a label key"),
            ("suite in (demo", "without its ')'"),
            ("suite)", "without its '('"),
            ("suite within (a)", "expected KEY in"),
            ("suite in (a) x", "expected a set"),
            ("-x", "not a label key"),
            ("suite in ()", "an empty value"),
            ("suite in (a,,b)", "an empty value"),
        ] {
            let e = Selector::parse(text).expect_err(text);
            assert!(e.contains(says), "{text}: {e}");
        }
    }
}
