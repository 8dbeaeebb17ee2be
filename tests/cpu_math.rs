//! The two places where the CPU reference trades the obvious code for speed, checked against the
//! obvious code: its vectorisable `exp` against f64's, and its GEMM, cut into one block per
//! thread, against the same product on one thread (the bits must not depend on the cut).

use ferrotron::ops::cpu_math::{exp, gemm, product, View};

#[test]
fn exp_is_within_two_ulp_and_zero_below_the_normal_range() {
    let mut worst = 0.0f64;
    for i in 0..=200_000 {
        let x = -87.0 + 175.0 * i as f32 / 200_000.0;
        let want = (x as f64).exp();
        worst = worst.max(((exp(x) as f64 - want) / want).abs());
    }
    assert!(worst < 2.5e-7, "exp: relative error {worst:e}, more than two f32 ulp");
    for x in [-87.5f32, -100.0, -1e30, f32::NEG_INFINITY] {
        assert_eq!(exp(x), 0.0, "exp({x}) must be 0 (a masked score's probability)");
    }
    assert_eq!(exp(0.0), 1.0);
    assert!(exp(1e30).is_finite() && exp(1e30) >= exp(88.0), "exp saturates instead of overflowing");
}

#[test]
fn a_gemm_cut_across_threads_gives_the_bits_of_one_thread() {
    let det = |seed: u64, n: usize| -> Vec<f32> {
        (0..n).map(|i| ((i as u64 * 2_654_435_761 + seed) % 1000) as f32 / 500.0 - 1.0).collect()
    };
    // tall (cut by rows), wide (cut by columns), a long sum (cut along k), transposed, accumulating
    for (m, k, n, transposed, accumulate) in [
        (300, 100, 120, false, false),
        (40, 200, 700, true, false),
        (256, 64, 257, false, true),
        (72, 1500, 40, true, true),
        (48, 2100, 64, false, false),
    ] {
        let (a, b, c0) = (det(1, m * k), det(2, k * n), det(3, m * n));
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut c = c0.clone();
            let av = if transposed { View::transposed(&a, m) } else { View::rows(&a, k) };
            pool.install(|| gemm(m, k, n, av, View::rows(&b, n), &mut c, accumulate));
            c
        };
        let one = run(1);
        assert_eq!(one, run(2), "{m}x{k}x{n}: two threads changed the bits");
        assert_eq!(one, run(3), "{m}x{k}x{n}: three threads changed the bits");
        // and it is the product, every element (against f64)
        let at = |i: usize, l: usize| if transposed { a[l * m + i] } else { a[i * k + l] };
        for (i, j) in (0..m).flat_map(|i| (0..n).map(move |j| (i, j))) {
            let sum: f64 = (0..k).map(|l| at(i, l) as f64 * b[l * n + j] as f64).sum();
            let want = sum + if accumulate { c0[i * n + j] as f64 } else { 0.0 };
            let got = one[i * n + j] as f64;
            assert!((got - want).abs() < 1e-4 * (1.0 + want.abs()), "{m}x{k}x{n}: c[{i},{j}] = {got} not {want}");
        }
        // `product` (into memory it does not zero first) is the same computation
        if !accumulate {
            let av = if transposed { View::transposed(&a, m) } else { View::rows(&a, k) };
            assert_eq!(product(m, k, n, av, View::rows(&b, n)), one, "{m}x{k}x{n}: product differs from gemm");
        }
    }
    assert_eq!(product(3, 0, 2, View::rows(&[], 0), View::rows(&[], 2)), vec![0.0; 6], "an empty sum is 0");
}

#[test]
fn the_eight_lane_reductions_see_every_element() {
    use ferrotron::ops::cpu_math::{dot8, max8, sum8};
    assert_eq!(max8(&[]), f32::NEG_INFINITY);
    for n in 0..40usize {
        let x: Vec<f32> = (0..n).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
        let y: Vec<f32> = (0..n).map(|i| ((i * 13) % 7) as f32 * 0.5).collect();
        let want_sum: f32 = x.iter().sum();
        let want_dot: f32 = x.iter().zip(&y).map(|(a, b)| a * b).sum();
        assert_eq!(sum8(&x), want_sum, "sum8 of {n}"); // small integers: exact in any order
        assert_eq!(dot8(&x, &y), want_dot, "dot8 of {n}");
        for at in 0..n {
            let mut z = x.clone();
            z[at] = 100.0; // the largest, in a lane or in the tail
            assert_eq!(max8(&z), 100.0, "max8 of {n} with the largest at {at}");
        }
    }
}
