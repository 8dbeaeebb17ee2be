//! Context parallelism: ring attention against full attention (forward and backward) for both
//! splits; cp, dp×cp, tp×cp and cp×pp training on the single-rank curve; the work balance of the
//! two splits; the errors.

mod common;

use ferrotron::comm::launcher::launch;
use ferrotron::comm::process_grid::{Axis, Grid};
use ferrotron::commands::converge::{self, parse_variants};
use ferrotron::config::{Config, CpSplit};
use ferrotron::model::SequenceSplit;
use ferrotron::ops::tensor::Tensor;
use ferrotron::ops::{self, Attn};
use ferrotron::parallel::context_parallel::{self as cp, Ring};
use ferrotron::train::{train_all, Options};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Duration;

fn randn(seed: u64, shape: &[usize]) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Tensor::from_vec(shape, (0..shape.iter().product()).map(|_| rng.gen::<f32>() * 2.0 - 1.0).collect())
}

fn close(got: &Tensor, want: &[f32], what: &str) {
    assert_eq!(got.numel(), want.len(), "{what}: size");
    for (i, (a, b)) in got.to_vec().iter().zip(want).enumerate() {
        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{what}[{i}]: {a} vs {b}");
    }
}

#[test]
fn ring_attention_matches_full_attention() {
    let (batch, seq, heads, kv_heads, hd) = (2, 16, 4, 2, 4);
    let full = Attn { batch, seq, kv_seq: seq, heads, kv_heads, head_dim: hd };
    let (q, k, v) = (
        randn(1, &[batch * seq, heads * hd]),
        randn(2, &[batch * seq, kv_heads * hd]),
        randn(3, &[batch * seq, kv_heads * hd]),
    );
    let dout = randn(4, &[batch * seq, heads * hd]);
    let pos: Vec<u32> = (0..seq as u32).collect();
    let (out, lse) = ops::attention(full, &q, &k, &v, (&pos, &pos));
    let (dq, dk, dv) = ops::attention_backward(full, (&q, &k, &v), (&pos, &pos), (&out, &lse), &dout);
    for split in [CpSplit::Contiguous, CpSplit::Zigzag] {
        for n in [2, 4] {
            launch(Grid::new(1, 1, n, 1).unwrap(), Duration::from_secs(30), |me| {
                let group = me.group(Axis::Cp);
                let ring = Ring { group, split };
                let mine = cp::positions(split, n, group.index(), seq);
                let index: Vec<usize> = cp::local_rows(&(0..batch * seq).collect::<Vec<_>>(), seq, &mine);
                let rows = |t: &Tensor| {
                    let (c, data) = (t.cols(), t.to_vec());
                    Tensor::from_vec(
                        &[index.len(), c],
                        index.iter().flat_map(|&r| data[r * c..(r + 1) * c].to_vec()).collect(),
                    )
                };
                let local = Attn { seq: seq / n, kv_seq: seq / n, ..full };
                let (lq, lk, lv, ldo) = (rows(&q), rows(&k), rows(&v), rows(&dout));
                let (o, l, _) = ring.attention(local, &lq, &lk, &lv, &mine)?;
                close(&o, &rows(&out).to_vec(), &format!("{split:?} cp={n} out"));
                let (gq, gk, gv) = ring.attention_backward(local, (&lq, &lk, &lv), &mine, (&o, &l), &ldo)?;
                close(&gq, &rows(&dq).to_vec(), &format!("{split:?} cp={n} dq"));
                close(&gk, &rows(&dk).to_vec(), &format!("{split:?} cp={n} dk"));
                close(&gv, &rows(&dv).to_vec(), &format!("{split:?} cp={n} dv"));
                Ok(())
            })
            .unwrap_or_else(|e| panic!("{split:?} cp={n}: {e:#}"));
        }
    }
}

#[test]
fn zigzag_gives_each_rank_an_early_and_a_late_chunk() {
    assert_eq!(cp::positions(CpSplit::Zigzag, 2, 0, 8), vec![0, 1, 6, 7]);
    assert_eq!(cp::positions(CpSplit::Zigzag, 2, 1, 8), vec![2, 3, 4, 5]);
    assert_eq!(cp::positions(CpSplit::Contiguous, 2, 1, 8), vec![4, 5, 6, 7]);
}

fn sets(extra: &[&str]) -> Vec<String> {
    let run = ["train.micro_batch_size=4", "train.grad_accum_steps=2", "train.steps=20", "train.warmup_steps=5"];
    common::SMALL.iter().chain(&run).chain(extra).map(|s| s.to_string()).collect()
}

#[test]
fn cp_with_both_splits_and_with_dp_tp_pp_follow_the_single_rank_curve() {
    let spec = "cp=2;cp=4;cp=2,cp_split=contiguous;cp=4,cp_split=contiguous;dp=2,cp=2;tp=2,cp=2;cp=2,pp=2";
    let converge::Report { baseline, outcomes, .. } =
        converge::converge(None, &sets(&[]), &parse_variants(spec).unwrap(), 1e-4).unwrap();
    assert!(baseline[19] < baseline[0] - 0.5, "the baseline learns");
    for o in &outcomes {
        assert!(o.pass, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
}

#[test]
fn zigzag_balances_the_work_that_contiguous_does_not() {
    let work = |split: &str| -> Vec<u64> {
        let cfg =
            Config::load(None, &sets(&["parallel.cp=4", &format!("parallel.cp_split=\"{split}\""), "train.steps=1"]))
                .unwrap();
        train_all(&cfg, Options { quiet: true, ..Default::default() })
            .unwrap()
            .iter()
            .map(|s| s.attention_work)
            .collect()
    };
    let contiguous = work("contiguous");
    assert_eq!(
        contiguous.iter().map(|w| w / contiguous[0]).collect::<Vec<_>>(),
        vec![1, 2, 3, 4],
        "rank r computes r + 1 blocks: {contiguous:?}"
    );
    let zigzag = work("zigzag");
    assert!(zigzag.iter().all(|&w| w == zigzag[0]), "zigzag: {zigzag:?}");
}

#[test]
fn sequence_lengths_that_do_not_split_are_errors() {
    let err = |extra: &[&str]| format!("{:#}", Config::load(None, &sets(extra)).unwrap_err());
    assert!(err(&["parallel.cp=3"]).contains("train.seq_len = 32 does not split into 6 equal chunks"));
    assert!(err(&["parallel.cp=3", "parallel.cp_split=\"contiguous\""]).contains("into 3 equal chunks"));
}
