//! How often a wait looks again for the end of a step only polling can
//! see (issue 42): short pauses first, doubling up to `--poll`.

use std::time::{Duration, Instant};

/// The pauses of a wait for a step's end that only polling can see (a
/// reboot, a Ready condition, pods leaving): the first look comes an
/// eighth of `--poll` after the first one, each pause doubles, up to
/// `--poll`. A step that ends soon is seen soon instead of a whole poll
/// later; a long one is looked at as often as with a fixed poll.
#[derive(Debug, Clone)]
pub struct Pace {
    next: Duration,
    poll: Duration,
    deadline: Instant,
}

impl Pace {
    /// The shortest pause (a look is a TLS connect and a call).
    const FLOOR: Duration = Duration::from_millis(10);

    /// Pauses for polls every `poll` at most, within `timeout` from now.
    pub fn new(poll: Duration, timeout: Duration) -> Pace {
        Pace::until(poll, Instant::now() + timeout)
    }

    /// As [`Pace::new`], the deadline given.
    pub fn until(poll: Duration, deadline: Instant) -> Pace {
        Pace {
            next: (poll / 8).clamp(Self::FLOOR.min(poll), poll),
            poll,
            deadline,
        }
    }

    /// The pause before the next look, or `None` when it would end past
    /// the deadline (the wait has failed).
    pub fn pause(&mut self, now: Instant) -> Option<Duration> {
        let pause = self.next;
        if now + pause > self.deadline {
            return None;
        }
        self.next = (pause * 2).min(self.poll);
        Some(pause)
    }

    /// Sleeps the next pause; false when the deadline came first (nothing
    /// slept).
    pub async fn wait(&mut self) -> bool {
        match self.pause(Instant::now()) {
            Some(pause) => {
                tokio::time::sleep(pause).await;
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pauses start at an eighth of the poll and double up to it; the
    /// last one never ends past the deadline.
    #[test]
    fn pauses_start_short_and_double_up_to_the_poll() {
        let start = Instant::now();
        let ms = Duration::from_millis;
        let mut pace = Pace::until(ms(2000), start + ms(10_000));
        let mut at = start;
        let mut pauses = Vec::new();
        while let Some(p) = pace.pause(at) {
            pauses.push(p.as_millis());
            at += p;
        }
        assert_eq!(pauses, [250, 500, 1000, 2000, 2000, 2000, 2000]);
        assert!(at <= start + ms(10_000));
        let mut tiny = Pace::until(ms(40), start + ms(1000));
        assert_eq!(tiny.pause(start), Some(ms(10)));
        assert_eq!(tiny.pause(start), Some(ms(20)));
        assert_eq!(tiny.pause(start), Some(ms(40)));
        assert_eq!(tiny.pause(start), Some(ms(40)));
        let mut zero = Pace::until(Duration::ZERO, start + ms(1));
        assert_eq!(zero.pause(start), Some(Duration::ZERO));
    }
}
