//! Speed-weighted shares of the global batch: how fast each rank computes, and the split of a
//! fixed global batch proportional to those speeds. Pure functions and plain data; no I/O.
//!
//! Part of the contract because every worker of a job must derive the same split from the same
//! rates, whichever runtime it is: the Rust worker (`diphoma-worker`'s `train` module, which
//! re-exports this module as `diphoma_worker::balance`) and the PyTorch sampler
//! (`diphoma.torch.ElasticSampler`, through the binding's `diphoma.split` and `diphoma.Speed`)
//! call these same functions; nothing else implements them.
//!
//! Every rank keeps a smoothed estimate of its own compute time per sample ([`Speed`]); the
//! estimates travel, one value per rank, in a collective (the Rust worker's step allreduce, the
//! sampler's own small allreduce every `K` steps), so every rank holds the same vector of rates
//! and derives the same split with [`split`]. The samples of step `s` are always the same `B`
//! samples; only which rank computes which of them changes, so with every-step synchronisation
//! the model does not depend on the split (up to the order of float additions).

use std::ops::Range;

/// Committed steps between two re-splits of the batch when the job does not say
/// (`spec.balance.everySteps`'s default, [`crate::ENV_BALANCE_EVERY`] unset).
pub const DEFAULT_EVERY: u64 = 10;

/// Weight of the newest measurement in the smoothed compute time per sample (an exponential
/// moving average: the estimate follows a change of speed within about `1/SMOOTHING` steps).
pub const SMOOTHING: f64 = 0.3;

/// Shares of a global batch of `batch` samples for ranks computing at `rates` (samples per
/// second, one per rank, in rank order), proportional to the rates, each at least one sample
/// when `batch ≥ rates.len()`; the shares add up to `batch` exactly.
///
/// Method: every rank first gets one sample; the remaining `batch − world` are apportioned by
/// the largest-remainder (Hamilton) method: each rank gets the floor of its quota
/// `rest · rateᵢ / Σ rate`, and the samples left over go to the largest fractional parts, the
/// lower rank first among equal ones. A rate that is not a positive finite number (a rank that
/// has not measured itself yet) counts as the mean of the valid ones; with none valid the
/// split is equal. With fewer samples than ranks, the first `batch` ranks get one each.
///
/// Pure and deterministic: the same rates give the same shares on every rank.
pub fn split(batch: usize, rates: &[f64]) -> Vec<usize> {
    let w = rates.len();
    if w == 0 {
        return Vec::new();
    }
    if batch < w {
        return (0..w).map(|r| usize::from(r < batch)).collect();
    }
    let valid: Vec<f64> = rates
        .iter()
        .copied()
        .filter(|r| r.is_finite() && *r > 0.0)
        .collect();
    let fill = if valid.is_empty() {
        1.0
    } else {
        valid.iter().sum::<f64>() / valid.len() as f64
    };
    let rates: Vec<f64> = rates
        .iter()
        .map(|&r| if r.is_finite() && r > 0.0 { r } else { fill })
        .collect();
    let total: f64 = rates.iter().sum();
    let rest = batch - w;
    let quotas: Vec<f64> = rates.iter().map(|r| rest as f64 * r / total).collect();
    let mut shares: Vec<usize> = quotas.iter().map(|q| 1 + q.floor() as usize).collect();
    let given: usize = shares.iter().sum();
    // Rounding of the quotas can leave their floors a little above or below `rest`: hand out
    // (or take back) the difference by remainder, so the sum is exact whatever the floats.
    let mut order: Vec<usize> = (0..w).collect();
    order.sort_by(|&a, &b| {
        let (fa, fb) = (quotas[a] - quotas[a].floor(), quotas[b] - quotas[b].floor());
        fb.total_cmp(&fa).then(a.cmp(&b))
    });
    if given <= batch {
        for &r in order.iter().cycle().take(batch - given) {
            shares[r] += 1;
        }
    } else {
        let mut extra = given - batch;
        for &r in order.iter().rev().cycle() {
            if extra == 0 {
                break;
            }
            if shares[r] > 1 {
                shares[r] -= 1;
                extra -= 1;
            }
        }
    }
    shares
}

/// The contiguous part of the global batch that rank `rank` computes when the ranks have
/// `shares` (in rank order): ranks take consecutive ranges, so the ranges tile `0..Σ shares`.
///
/// # Panics
/// When `rank` is not below `shares.len()`.
pub fn range(shares: &[usize], rank: usize) -> Range<usize> {
    let start: usize = shares[..rank].iter().sum();
    start..start + shares[rank]
}

/// `max / min` of the shares (1 for an equal split; 0 for none): how uneven the split is.
pub fn spread(shares: &[usize]) -> f64 {
    match (shares.iter().min(), shares.iter().max()) {
        (Some(&lo), Some(&hi)) if lo > 0 => hi as f64 / lo as f64,
        _ => 0.0,
    }
}

/// A rank's smoothed compute time per sample (seconds): an exponential moving average with
/// weight [`SMOOTHING`] of `compute seconds / samples` of each measured step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Speed {
    seconds_per_sample: Option<f64>,
}

impl Speed {
    /// Records one step: `seconds` of compute for `samples` samples (nothing for 0 samples or a
    /// non-finite time).
    pub fn record(&mut self, seconds: f64, samples: usize) {
        if samples == 0 || !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let x = seconds / samples as f64;
        self.seconds_per_sample = Some(match self.seconds_per_sample {
            None => x,
            Some(e) => e + SMOOTHING * (x - e),
        });
    }

    /// Samples per second (0 before the first measurement: "unknown" to [`split`]).
    pub fn rate(&self) -> f64 {
        match self.seconds_per_sample {
            Some(s) if s > 0.0 => 1.0 / s,
            _ => 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn equal_rates_split_evenly_and_the_lower_ranks_take_the_rest() {
        assert_eq!(split(64, &[1.0; 4]), vec![16; 4]);
        assert_eq!(split(10, &[2.0; 4]), vec![3, 3, 2, 2]);
        assert_eq!(split(7, &[5.0]), vec![7]);
    }

    #[test]
    fn a_slow_rank_gets_less_and_every_rank_at_least_one() {
        // Rank 3 at half speed: quotas of the 60 after the reserved ones are 17.14 ×3, 8.57.
        assert_eq!(split(64, &[2.0, 2.0, 2.0, 1.0]), vec![18, 18, 18, 10]);
        // A rank a million times slower still computes one sample.
        assert_eq!(split(8, &[1e6, 1e6, 1.0]), vec![4, 3, 1]);
        // Fewer samples than ranks: one each for the first ones.
        assert_eq!(split(2, &[1.0, 5.0, 9.0]), vec![1, 1, 0]);
    }

    #[test]
    fn unknown_rates_count_as_the_mean_of_the_known() {
        assert_eq!(split(12, &[0.0, 1.0, 3.0]), split(12, &[2.0, 1.0, 3.0]));
        assert_eq!(split(12, &[f64::NAN, f64::INFINITY, -1.0]), vec![4; 3]);
    }

    #[test]
    fn ranges_tile_the_batch_in_rank_order() {
        let s = [3, 1, 4];
        assert_eq!(range(&s, 0), 0..3);
        assert_eq!(range(&s, 1), 3..4);
        assert_eq!(range(&s, 2), 4..8);
        assert_eq!(spread(&s), 4.0);
        assert_eq!(spread(&[]), 0.0);
    }

    #[test]
    fn speed_is_smoothed_and_unknown_until_measured() {
        let mut s = Speed::default();
        assert_eq!(s.rate(), 0.0);
        s.record(1.0, 0);
        assert_eq!(s.rate(), 0.0);
        s.record(0.5, 100); // 5 ms per sample
        assert!((s.rate() - 200.0).abs() < 1e-9);
        s.record(1.0, 100); // 10 ms: the estimate moves 30 % of the way
        assert!((1.0 / s.rate() - 0.0065).abs() < 1e-12);
    }

    proptest! {
        /// Exact sum, at least one each, and within one sample of the proportional quota of
        /// the samples beyond the reserved ones.
        #[test]
        fn shares_are_exact_and_proportional(
            rates in proptest::collection::vec(1e-3f64..1e3, 1..40),
            extra in 0usize..5000,
        ) {
            let batch = rates.len() + extra;
            let s = split(batch, &rates);
            prop_assert_eq!(s.iter().sum::<usize>(), batch);
            prop_assert!(s.iter().all(|&x| x >= 1));
            let total: f64 = rates.iter().sum();
            for (x, r) in s.iter().zip(&rates) {
                let quota = 1.0 + extra as f64 * r / total;
                prop_assert!((*x as f64 - quota).abs() < 1.0 + 1e-9, "{} vs {}", x, quota);
            }
            prop_assert_eq!(s, split(batch, &rates));
        }
    }
}
