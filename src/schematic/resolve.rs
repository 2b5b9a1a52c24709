//! Would a plain YAML scalar read back as something other than a string?
//!
//! Go's YAML library (go.yaml.in/yaml/v4 v4.0.0-rc.4, as Image Factory pins
//! it) writes a string plain only when reading it back unquoted yields the
//! same string; otherwise it double-quotes it. The schematic ID is a hash of
//! those bytes, so this module reproduces the library's implicit-type
//! resolution exactly: its map of special words (the merge key `<<` among
//! them), its integer and float rules (Go `strconv` semantics, underscores
//! dropped), its timestamp layouts, and the YAML 1.1 leftovers it still
//! quotes (`yes`/`no`/`on`/`off`, base-60).

/// True when `s`, written unquoted, would resolve to the string `s` itself.
pub(crate) fn plain_is_string(s: &str) -> bool {
    !resolves_to_non_string(s) && !is_base60_float(s) && !is_old_bool(s)
}

fn resolves_to_non_string(s: &str) -> bool {
    const SPECIAL: &[&str] = &[
        "true", "True", "TRUE", "false", "False", "FALSE", "", "~", "null", "Null", "NULL", ".nan",
        ".NaN", ".NAN", ".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF", "-.inf", "-.Inf",
        "-.INF", "<<",
    ];
    let Some(&first) = s.as_bytes().first() else {
        return true; // the empty string reads as null
    };
    match first {
        // Looked up in the map of special words only.
        b'y' | b'Y' | b'n' | b'N' | b't' | b'T' | b'f' | b'F' | b'o' | b'O' | b'~' | b'<' => {
            SPECIAL.contains(&s)
        }
        b'.' => SPECIAL.contains(&s) || go_parse_float(s).is_some(),
        b'+' | b'-' | b'0'..=b'9' => SPECIAL.contains(&s) || is_number_or_timestamp(s),
        _ => false,
    }
}

fn is_number_or_timestamp(s: &str) -> bool {
    if is_timestamp(s) {
        return true;
    }
    let plain: String = s.chars().filter(|&c| c != '_').collect();
    if go_parse_int_base0(&plain).is_some() || go_parse_uint_base0(&plain).is_some() {
        return true;
    }
    is_yaml_style_float(&plain) && go_parse_float(&plain).is_some()
}

/// `strconv.ParseInt(s, 0, 64)`: sign, then a 0x/0o/0b/0 prefix picks the radix.
fn go_parse_int_base0(s: &str) -> Option<i64> {
    let (neg, rest) = split_sign(s);
    let magnitude = go_parse_uint_base0(rest)?;
    if neg {
        (magnitude <= 1u64 << 63).then(|| (magnitude as i64).wrapping_neg())
    } else {
        i64::try_from(magnitude).ok()
    }
}

/// `strconv.ParseUint(s, 0, 64)`: no sign allowed.
fn go_parse_uint_base0(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.is_empty() {
        return None;
    }
    if b[0] == b'0' {
        if b.len() >= 3 {
            match b[1].to_ascii_lowercase() {
                b'x' => return parse_digits(&s[2..], 16),
                b'o' => return parse_digits(&s[2..], 8),
                b'b' => return parse_digits(&s[2..], 2),
                _ => {}
            }
        }
        // A lone "0" is zero; otherwise a leading 0 means octal.
        return if s.len() == 1 {
            Some(0)
        } else {
            parse_digits(&s[1..], 8)
        };
    }
    parse_digits(s, 10)
}

fn split_sign(s: &str) -> (bool, &str) {
    match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    }
}

fn parse_digits(s: &str, radix: u32) -> Option<u64> {
    if s.is_empty() {
        return None;
    }
    s.chars().try_fold(0u64, |acc, c| {
        let d = c.to_digit(radix)?;
        acc.checked_mul(u64::from(radix))?.checked_add(u64::from(d))
    })
}

/// `^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$`
fn is_yaml_style_float(s: &str) -> bool {
    let b = s.as_bytes();
    let mut i = usize::from(matches!(b.first(), Some(b'+' | b'-')));
    let digits = |i: &mut usize| {
        let start = *i;
        while *i < b.len() && b[*i].is_ascii_digit() {
            *i += 1;
        }
        *i - start
    };
    if b.get(i) == Some(&b'.') {
        i += 1;
        if digits(&mut i) == 0 {
            return false;
        }
    } else {
        if digits(&mut i) == 0 {
            return false;
        }
        if b.get(i) == Some(&b'.') {
            i += 1;
            digits(&mut i);
        }
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        if digits(&mut i) == 0 {
            return false;
        }
    }
    i == b.len()
}

/// `strconv.ParseFloat(s, 64)` for the decimal forms YAML can reach: it fails
/// on out-of-range values where Rust would return infinity.
fn go_parse_float(s: &str) -> Option<f64> {
    if !s
        .bytes()
        .all(|c| c.is_ascii_digit() || matches!(c, b'.' | b'e' | b'E' | b'+' | b'-'))
    {
        return None;
    }
    s.parse::<f64>().ok().filter(|f| f.is_finite())
}

/// YAML 1.1 booleans Go's library still quotes for compatibility.
fn is_old_bool(s: &str) -> bool {
    matches!(
        s,
        "y" | "Y"
            | "yes"
            | "Yes"
            | "YES"
            | "on"
            | "On"
            | "ON"
            | "n"
            | "N"
            | "no"
            | "No"
            | "NO"
            | "off"
            | "Off"
            | "OFF"
    )
}

/// `^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$`
fn is_base60_float(s: &str) -> bool {
    let b = s.as_bytes();
    let mut i = usize::from(matches!(b.first(), Some(b'+' | b'-')));
    if !b.get(i).is_some_and(u8::is_ascii_digit) {
        return false;
    }
    while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'_') {
        i += 1;
    }
    let mut groups = 0;
    while b.get(i) == Some(&b':') {
        i += 1;
        match (b.get(i), b.get(i + 1)) {
            (Some(b'0'..=b'5'), Some(d1)) if d1.is_ascii_digit() => i += 2,
            (Some(d), _) if d.is_ascii_digit() => i += 1,
            _ => return false,
        }
        groups += 1;
    }
    if groups == 0 {
        return false;
    }
    if b.get(i) == Some(&b'.') {
        i += 1;
        while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'_') {
            i += 1;
        }
    }
    i == b.len()
}

/// Go's timestamp resolution: the layouts `2006-1-2T15:4:5.999999999Z07:00`
/// (also with `t`), `2006-1-2 15:4:5.999999999` and `2006-1-2`, with Go's
/// range checks (a 30th of February is a string).
fn is_timestamp(s: &str) -> bool {
    let b = s.as_bytes();
    if b.len() < 5 || !b[..4].iter().all(u8::is_ascii_digit) || b[4] != b'-' {
        return false;
    }
    let mut i = 5;
    let year: u32 = s[..4].parse().unwrap_or(0);
    let Some(month) = take_num(b, &mut i, 1, 12) else {
        return false;
    };
    if b.get(i) != Some(&b'-') {
        return false;
    }
    i += 1;
    let Some(day) = take_num(b, &mut i, 1, 31) else {
        return false;
    };
    if day > days_in_month(year, month) {
        return false;
    }
    if i == b.len() {
        return true;
    }
    let zoned = match b[i] {
        b'T' | b't' => true,
        b' ' => false,
        _ => return false,
    };
    i += 1;
    for (pos, max) in [(0, 23), (1, 59), (2, 59)] {
        if pos > 0 {
            if b.get(i) != Some(&b':') {
                return false;
            }
            i += 1;
        }
        if take_num(b, &mut i, 0, max).is_none() {
            return false;
        }
    }
    if matches!(b.get(i), Some(b'.' | b',')) && b.get(i + 1).is_some_and(u8::is_ascii_digit) {
        i += 1;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
    }
    if !zoned {
        return i == b.len();
    }
    match b.get(i) {
        Some(b'Z') => i + 1 == b.len(),
        Some(b'+' | b'-') => {
            let tz = &b[i + 1..];
            tz.len() == 5
                && tz[0].is_ascii_digit()
                && tz[1].is_ascii_digit()
                && tz[2] == b':'
                && tz[3].is_ascii_digit()
                && tz[4].is_ascii_digit()
        }
        _ => false,
    }
}

/// One or two digits (Go's non-fixed `getnum`), within `min..=max`.
fn take_num(b: &[u8], i: &mut usize, min: u32, max: u32) -> Option<u32> {
    let start = *i;
    while *i < b.len() && *i - start < 2 && b[*i].is_ascii_digit() {
        *i += 1;
    }
    if *i == start {
        return None;
    }
    let v: u32 = std::str::from_utf8(&b[start..*i]).ok()?.parse().ok()?;
    (min..=max).contains(&v).then_some(v)
}

fn days_in_month(year: u32, month: u32) -> u32 {
    match month {
        2 if year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400)) => {
            29
        }
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

#[cfg(test)]
mod tests {
    use super::plain_is_string;

    #[test]
    fn words_of_other_types_are_not_plain_strings() {
        for s in [
            "true", "False", "NULL", "~", "", ".inf", "-.Inf", ".nan", "yes", "No", "on", "OFF",
            "y", "N",
        ] {
            assert!(!plain_is_string(s), "{s:?} should need quoting");
        }
    }

    #[test]
    fn numbers_in_go_syntax_are_not_plain_strings() {
        for s in [
            "123",
            "+1",
            "-1",
            "0x10",
            "0X1f",
            "0o17",
            "0b101",
            "017",
            "08",
            "1_000",
            "1.5",
            ".5",
            "1e3",
            "1.5E+3",
            "-.5",
            "-0b1",
            "18446744073709551615",
            "1_",
            "99999999999999999999",
        ] {
            assert!(!plain_is_string(s), "{s:?} should need quoting");
        }
    }

    #[test]
    fn almost_numbers_stay_plain() {
        for s in [
            "1e400", "0x", "+", "-", "1.2.3", "0xg", "1e", "e1", ".", "..", "0b", "v1.11.2",
            // v3 retried "0b"/"0o" prefixes as signed numbers; rc.4 does not.
            "0b+1", "0o-7", "<",
        ] {
            assert!(plain_is_string(s), "{s:?} should stay plain");
        }
    }

    #[test]
    fn base60_and_timestamps_are_not_plain_strings() {
        for s in [
            "1:20",
            "12:30:45.5",
            "-1:5",
            "2001-12-14",
            "2001-1-2",
            "2001-12-14t21:59:43.10Z",
            "2001-12-14T21:59:43,1-05:00",
            "2001-12-14 21:59:43.10",
            "2000-02-29",
        ] {
            assert!(!plain_is_string(s), "{s:?} should need quoting");
        }
    }

    #[test]
    fn invalid_dates_and_times_stay_plain() {
        for s in [
            "2001-02-30",
            "2001-02-29",
            "2001-13-01",
            "2001-12-14T25:00:00Z",
            "2001-12-14T21:59:43",
            "2001-12-14 21:59:43Z",
            "201-12-14",
            "1:60",
            "1:",
        ] {
            assert!(plain_is_string(s), "{s:?} should stay plain");
        }
    }

    #[test]
    fn ordinary_values_stay_plain() {
        for s in [
            "siderolabs/qemu-guest-agent",
            "console=ttyS0,115200n8",
            "-talos.halt_if_installed",
            "a#b",
            "net.ifnames=0",
            "nomodeset",
        ] {
            assert!(plain_is_string(s), "{s:?} should stay plain");
        }
    }
}
