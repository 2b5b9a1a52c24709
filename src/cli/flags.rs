//! Parsers for flag values that are more than a number or a path: a value
//! that cannot parse is a usage error (exit 2) before any command runs.

use std::time::Duration;

/// The longest wait a flag may ask for. Deadlines are `now + duration`, and
/// a clock cannot hold arbitrary sums (`Duration` itself ends near 584
/// billion years): a year is far more than any bootstrap needs.
const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// `90s`, `10m`, `1h`, `500ms`, or plain seconds, at most [`MAX_DURATION`].
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let (num, unit) = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .map_or((t, "s"), |i| t.split_at(i));
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a duration like 90s or 10m"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (ms, s, m, h)")),
    };
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if d <= MAX_DURATION => Ok(d),
        _ => Err(format!(
            "{text:?} is too long: at most {}h (a year)",
            MAX_DURATION.as_secs() / 3600
        )),
    }
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
