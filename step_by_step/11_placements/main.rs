//! Step 11 — placements: one vocabulary for where a tensor lives, and the collective between two.
//! `cargo run --release --example step11`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::comm::cost::Call;
use ferrotron::comm::launcher::launch;
use ferrotron::comm::placement::{part_of, redistribute, Move, Placement};
use ferrotron::comm::process_grid::{Axis, Grid};
use ferrotron::comm::ReduceOp;
use ferrotron::config::Config;
use ferrotron::data::Dataset;
use ferrotron::model::optimizer::AdamW;
use ferrotron::model::stage::Stage;
use ferrotron::model::{Llama, Param};
use ferrotron::ops::tensor::Tensor;
use ferrotron::parallel::data_parallel::every_on_dp_cp;
use ferrotron::parallel::sequence_parallel::SequenceParallel;
use ferrotron::parallel::zero::{self, Sharding};
use std::borrow::Cow;
use std::time::Duration;

const SUM: Placement = Placement::Partial(ReduceOp::Sum);
const AVG: Placement = Placement::Partial(ReduceOp::Avg);
const PLACEMENTS: [Placement; 4] = [Placement::Replicate, Placement::Shard(0), Placement::Shard(1), SUM];

/// Rank r's tensor when `whole` is placed as `p` over n ranks. A partial sum is a real one:
/// ranks 1.. hold small whole numbers of their own, rank 0 the rest, so the sum is exact.
fn placed(whole: &Tensor, p: Placement, (r, n): (usize, usize)) -> Tensor {
    let own =
        |j: usize| whole.to_vec().iter().enumerate().map(|(i, _)| ((i * 5 + j * 3) % 7) as f32).collect::<Vec<_>>();
    match (p, r) {
        (Placement::Partial(_), 0) => {
            let mut rest = whole.to_vec();
            for j in 1..n {
                rest.iter_mut().zip(own(j)).for_each(|(x, o)| *x -= o);
            }
            Tensor::from_vec(whole.shape(), rest)
        }
        (Placement::Partial(_), _) => Tensor::from_vec(whole.shape(), own(r)),
        _ => part_of(whole, p, (r, n)),
    }
}

/// The largest |a − b|.
fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    a.to_vec().iter().zip(b.to_vec()).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Part 1: a [8, 12] tensor through every move between the four placements, on 4 ranks.
fn every_move(cfg: &Config) -> Result<()> {
    let shape = [8, 12];
    let whole = Tensor::from_vec(&shape, (0..96).map(|i| ((i * 37) % 19) as f32 - 9.0).collect());
    let rows = launch(Grid::new(1, 1, 1, 4)?, Duration::from_secs(60), |me| {
        let (group, place) = (me.group(Axis::Tp), common::place(cfg, me.rank)?);
        let (r, n) = (group.index(), group.size());
        let mut rows = Vec::new();
        for from in PLACEMENTS {
            for to in PLACEMENTS.into_iter().filter(|&to| to != from) {
                group.ledger().take();
                let moved = redistribute(Cow::Owned(placed(&whole, from, (r, n)).to(&place)), &shape, from, to, group)?;
                let tally = group.ledger().take().into_iter().zip(Call::ALL).find(|(t, _)| t.calls > 0);
                let bytes = tally.map_or((0, 0.0), |(t, call)| (t.bytes, t.moved_bytes(call, n)));
                // the check: a partial through its sum, anything else slice by slice
                let (got, want) = match to {
                    Placement::Partial(_) => {
                        (redistribute(Cow::Owned(moved), &shape, to, Placement::Replicate, group)?, whole.clone())
                    }
                    _ => (moved, part_of(&whole, to, (r, n))),
                };
                rows.push((from, to, bytes, max_diff(&got, &want)));
            }
        }
        Ok(rows)
    })?;
    println!("a [8, 12] f32 tensor on 4 ranks: B is the collective's bytes (comm/cost.rs), then what each rank sends");
    println!("{:<14}{:<14}{:<42}{:>8}{:>12}", "from", "to", "move", "B", "each sends");
    let mut worst = 0.0f32;
    for (i, &(from, to, (b, sends), _)) in rows[0].iter().enumerate() {
        worst = rows.iter().map(|rank| rank[i].3).fold(worst, f32::max);
        let name = Move::between(from, to)?.name();
        println!("{:<14}{:<14}{name:<42}{b:>8}{sends:>12.0}", format!("{from:?}"), format!("{to:?}"));
    }
    let detail = format!("{} moves, max |Δ| {worst:.1e} on every rank", rows[0].len());
    common::claim("every move gives each rank its placement of the dense value", worst == 0.0, &detail)?;
    // and a local step sends nothing, a collective something
    let honest =
        rows[0].iter().all(|&(from, to, (b, _), _)| Move::between(from, to).is_ok_and(|m| m.communicates() == (b > 0)));
    common::claim("the local moves send no byte, the collectives do", honest, "by the group's ledger")
}

/// The table of part 2: each parallelism's weights, activations and gradients, in placements.
const TABLE: [(&str, &str, &str, &str); 8] = [
    (
        "04-05 data",
        "Replicate on dp",
        "Shard(0) on dp: each rank its sequences",
        "Partial(avg) → all-reduce → Replicate",
    ),
    ("06-07 ZeRO", "Shard(0) of flat values on dp", "as data parallel", "Partial(avg) → reduce-scatter → Shard(0)"),
    ("09 tensor", "Shard(0) q k v gate up emb head, Shard(1) o down", "Replicate on tp", "like their weights"),
    ("10 sequence", "as tensor parallel", "between layers Shard(0) of rows on tp", "norms Partial(sum) → all-reduce"),
    ("12-13 pipeline", "each stage its own layers", "sent stage to stage (point to point)", "each stage its own"),
    ("14 interleaved", "each stage V chunks of layers", "as pipeline", "as pipeline"),
    ("16 context", "Replicate on cp", "Shard(1): each rank its positions", "Partial(avg) over dp×cp"),
    (
        "20 experts",
        "experts Shard(0) on ep, Replicate on edp",
        "rows all-to-all'd to their experts",
        "experts Partial(avg) on edp, ÷ ep",
    ),
];

/// A parameter's placement on `axis`, in the words of this lesson: the tp slice (step 09), ZeRO's
/// partition on the axis sharding it (step 06); replicated on any other axis. (An expert's, its share
/// of its layer's experts on the ep axis, is step 20's.)
fn placement(p: &Param, axis: Axis) -> Placement {
    match axis {
        Axis::Tp => p.tp.into(), // rows Shard(0), columns Shard(1), whole Replicate
        a if zero::partition_of(p).is_some_and(|z| z.axis == a) => Placement::Shard(0),
        _ => Placement::Replicate,
    }
}

/// Is every parameter of `model` (rank `r` of `n` on `axis`) its placement of `dense`'s value?
fn placed_as(model: &Llama, dense: &[Tensor], axis: Axis, (r, n): (usize, usize)) -> bool {
    model.params().iter().zip(dense).all(|(p, d)| max_diff(&part_of(d, placement(p, axis), (r, n)), &p.value) == 0.0)
}

/// Part 2: the table, and the rows a few small runs can check.
fn every_parallelism(cfg: &Config) -> Result<()> {
    println!("\n{:<16}{:<50}{:<42}gradients", "steps", "weights", "activations");
    for (step, w, a, g) in TABLE {
        println!("{step:<16}{w:<50}{a:<42}{g}");
    }
    let m = &cfg.model;
    let dense = Llama::new(m, 3);
    let values: Vec<Tensor> = dense.params().iter().map(|p| p.value.clone()).collect();
    // tensor parallel, with sequence parallelism: weights as the table says, checked value by value
    let (batch, seq, v) = (2, cfg.train.seq_len, m.vocab_size);
    let tokens: Vec<u32> = (0..batch * seq).map(|i| ((i * 7 + i / 5) % v) as u32).collect();
    let targets: Vec<i32> = tokens.iter().skip(1).map(|&t| t as i32).chain([-1]).collect();
    let mut whole = Llama::new(m, 3);
    whole.forward(&tokens, batch, &targets)?;
    whole.backward(1.0)?;
    let grads: Vec<Tensor> = whole.params().iter().map(|p| p.grad.clone()).collect();
    let tp = launch(Grid::new(1, 1, 1, 2)?, Duration::from_secs(60), |me| {
        let group = me.group(Axis::Tp);
        let mut model = Llama::init(m, 3, Box::new(SequenceParallel::new(group)), Stage::WHOLE);
        let weights = placed_as(&model, &values, Axis::Tp, (group.index(), 2));
        model.forward(&tokens, batch, &targets)?;
        model.backward(1.0)?;
        // a norm saw half the rows: its gradient is Partial(sum) on tp; the others are their slices
        let mut worst = 0.0f32;
        for (p, want) in model.params_mut().into_iter().zip(&grads) {
            let grad = std::mem::replace(&mut p.grad, Tensor::zeros(&[0]));
            let got = match placement(p, Axis::Tp) {
                Placement::Replicate => redistribute(Cow::Owned(grad), want.shape(), SUM, Placement::Replicate, group)?,
                _ => grad,
            };
            worst = worst.max(max_diff(&got, &part_of(want, placement(p, Axis::Tp), (group.index(), 2))));
        }
        Ok((weights, worst))
    })?;
    let ok = tp.iter().all(|&(w, g)| w && g <= 1e-5);
    let detail = format!("{} weights, max |Δgrad| {:.1e}", values.len(), tp.iter().map(|r| r.1).fold(0.0, f32::max));
    common::claim("tp = 2 with sequence parallelism: the weights and gradients are the table's", ok, &detail)?;
    // data parallel: each replica's gradient is Partial(avg) of the whole batch's
    let data = Dataset::open(&cfg.data, m)?;
    let t = &cfg.train;
    let mut one = t.clone();
    one.micro_batch_size *= 2;
    let (tokens, targets) = data.micro_batch(&one, (0, 1), 0, 0)?;
    let mut whole = Llama::new(m, 3);
    whole.forward(&tokens, one.micro_batch_size, &targets)?;
    whole.backward(1.0)?;
    let grads: Vec<Tensor> = whole.params().iter().map(|p| p.grad.clone()).collect();
    let dp = launch(Grid::new(2, 1, 1, 1)?, Duration::from_secs(60), |me| {
        let group = me.group(Axis::DpCp);
        let mut model = Llama::new(m, 3);
        let (tokens, targets) = data.micro_batch(t, (me.coords.dp, 2), 0, 0)?; // my sequences
        model.forward(&tokens, t.micro_batch_size, &targets)?;
        model.backward(1.0)?;
        let mut optimizer = AdamW::new(&model.params_mut(), t); // for ZeRO below: moments like the gradients
        let mut worst = 0.0f32;
        for (p, want) in model.params_mut().into_iter().zip(&grads) {
            let grad = std::mem::replace(&mut p.grad, Tensor::zeros(&[0]));
            let got = redistribute(Cow::Owned(grad), want.shape(), AVG, Placement::Replicate, group)?;
            worst = worst.max(max_diff(&got, want));
        }
        // ZeRO: the master weights become Shard(0) of each one's flat values
        let sharding = Sharding::new(1, every_on_dp_cp).with(Axis::DpCp, (Axis::DpCp, group));
        let model = zero::shard(model, &mut optimizer, &sharding, 1);
        let partitions = model.params().iter().zip(&values).all(|(p, d)| {
            let mine = part_of(&d.clone().with_shape(&[d.numel()]), placement(p, Axis::DpCp), (group.index(), 2));
            placement(p, Axis::DpCp) == Placement::Shard(0)
                && max_diff(&mine, &zero::partition_of(p).expect("sharded").master) == 0.0
        });
        Ok((worst, partitions))
    })?;
    let worst = dp.iter().map(|r| r.0).fold(0.0, f32::max);
    common::claim(
        "dp = 2: the replicas' gradients are Partial(avg) of the batch's",
        worst <= 1e-5,
        &format!("max |Δgrad| {worst:.1e}"),
    )?;
    common::claim(
        "ZeRO over dp = 2: each master is Shard(0) of its flat values",
        dp.iter().all(|r| r.1),
        "every partition, value for value",
    )
}

fn run(tiny: bool) -> Result<()> {
    let cfg = common::config(tiny, &[])?;
    every_move(&cfg)?;
    every_parallelism(&cfg)
}

step!(run);
