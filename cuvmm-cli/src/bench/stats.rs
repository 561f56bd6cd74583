//! The statistics the benchmarks report, in one place: medians and nearest-rank percentiles.

/// The median of `sorted` (ascending): the middle sample, or the mean of the middle two for an
/// even count; 0 for none.
pub fn median_sorted<T: Copy + Into<f64>>(sorted: &[T]) -> f64 {
    let n = sorted.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => sorted[n / 2].into(),
        _ => (sorted[n / 2 - 1].into() + sorted[n / 2].into()) / 2.0,
    }
}

/// The `q` quantile (0 < q <= 1) of `sorted` (ascending) by nearest rank: the smallest sample
/// with at least a `q` share of the samples at or below it; 0 for none.
pub fn nearest_rank<T: Copy + Into<f64>>(sorted: &[T], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].into()
}

/// The median of `samples`, in any order (see [`median_sorted`]).
pub fn median(samples: &[f64]) -> f64 {
    median_sorted(&sorted(samples))
}

/// The `q` quantile of `samples`, in any order, by nearest rank (see [`nearest_rank`]).
pub fn percentile(samples: &[f64], q: f64) -> f64 {
    nearest_rank(&sorted(samples), q)
}

fn sorted(samples: &[f64]) -> Vec<f64> {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_take_the_middle_or_the_mean_of_the_middle_two() {
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[3.0]), 3.0);
        assert_eq!(median(&[5.0, 1.0, 3.0]), 3.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median_sorted::<u32>(&[]), 0.0);
        assert_eq!(median_sorted(&[1u32, 2, 3, 10]), 2.5);
        let v: Vec<u32> = (1..=200).collect();
        assert_eq!(median_sorted(&v), 100.5);
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let steps: Vec<f64> = (1..=200).rev().map(f64::from).collect();
        assert_eq!(percentile(&steps, 0.99), 198.0);
        assert_eq!(percentile(&steps, 1.0), 200.0);
        assert_eq!(percentile(&steps, 0.001), 1.0);
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 0.5), 2.0);
        assert_eq!(percentile(&[], 0.99), 0.0);
        assert_eq!(nearest_rank(&[1u32, 3, 7], 0.99), 7.0);
        assert_eq!(nearest_rank::<u32>(&[], 0.99), 0.0);
    }

    #[test]
    fn the_sorted_and_unsorted_forms_agree() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for n in 0..50 {
            let v: Vec<u32> = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 1000) as u32
                })
                .collect();
            let f: Vec<f64> = v.iter().map(|&a| f64::from(a)).collect();
            let mut s = v.clone();
            s.sort_unstable();
            assert_eq!(median(&f), median_sorted(&s));
            for q in [0.5, 0.9, 0.99, 1.0] {
                assert_eq!(percentile(&f, q), nearest_rank(&s, q));
            }
        }
    }
}
