//! `ferrotron plan` against runs on this machine: calibrates (`bench --calibrate`), then for
//! layouts of the CPU configs predicts the step time (`plan::predict`, ranks as threads sharing
//! the cores) and measures it (`bench`), side by side. The goal: every prediction within 25 %,
//! and every pair of layouts whose measured times differ by more than 15 % ranked right.
//!
//! `cargo bench --bench plan_vs_runs` (about 3 minutes on 2 cores); the table goes to
//! BENCHMARKS.md.

use ferrotron::commands::{bench, calibrate, plan};
use ferrotron::config::Config;

const LAYOUTS: &[&[&str]] = &[
    &[],
    &["parallel.dp=2"],
    &["parallel.dp=2", "parallel.zero_stage=1"],
    &["parallel.dp=2", "parallel.zero_stage=2"],
    &["parallel.dp=2", "parallel.zero_stage=3"],
    &["parallel.dp=4", "parallel.zero_stage=3", "parallel.dp_shard=2"],
    &["parallel.tp=2"],
    &["parallel.tp=2", "parallel.sequence_parallel=true"],
    &["parallel.pp=2", "parallel.pp_schedule=afab", "train.grad_accum_steps=4", "train.micro_batch_size=4"],
    &["parallel.pp=2", "parallel.pp_schedule=1f1b", "train.grad_accum_steps=4", "train.micro_batch_size=4"],
    &[
        "parallel.pp=2",
        "parallel.pp_schedule=interleaved",
        "parallel.pp_virtual_stages=2",
        "train.grad_accum_steps=4",
        "train.micro_batch_size=4",
    ],
    &["parallel.pp=2", "parallel.pp_schedule=zb-h1", "train.grad_accum_steps=4", "train.micro_batch_size=4"],
    &["parallel.pp=2", "parallel.pp_schedule=zbv", "train.grad_accum_steps=4", "train.micro_batch_size=4"],
    &["parallel.cp=2"],
    &["parallel.cp=2", "parallel.cp_mode=ulysses"],
    &["train.recompute=\"full\""],
    &["parallel.dp=2", "train.recompute=\"selective\""],
    &["parallel.dp=2", "parallel.tp=2"],
    &["parallel.dp=2", "parallel.ep=2", "model.num_local_experts=4", "model.num_experts_per_tok=2"],
];

fn main() -> anyhow::Result<()> {
    ferrotron::train::memory::keep_freed_memory();
    let base = Config::load(None, &[])?;
    let calibration = calibrate::calibrate(&base.data.cache_dir)?;
    println!("{}", calibrate::table(&calibration).trim_end());
    println!("\n| layout | ranks | predicted ms | measured ms | predicted / measured |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    let mut rows = Vec::new();
    for sets in LAYOUTS {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).chain(["checkpoint.every=0".into()]).collect();
        let cfg = Config::load(None, &sets)?;
        let ranks = cfg.parallel.world_size();
        let cluster = plan::cpu_cluster(&cfg.data.cache_dir, ranks)?;
        let predicted = plan::predict(&cfg, &cluster)?.step_s.expect("the tiny config fits") * 1e3;
        let measured = bench::bench(&cfg, 3, 12, None, false)?.step_ms;
        let name = if sets.len() == 1 {
            "one rank".to_string()
        } else {
            sets[..sets.len() - 1].join(" ").replace("parallel.", "").replace("train.", "")
        };
        println!("| {name} | {ranks} | {predicted:.1} | {measured:.1} | {:.2} |", predicted / measured);
        rows.push((name, predicted, measured));
    }
    let within = rows.iter().filter(|(_, p, m)| (p / m - 1.0).abs() <= 0.25).count();
    let (mut pairs, mut right) = (0, 0);
    for (i, a) in rows.iter().enumerate() {
        for b in &rows[i + 1..] {
            if (a.2 / b.2 - 1.0).abs() > 0.15 && (b.2 / a.2 - 1.0).abs() > 0.15 {
                pairs += 1;
                right += usize::from((a.1 < b.1) == (a.2 < b.2));
            }
        }
    }
    println!(
        "\n{within} of {} predictions within 25 %; {right} of {pairs} pairs more than 15 % apart ranked right",
        rows.len()
    );
    Ok(())
}
