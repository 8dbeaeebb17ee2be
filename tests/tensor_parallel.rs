//! Tensor parallelism: each parallel layer against its dense twin (output, input gradient,
//! weight gradient) for tp = 1, 2, 4; the model's shards cut from the single-rank init; tp and
//! dp×tp training on the single-rank loss curve.

mod common;

use ferrotron::comm::launcher::launch;
use ferrotron::comm::placement::{part_of, Placement};
use ferrotron::comm::process_grid::{Axis, Grid};
use ferrotron::comm::trace::Trace;
use ferrotron::comm::ReduceOp;
use ferrotron::commands::converge::{self, parse_variants};
use ferrotron::config::Config;
use ferrotron::model::split::Now;
use ferrotron::model::stage::Stage;
use ferrotron::model::{Llama, Param};
use ferrotron::model::{TensorSplit, Whole};
use ferrotron::ops;
use ferrotron::ops::tensor::Tensor;
use ferrotron::ops::Precision::F32;
use ferrotron::ops::TpCut;
use ferrotron::parallel::tensor_parallel::TensorParallel;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Duration;

fn randn(seed: u64, shape: &[usize]) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Tensor::from_vec(shape, (0..shape.iter().product()).map(|_| rng.gen::<f32>() * 2.0 - 1.0).collect())
}

fn param(value: Tensor) -> Param {
    Param::new("w".into(), value, TpCut::Whole)
}

fn close(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    for (i, (a, b)) in got.to_vec().iter().zip(want.to_vec()).enumerate() {
        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{what}[{i}]: {a} vs {b}");
    }
}

fn tp_grid(n: usize) -> Grid {
    Grid::new(1, 1, 1, n).unwrap()
}

#[test]
fn column_and_row_parallel_linear_match_dense() {
    let (m, k, n) = (5, 8, 12);
    let (x, w, dy) = (randn(1, &[m, k]), randn(2, &[n, k]), randn(3, &[m, n]));
    let (w2, dy2) = (randn(7, &[n, k]), randn(8, &[m, n])); // a second layer reading the same x
                                                            // the dense twins
    let y = ops::linear(&x, &w, F32);
    let (mut dw, mut dw2) = (Tensor::zeros(&[n, k]), Tensor::zeros(&[n, k]));
    let dx = ops::linear_backward(&dy, &x, &w, &mut dw, F32);
    let mut dx_both = ops::linear_backward(&dy2, &x, &w2, &mut dw2, F32);
    ops::add_assign(&mut dx_both, &dx);
    let mut dense = [param(w.clone()), param(w2.clone())];
    let [a, b] = &mut dense;
    let now = &mut Now;
    let got = Whole.column_backward(x.clone(), vec![(dy.clone(), a), (dy2.clone(), b)], now).unwrap();
    close(&got, &dx_both, "dense column dx of two layers");
    close(&dense[1].grad, &dw2, "dense column dW");
    // the row-parallel twin works on [m, k] → [m, n] with the weight cut by columns
    for size in [1, 2, 4] {
        launch(tp_grid(size), Duration::from_secs(30), |me| {
            let (tp, i) = (TensorParallel::new(me.group(Axis::Tp)), me.group(Axis::Tp).index());
            // column parallel: output features split; two layers share one all-reduce of dx (f)
            let (mut wc, mut wc2) = (
                param(part_of(&w, Placement::Shard(0), (i, size))),
                param(part_of(&w2, Placement::Shard(0), (i, size))),
            );
            close(&ops::linear(&x, &wc.value, F32), &part_of(&y, Placement::Shard(1), (i, size)), "column y");
            let (dy_i, dy2_i) =
                (part_of(&dy, Placement::Shard(1), (i, size)), part_of(&dy2, Placement::Shard(1), (i, size)));
            let layers = vec![(dy_i, &mut wc), (dy2_i, &mut wc2)];
            let dx_col = tp.column_backward(x.clone(), layers, &mut Now)?;
            close(&dx_col, &dx_both, "column dx (summed over layers, all-reduced)");
            close(&wc.grad, &part_of(&dw, Placement::Shard(0), (i, size)), "column dW");
            close(&wc2.grad, &part_of(&dw2, Placement::Shard(0), (i, size)), "column dW of the second layer");
            // row parallel: input features split, output summed
            let mut wr = param(part_of(&w, Placement::Shard(1), (i, size)));
            let x_part = part_of(&x, Placement::Shard(1), (i, size));
            close(&tp.row_forward(&x_part, &wr)?, &y, "row y (all-reduced)");
            let row_dx = ops::linear_backward(&dy, &x_part, &wr.value, &mut wr.grad, F32); // local
            close(&row_dx, &part_of(&dx, Placement::Shard(1), (i, size)), "row dx");
            close(&wr.grad, &part_of(&dw, Placement::Shard(1), (i, size)), "row dW");
            Ok(())
        })
        .unwrap_or_else(|e| panic!("tp = {size}: {e:#}"));
    }
}

#[test]
fn vocab_parallel_embedding_and_cross_entropy_match_dense() {
    let (vocab, dim, rows) = (16, 6, 7);
    let table = randn(4, &[vocab, dim]);
    let tokens: Vec<u32> = vec![0, 15, 3, 8, 8, 12, 7];
    let logits = randn(5, &[rows, vocab]);
    let targets = [3i32, 15, -1, 0, 8, 9, 4];
    let dout = randn(6, &[rows, dim]);
    let x = ops::embedding(&table, &tokens, 0);
    let mut dtable = Tensor::zeros(&[vocab, dim]);
    ops::embedding_backward(&dout, &tokens, 0, &mut dtable);
    let (loss, count, lse) = Whole.cross_entropy(&logits, &targets, 0).unwrap();
    let loss = loss.to_vec()[0];
    let dlogits = ops::cross_entropy_backward(&logits, &targets, 0, &lse, 0.5);
    for size in [1, 2, 4] {
        launch(tp_grid(size), Duration::from_secs(30), |me| {
            let (tp, i) = (TensorParallel::new(me.group(Axis::Tp)), me.group(Axis::Tp).index());
            let first = i * vocab / size;
            let mut t = param(part_of(&table, Placement::Shard(0), (i, size)));
            close(&tp.embedding_forward(&t, &tokens, first)?, &x, "embedding");
            ops::embedding_backward(&dout, &tokens, first, &mut t.grad); // local
            close(&t.grad, &part_of(&dtable, Placement::Shard(0), (i, size)), "embedding grad");
            let part = part_of(&logits, Placement::Shard(1), (i, size));
            let (s, c, l) = tp.cross_entropy(&part, &targets, first)?;
            let s = s.to_vec()[0];
            assert!((s - loss).abs() < 1e-5 * loss && c == count, "loss {s} vs {loss}, rows {c} vs {count}");
            close(&l, &lse, "log-sum-exp");
            let d = ops::cross_entropy_backward(&part, &targets, first, &l, 0.5);
            close(&d, &part_of(&dlogits, Placement::Shard(1), (i, size)), "dlogits");
            Ok(())
        })
        .unwrap_or_else(|e| panic!("tp = {size}: {e:#}"));
    }
    assert_eq!(count, 6, "the row with target −1 is ignored");
}

#[test]
fn shards_are_cut_from_the_single_rank_init() {
    let cfg = Config::load(None, &["parallel.tp=4".to_string()]).unwrap();
    let dense: Vec<Tensor> = Llama::new(&cfg.model, 7).params().iter().map(|p| p.value.clone()).collect();
    launch(tp_grid(4), Duration::from_secs(30), |me| {
        let model = Llama::init(&cfg.model, 7, Box::new(TensorParallel::new(me.group(Axis::Tp))), Stage::WHOLE);
        for (p, full) in model.params().iter().zip(&dense) {
            let i = me.group(Axis::Tp).index();
            assert_eq!(p.value.to_vec(), part_of(full, p.tp.into(), (i, 4)).to_vec(), "{}", p.name);
        }
        // and the shards of a row-split weight add back up to the whole
        let mut rows = [model.params()[0].value.rows() as f32];
        me.group(Axis::Tp).all_reduce(&mut rows, ReduceOp::Sum)?;
        assert_eq!(rows[0] as usize, cfg.model.vocab_size);
        Ok(())
    })
    .unwrap();
}

#[test]
fn tp_and_dp_tp_follow_the_single_rank_curve() {
    let mut sets: Vec<String> = common::SMALL.iter().map(|s| s.to_string()).collect();
    sets.extend(
        ["model.num_key_value_heads=4", "train.micro_batch_size=8", "train.steps=20", "train.warmup_steps=5"]
            .map(String::from),
    );
    let variants = parse_variants("tp=2;tp=4;dp=2,tp=2;tp=2,model.tie_word_embeddings=true").unwrap();
    let converge::Report { baseline, outcomes, .. } = converge::converge(None, &sets, &variants, 1e-4).unwrap();
    assert!(baseline[19] < baseline[0] - 0.5, "the baseline learns");
    for o in outcomes.iter().take(3) {
        assert!(o.pass, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
    // the tied variant is a different model: it must differ from the untied baseline, and match
    // its own single-rank run
    assert!(outcomes[3].max_diff > 1e-3);
    sets.push("model.tie_word_embeddings=true".into());
    let converge::Report { baseline: tied, outcomes: tied_tp, .. } =
        converge::converge(None, &sets, &parse_variants("tp=2;dp=2,tp=2").unwrap(), 1e-4).unwrap();
    assert!(
        tied_tp.iter().all(|o| o.pass),
        "tied under tp: {:?}",
        tied_tp.iter().map(|o| o.max_diff).collect::<Vec<_>>()
    );
    assert!(tied[19] < tied[0] - 0.5);
}

#[test]
fn a_block_talks_twice_forward_and_twice_backward() {
    // Megatron's picture: g after o and after down; f once for q|k|v and once for gate|up
    let count = |layers: usize| -> (usize, usize) {
        let sets = [format!("model.num_hidden_layers={layers}"), "parallel.tp=2".into()];
        let cfg = Config::load(None, &sets).unwrap();
        let (seq, batch) = (16, 2);
        let tokens: Vec<u32> = (0..batch * seq).map(|i| (i * 7 % cfg.model.vocab_size) as u32).collect();
        let targets: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let counts = launch(tp_grid(2), Duration::from_secs(30), |me| {
            let trace = Trace::default();
            me.trace_to(&trace).unwrap();
            let tp = Box::new(TensorParallel::new(me.group(Axis::Tp)));
            let mut model = Llama::init(&cfg.model, 3, tp, Stage::WHOLE);
            let tp_calls = || trace.comm_spans(|n| n.starts_with("all_reduce") && n.ends_with("tp[0,1]")).len();
            model.forward(&tokens, batch, &targets)?;
            let forward = tp_calls();
            model.backward(1.0)?;
            Ok((forward, tp_calls() - forward))
        })
        .unwrap();
        counts[0]
    };
    let ((f1, b1), (f3, b3)) = (count(1), count(3));
    assert_eq!(((f3 - f1) / 2, (b3 - b1) / 2), (2, 2), "all-reduces per block (forward, backward)");
    // outside the blocks: the embedding's g and the cross-entropy's three statistics; the output
    // layer's f in backward
    assert_eq!((f1, b1), (4 + 2, 1 + 2));
}

/// A model with fewer KV heads than the tp ranks below: 8 query heads, 2 KV heads (4 query heads
/// each), 4 values a head.
const FEW_KV_HEADS: [&str; 9] = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=8",
    "model.num_key_value_heads=2",
    "train.seq_len=32",
    "data.copy_lag=8",
    "train.micro_batch_size=4",
    "train.warmup_steps=2",
];

#[test]
fn kv_heads_fewer_than_tp_are_copied_and_follow_the_single_rank_curve() {
    // tp 4 over 2 KV heads: ranks 0, 1 hold head 0, ranks 2, 3 head 1; tp 8, four copies of each
    let mut sets: Vec<String> = FEW_KV_HEADS.iter().map(|s| s.to_string()).collect();
    sets.push("train.steps=8".into());
    let layouts = [
        "tp=4",
        "tp=8",
        "tp=4,sequence_parallel=true",
        "tp=4,cp=2",
        "tp=4,cp=2,cp_split=contiguous",
        "tp=4,cp=2,cp_mode=ulysses",
        "tp=4,pp=2,grad_accum_steps=2,micro_batch_size=2",
        "dp=2,tp=4,zero_stage=3",
    ];
    let variants = parse_variants(&layouts.join(";")).unwrap();
    let converge::Report { baseline, outcomes, .. } = converge::converge(None, &sets, &variants, 1e-4).unwrap();
    assert!(baseline[7] < baseline[0] - 0.1, "the baseline learns: {baseline:?}");
    for o in &outcomes {
        assert!(o.pass, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
    // Muon orthogonalises each matrix whole: a copied head's slice joins the others once
    sets.push("train.optimizer=muon".into());
    let muon = parse_variants("tp=4;dp=2,tp=4,zero_stage=1").unwrap();
    let converge::Report { outcomes, .. } = converge::converge(None, &sets, &muon, 1e-4).unwrap();
    for o in &outcomes {
        assert!(o.pass, "Muon, {}: max |Δloss| {:e}", o.label, o.max_diff);
    }
}

#[test]
fn a_copied_kv_head_is_one_tensor_in_a_checkpoint_and_resumes_into_any_tp() {
    // 2 KV heads: tp 4 holds two copies of each, saved once; resumed at tp 1 and back
    let base: Vec<String> = FEW_KV_HEADS.iter().map(|s| s.to_string()).collect();
    common::checkpoints_move_between(&base, &["parallel.tp=4"], &["parallel.tp=1"]);
    let muon = "train.optimizer=muon";
    common::checkpoints_move_between(&base, &["parallel.tp=8", muon], &["parallel.tp=2", muon]);
}

#[test]
fn memory_counts_a_copied_kv_head_on_every_rank_that_holds_it() {
    // each rank's weights are exactly its parameters' values (4 bytes each on the CPU): at tp 4
    // over 2 KV heads a rank's k_proj and v_proj are one whole head each, not a half
    let base: Vec<String> = FEW_KV_HEADS.iter().map(|s| s.to_string()).collect();
    for tp in [2, 4, 8] {
        let cfg = Config::load(None, &[&base[..], &[format!("parallel.tp={tp}")]].concat()).unwrap();
        let held = launch(tp_grid(tp), Duration::from_secs(30), |me| {
            let model = Llama::init(&cfg.model, 7, Box::new(TensorParallel::new(me.group(Axis::Tp))), Stage::WHOLE);
            let kv: Vec<usize> =
                model.params().iter().filter(|p| p.name.contains("k_proj")).map(|p| p.value.rows()).collect();
            assert!(kv.iter().all(|&r| r == 4 * (2 / tp).max(1)), "tp {tp}: k_proj rows {kv:?}");
            Ok(model.params().iter().map(|p| p.value.numel()).sum::<usize>())
        })
        .unwrap();
        for r in ferrotron::commands::memory::memory(&cfg, false).unwrap() {
            assert_eq!(r.weights_bytes, 4.0 * held[r.rank] as f64, "tp {tp}, rank {}: weights", r.rank);
        }
        common::memory_estimate_within(&cfg, 0.1, &format!("tp {tp}"));
    }
}
