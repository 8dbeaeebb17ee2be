//! The two places where the CPU reference trades the obvious code for speed, checked against the
//! obvious code: its vectorisable `exp` against f64's, and its GEMM, cut into one block per
//! thread, against the same product on one thread (the bits must not depend on the cut).

use ferrotron::ops::cpu_math::{exp, gemm, View};

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
        // and it is the product: one element by hand
        let (i, j) = (m - 1, n / 2);
        let at = |i: usize, l: usize| if transposed { a[l * m + i] } else { a[i * k + l] };
        let want: f32 =
            (0..k).map(|l| at(i, l) * b[l * n + j]).sum::<f32>() + if accumulate { c0[i * n + j] } else { 0.0 };
        assert!((one[i * n + j] - want).abs() < 1e-3, "{m}x{k}x{n}: c[{i},{j}] = {} not {want}", one[i * n + j]);
    }
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
