//! Context parallelism: ring and Ulysses attention against full attention (forward and backward)
//! for both splits, Ulysses with as many KV heads as ranks, fewer (repeated) and more; cp, dp×cp,
//! tp×cp and cp×pp training on the single-rank curve, in both modes (Ulysses also with ZeRO and
//! sequence parallelism); the bytes each mode moves; the work balance of the two splits; the errors.

mod common;

use ferrotron::comm::cost::Call;
use ferrotron::comm::launcher::launch;
use ferrotron::comm::process_grid::{Axis, Grid};
use ferrotron::commands::converge::{self, parse_variants};
use ferrotron::config::{Config, CpSplit};
use ferrotron::model::SequenceSplit;
use ferrotron::ops::tensor::Tensor;
use ferrotron::ops::{self, Attn};
use ferrotron::parallel::context_parallel::{self as cp, Ring};
use ferrotron::parallel::ulysses::Ulysses;
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

/// Every rank's slice of a full attention, forward and backward, against the full attention, for
/// both splits on 2 and 4 ranks, with `kv_heads` KV heads: ring attention or Ulysses (`ulysses`).
fn split_attention_matches_full_attention(ulysses: bool, heads: usize, kv_heads: usize) {
    let (batch, seq, hd) = (2, 16, 4);
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
                let attention: Box<dyn SequenceSplit> = match ulysses {
                    true => Box::new(Ulysses { group, split }),
                    false => Box::new(Ring { group, split }),
                };
                let mine = cp::positions(split, n, group.index(), seq);
                let index: Vec<usize> = ferrotron::data::rows_at(&(0..batch * seq).collect::<Vec<_>>(), seq, &mine);
                let rows = |t: &Tensor| {
                    let (c, data) = (t.cols(), t.to_vec());
                    Tensor::from_vec(
                        &[index.len(), c],
                        index.iter().flat_map(|&r| data[r * c..(r + 1) * c].to_vec()).collect(),
                    )
                };
                let what = |t: &str| format!("ulysses {ulysses} {split:?} cp={n} kv={kv_heads} {t}");
                let local = Attn { seq: seq / n, kv_seq: seq / n, ..full };
                let (lq, lk, lv, ldo) = (rows(&q), rows(&k), rows(&v), rows(&dout));
                let (o, l, _) = attention.attention(local, &lq, &lk, &lv, &mine)?;
                close(&o, &rows(&out).to_vec(), &what("out"));
                // the log-sum-exp of my positions, [batch, heads, seq / n]
                let want_lse: Vec<f32> = (lse.to_vec().chunks(seq))
                    .flat_map(|r| mine.iter().map(|&p| r[p as usize]).collect::<Vec<_>>())
                    .collect();
                close(&l, &want_lse, &what("lse"));
                let (gq, gk, gv) = attention.attention_backward(local, (&lq, &lk, &lv), &mine, (&o, &l), &ldo)?;
                close(&gq, &rows(&dq).to_vec(), &what("dq"));
                close(&gk, &rows(&dk).to_vec(), &what("dk"));
                close(&gv, &rows(&dv).to_vec(), &what("dv"));
                Ok(())
            })
            .unwrap_or_else(|e| panic!("{split:?} cp={n}: {e:#}"));
        }
    }
}

#[test]
fn ring_attention_matches_full_attention() {
    split_attention_matches_full_attention(false, 4, 2);
}

#[test]
fn ulysses_attention_matches_full_attention_with_any_kv_heads() {
    // 4 KV heads split over 2 and 4 ranks; 2 over 4 ranks and 1 over 2 and 4 are repeated first
    for (heads, kv_heads) in [(8, 4), (4, 2), (8, 1), (4, 4)] {
        split_attention_matches_full_attention(true, heads, kv_heads);
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
fn ulysses_follows_the_single_rank_curve_alone_and_with_dp_tp_pp_zero() {
    // SMALL has 4 heads and 2 KV heads: cp = 4 repeats each KV head, tp = 2 × cp = 2 too
    let u = "cp_mode=ulysses";
    let spec = format!(
        "cp=2,{u};cp=4,{u};cp=2,cp_split=contiguous,{u};dp=2,cp=2,{u};tp=2,cp=2,{u};\
         tp=2,cp=2,sequence_parallel=true,{u};cp=2,pp=2,{u};dp=2,cp=2,zero_stage=3,{u}"
    );
    let converge::Report { outcomes, .. } =
        converge::converge(None, &sets(&[]), &parse_variants(&spec).unwrap(), 1e-4).unwrap();
    for o in &outcomes {
        assert!(o.pass, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
}

/// The bytes a rank's cp group sends in one step of a 4-layer model with `seq_len`, by kind of
/// call: (all-to-all, point to point).
fn cp_bytes(mode: &str, seq_len: usize) -> (u64, u64) {
    let extra = [
        "parallel.cp=4".to_string(),
        format!("parallel.cp_mode=\"{mode}\""),
        format!("train.seq_len={seq_len}"),
        "train.steps=1".into(),
        "train.grad_accum_steps=1".into(),
    ];
    let extra: Vec<&str> = extra.iter().map(|s| s.as_str()).collect();
    let cfg = Config::load(None, &sets(&extra)).unwrap();
    let summary = ferrotron::train::train(&cfg, Options { quiet: true, ..Default::default() }).unwrap();
    let of = |call: Call| summary.comm.iter().filter(|t| t.axis == "cp" && t.call == call).map(|t| t.tally.bytes).sum();
    (of(Call::AllToAll), of(Call::P2p))
}

#[test]
fn ulysses_moves_its_tensors_by_all_to_all_and_the_ring_its_blocks_point_to_point() {
    let ((ring_a2a, ring_p2p), (uly_a2a, uly_p2p)) = (cp_bytes("ring", 64), cp_bytes("ulysses", 64));
    assert!(ring_a2a == 0 && ring_p2p > 0 && uly_p2p == 0 && uly_a2a > 0, "{ring_p2p} {uly_a2a}");
    // both grow with the sequence, linearly
    let ((_, ring_long), (uly_long, _)) = (cp_bytes("ring", 128), cp_bytes("ulysses", 128));
    assert_eq!((ring_long, uly_long), (2 * ring_p2p, 2 * uly_a2a));
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
    // Ulysses splits the heads: SMALL's 4 over cp = 8 cannot be
    let e = err(&["parallel.cp=8", "parallel.cp_mode=\"ulysses\"", "train.seq_len=64"]);
    assert!(e.contains("each tp rank's 4 attention heads") && e.contains("parallel.cp = 8"), "{e}");
}
