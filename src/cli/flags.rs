//! Parsers for flag values that are more than a number or a path: a value
//! that cannot parse is a usage error (exit 2) before any command runs.

use std::time::Duration;

/// The longest wait a flag may ask for. Deadlines are `now + duration`, and
/// a clock cannot hold arbitrary sums (`Duration` itself ends near 584
/// billion years): a year is far more than any bootstrap needs.
const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// A duration as Go's `time.ParseDuration` reads it (talosctl's and
/// kubectl's flags): numbers with units, summed, as in `1h30m`, `90s`,
/// `2.5m`, `500ms`, `300us` (units `ns`, `us`/`µs`, `ms`, `s`, `m`, `h`); or
/// plain seconds (`3`). Never negative; at most [`MAX_DURATION`].
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let shown = imgbuild::input::quote(text);
    let not = || format!("{shown} is not a duration like 90s, 10m or 1h30m");
    let t = text.trim();
    if t.is_empty() {
        return Err(not());
    }
    // Plain seconds: imgbuild's own shorthand, kept.
    if t.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return sum_of(&[(t, 1_000_000_000)], &shown).ok_or_else(not)?;
    }
    let mut parts = Vec::new();
    let mut rest = t;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .ok_or_else(|| format!("{shown}: a number without a unit (ns, us, ms, s, m, h)"))?;
        let (num, tail) = rest.split_at(digits);
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let nanos: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => {
                return Err(format!(
                    "{shown}: unknown unit {} (ns, us, ms, s, m, h)",
                    imgbuild::input::quote(unit)
                ));
            }
        };
        if num.is_empty() {
            return Err(not());
        }
        parts.push((num, nanos));
        rest = tail;
    }
    sum_of(&parts, &shown).ok_or_else(not)?
}

/// The sum of `(number, nanoseconds per unit)` pairs, truncated to the
/// nanosecond as Go truncates; `None` when a number is not one.
fn sum_of(parts: &[(&str, u128)], shown: &str) -> Option<Result<Duration, String>> {
    let too_long = || {
        Err(format!(
            "{shown} is too long: at most {}h (a year)",
            MAX_DURATION.as_secs() / 3600
        ))
    };
    let max = MAX_DURATION.as_nanos();
    let mut total: u128 = 0;
    for &(num, unit) in parts {
        let (int, frac) = num.split_once('.').unwrap_or((num, ""));
        if (int.is_empty() && frac.is_empty()) || frac.contains('.') {
            return None;
        }
        // Past 40 digits the value is beyond any bound: too long, not a number.
        if int.trim_start_matches('0').len() > 30 {
            return Some(too_long());
        }
        let whole: u128 = if int.is_empty() { 0 } else { int.parse().ok()? };
        let mut add = whole.checked_mul(unit)?;
        let (mut scale, mut f) = (1u128, 0u128);
        for d in frac.bytes().take(30) {
            f = f * 10 + u128::from(d - b'0');
            scale *= 10;
        }
        add += f * unit / scale;
        total = total.saturating_add(add);
        if total > max {
            return Some(too_long());
        }
    }
    let secs = (total / 1_000_000_000) as u64;
    Some(Ok(Duration::new(secs, (total % 1_000_000_000) as u32)))
}

#[cfg(test)]
mod tests {
    use super::{MAX_DURATION, parse_duration};
    use std::time::Duration;

    #[test]
    fn durations_read_like_talosctl_flags() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert!(parse_duration("3d").unwrap_err().contains("unknown unit"));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("2.5m"), Ok(Duration::from_secs(150)));
        assert_eq!(parse_duration("1m0.5s"), Ok(Duration::from_millis(60_500)));
        assert_eq!(parse_duration("300us"), Ok(Duration::from_micros(300)));
        assert_eq!(parse_duration("300µs"), Ok(Duration::from_micros(300)));
        assert_eq!(parse_duration("1.0000000019s"), Ok(Duration::new(1, 1)));
        assert_eq!(parse_duration(".5s"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        for bad in ["", "h", "1h30", "-5s", "1..5s", "1.5.5s", "5 s", "1h 30m"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
        }
        let e = parse_duration("1h30").unwrap_err();
        assert!(e.contains("a number without a unit"), "{e}");
        let long = format!("{}x", "y".repeat(5000));
        assert!(parse_duration(&long).unwrap_err().len() < 300);
        assert!(parse_duration("x").is_err());
        assert_eq!(parse_duration("8760h"), Ok(MAX_DURATION));
        let infinite = format!("{}s", "9".repeat(400));
        for huge in ["8761h", "99999999999999999999h", &infinite] {
            assert!(
                parse_duration(huge).unwrap_err().contains("too long"),
                "{huge}"
            );
        }
    }
}
