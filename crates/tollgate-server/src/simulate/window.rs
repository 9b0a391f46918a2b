//! [`WindowMax`]: the most admitted cost in any rolling window of one unit, per key,
//! by two pointers over each key's admissions.

use std::collections::VecDeque;

use tollgate::clock::Nanos;

/// Tracks each key's admissions within the last unit.
///
/// A window is `(t − unit, t]`, as the sliding log counts: an admission leaves it when
/// `at + unit <= t`. Memory is what each key admitted within one unit.
#[derive(Debug)]
pub struct WindowMax {
    unit: Nanos,
    keys: Vec<(VecDeque<(Nanos, u64)>, u64)>,
    max: u64,
    max_at: Nanos,
}

impl WindowMax {
    /// For `keys` keys and windows `unit` long.
    pub fn new(keys: usize, unit: Nanos) -> Self {
        Self {
            unit: unit.max(1),
            keys: (0..keys).map(|_| (VecDeque::new(), 0)).collect(),
            max: 0,
            max_at: 0,
        }
    }

    /// Records an admission of `cost` for `key` at `at` (not before the last one);
    /// returns what the key admitted in the window ending at `at`.
    pub fn admit(&mut self, key: usize, at: Nanos, cost: u64) -> u64 {
        let Some((log, sum)) = self.keys.get_mut(key) else {
            return 0;
        };
        while let Some(&(first, c)) = log.front() {
            if first.saturating_add(self.unit) > at {
                break;
            }
            *sum -= c;
            log.pop_front();
        }
        log.push_back((at, cost));
        *sum += cost;
        if *sum > self.max {
            self.max = *sum;
            self.max_at = at;
        }
        *sum
    }

    /// The most admitted in any window, over every key.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// Where the first window holding [`max`](Self::max) ends.
    pub fn max_at(&self) -> Nanos {
        self.max_at
    }
}

#[cfg(test)]
mod tests {
    use super::WindowMax;

    #[test]
    fn the_window_slides_and_keys_are_apart() {
        let mut w = WindowMax::new(2, 10);
        assert_eq!(w.admit(0, 0, 1), 1);
        assert_eq!(w.admit(0, 5, 2), 3);
        assert_eq!(w.admit(1, 6, 4), 4);
        // At 10 the admission at 0 has left: (0, 10].
        assert_eq!(w.admit(0, 10, 1), 3);
        assert_eq!(w.admit(0, 14, 1), 4);
        assert_eq!(w.admit(0, 15, 1), 3);
        assert_eq!((w.max(), w.max_at()), (4, 6));
    }

    #[test]
    fn a_burst_either_side_of_a_turn_counts_twice() {
        let mut w = WindowMax::new(1, 1_000);
        for t in 990..1_000 {
            w.admit(0, t, 1);
        }
        for t in 1_000..1_010 {
            w.admit(0, t, 1);
        }
        assert_eq!(w.max(), 20);
    }
}
