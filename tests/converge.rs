//! `converge`'s criterion (src/commands/converge.rs): exact while a harmless change of the
//! baseline stays within the tolerance, then a band measured from that change; a layout that is
//! wrong from the start fails however wide the band later grows.

use ferrotron::commands::converge::{self, parse_variants, Criterion, BAND_FACTOR};

mod common;

/// A curve that descends, and copies of it that part from it as training amplifies rounding.
fn curves() -> (Vec<f32>, Vec<f32>) {
    let baseline: Vec<f32> = (0..300).map(|s| 4.0 * (-(s as f32) / 80.0).exp() + 1.0).collect();
    // the harmless change: 1e-7 at first, growing tenfold every 25 steps from step 100, up to 3e-2
    let noise = |s: usize| if s < 100 { 1e-7 } else { (1e-7 * 10f32.powf((s - 100) as f32 / 25.0)).min(3e-2) };
    let perturbed =
        baseline.iter().enumerate().map(|(s, b)| b + noise(s) * if s % 2 == 0 { 1.0 } else { -1.0 }).collect();
    (baseline, perturbed)
}

#[test]
fn the_band_opens_only_where_the_harmless_change_leaves_the_tolerance() {
    let (baseline, perturbed) = curves();
    let c = Criterion::banded(1e-4, &baseline, &perturbed, "every initial weight moved by one f32 ulp");
    let exact = c.allowed.iter().take_while(|&&a| a == 1e-4).count();
    assert!((145..=155).contains(&exact), "10 × the change passes 1e-4 near step 150, not {exact}");
    assert!((c.allowed.last().unwrap() - BAND_FACTOR * 3e-2).abs() < 1e-5, "{:?}", c.allowed.last());
    assert!(c.allowed.windows(2).all(|w| w[1] >= w[0]), "the band never narrows");
    let said = c.describe();
    assert!(said.contains("one f32 ulp") && said.contains(&format!("held up to step {exact}")), "{said}");

    // a layout that rounds differently: parts like the harmless change, a few times larger
    let rounding: Vec<f32> = baseline.iter().zip(&perturbed).map(|(b, p)| b + 3.0 * (p - b)).collect();
    let (pass, max_diff, _) = c.judge(&rounding, &baseline);
    assert!(pass && max_diff > 1e-2, "{max_diff}");
    // a broken layout: 1e-3 off from step 3, although later the band is wider than that
    let broken: Vec<f32> = baseline.iter().enumerate().map(|(s, b)| b + if s >= 3 { 1e-3 } else { 0.0 }).collect();
    let (pass, _, worst) = c.judge(&broken, &baseline);
    assert!(!pass && worst < exact, "fails where the check is exact, at {worst}");
    // a run that blew up, or stopped early
    let mut nan = baseline.clone();
    nan[250] = f32::NAN;
    assert!(!c.judge(&nan, &baseline).0);
    assert!(!c.judge(&baseline[..200], &baseline).0);
    // the exact criterion is the tolerance everywhere
    let exact = Criterion::exact(1e-4, baseline.len());
    assert!(!exact.judge(&rounding, &baseline).0 && exact.judge(&baseline, &baseline).0);
}

#[test]
fn a_variant_off_the_curve_fails_and_the_output_names_the_criterion() {
    let sets: Vec<String> = [
        "train.steps=6",
        "model.num_hidden_layers=1",
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "train.seq_len=32",
        "data.copy_lag=8",
        "train.micro_batch_size=4",
    ]
    .map(String::from)
    .to_vec();
    // dp=2 follows exactly; a learning rate 3% off is a planted bug no band may hide
    let variants = parse_variants("dp=2;dp=2,train.lr=1.03e-3").unwrap();
    let report = converge::converge(None, &sets, &variants, 1e-4).unwrap();
    assert!(report.outcomes[0].pass, "dp=2: {}", report.outcomes[0].max_diff);
    assert!(!report.outcomes[1].pass, "the wrong learning rate passed: {}", report.outcomes[1].max_diff);
    let (what, largest) = report.criterion.perturbation.as_ref().expect("a failing variant measures the band");
    assert!(what.contains("one f32 ulp") && *largest < 1e-4, "{what}: {largest}");
    let table = converge::table(&report);
    assert!(
        table.starts_with(
            "criterion: at each step |Δloss| ≤ max(1e-4, 10 × the largest |Δloss| so far of a harmless change"
        ) && table.contains("FAIL"),
        "{table}"
    );
    // when every variant is within the tolerance, nothing more runs and the criterion says so
    let report = converge::converge(None, &sets, &parse_variants("dp=2").unwrap(), 1e-4).unwrap();
    assert!(
        report.criterion.perturbation.is_none()
            && converge::table(&report).starts_with("criterion: |Δloss| ≤ 1e-4 at every step")
    );
}

#[test]
fn converge_refuses_a_meaningless_tolerance_and_a_key_set_twice() {
    for tol in [f32::NAN, -1e-4, f32::INFINITY] {
        let e = converge::converge(None, &[], &parse_variants("dp=2").unwrap(), tol).err().unwrap();
        assert!(format!("{e:#}").contains("--tol"), "{e:#}");
    }
    let e = parse_variants("dp=2,dp=4").err().unwrap().to_string();
    assert!(e.contains("parallel.dp twice") && e.contains("`dp=2,dp=4`"), "{e}");
    let e = parse_variants("tp=2;dp=2,parallel.dp=4").err().unwrap().to_string();
    assert!(e.contains("parallel.dp twice"), "{e}");
}

#[test]
fn layouts_are_compared_at_the_same_global_batch() {
    // tests/training_gpu.rs's comparison, on the CPU: dp=2 over a micro-batch size of 4 used to
    // train on 8 sequences a step against one rank's 4, and failed by 3.9e-2 on an H100 (the same
    // 3.9e-2 here: nothing GPU about it); through converge each replica takes 2
    let base: Vec<&str> = [common::SMALL, &["train.micro_batch_size=4", "train.steps=10"]].concat();
    let diff = common::layout_against_one_rank(&base, &["parallel.dp=2", "parallel.tp=2"]);
    assert!(diff <= 1e-5, "dp=2,tp=2 against one rank: {diff:.1e}");
}

#[test]
fn the_harmless_change_moves_each_weight_by_one_rounding() {
    use ferrotron::model::init::nudge;
    use ferrotron::ops::DType;
    let values = [1.0f32, -0.02, 3.5e-3, 0.0, 7.25];
    for (dtype, ulp) in [(DType::F32, f32::EPSILON), (DType::Bf16, 2f32.powi(-7))] {
        let moved = nudge("w", &values, dtype);
        for (v, m) in values.iter().zip(&moved) {
            let scale = v.abs().max(f32::MIN_POSITIVE);
            assert!(m != v && (m - v).abs() <= 1.01 * ulp * scale, "{dtype:?}: {v} → {m}");
        }
        assert!(moved.iter().zip(&values).any(|(m, v)| m > v) && moved.iter().zip(&values).any(|(m, v)| m < v));
        assert_eq!(moved, nudge("w", &values, dtype), "the same stream every time");
    }
}

#[test]
fn a_rounding_moves_a_mixture_of_experts_by_far_more_than_a_dense_model() {
    // Issue 35's GPU-only MoE failures (step 20: 2.7e-2 over 40 steps; converge ep2·dp2·tp2:
    // 2.5e-4), reproduced on the CPU. On a GPU a layout's products run other cuBLAS kernels than
    // one rank's and round differently; here the same difference is made on purpose: every
    // initial weight moved by one f32 ulp. A dense model's curve barely moves in 40 steps; a
    // mixture of experts' moves by 1e-2, because a token whose two best experts were nearly tied
    // goes to another expert, and training carries the change on. So MoE layouts cannot be held
    // to 1e-4 on a GPU; converge and the tutorial hold them to the band this change measures.
    use ferrotron::config::Config;
    use ferrotron::train::{train, Options};
    let losses = |sets: &[&str], nudge_weights: bool| {
        let mut all = vec!["train.steps=40", "train.warmup_steps=10", "train.micro_batch_size=8"];
        all.extend(sets);
        let cfg = Config::load(None, &all.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        train(&cfg, Options { quiet: true, nudge_weights, ..Default::default() }).unwrap().losses
    };
    let max_diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    let dense = max_diff(&losses(&[], false), &losses(&[], true));
    let moe_sets = ["model.num_local_experts=4", "model.num_experts_per_tok=2", "model.initializer_range=0.1"];
    let (moe, moe_nudged) = (losses(&moe_sets, false), losses(&moe_sets, true));
    let moved = max_diff(&moe, &moe_nudged);
    assert!(dense < 1e-5, "a dense model moved {dense:.1e}");
    assert!(moved > 1e-3, "the mixture of experts moved only {moved:.1e}");
    // a fixed tolerance calls a curve a rounding away a failure, as the H100 run did; the band
    // measured from that change does not (on a GPU the layout's own rounding stands in for it)
    assert!(!Criterion::exact(1e-4, moe.len()).judge(&moe_nudged, &moe).0);
    assert!(Criterion::banded(1e-4, &moe, &moe_nudged, "one f32 ulp").judge(&moe_nudged, &moe).0);
}
