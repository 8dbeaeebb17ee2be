//! # The CUDA kernels against the CPU reference
//!
//! Every op of the op layer, forward and backward, runs twice on the same fresh random inputs
//! (never zeros): once on the CPU (`ops/cpu.rs`, the reference) and once on the GPU (`ops/gpu.rs`), in
//! f32 and in mixed precision (and the linear layers' GEMMs in FP8), for several shapes including odd ones. In bf16 the inputs are
//! rounded to bf16 first, so the CPU sees exactly what the GPU sees and the comparison measures
//! the kernel, not the input rounding. Errors are relative to the largest reference value:
//! about 1e-5 in f32, about 1e-2 in bf16 (outputs are stored in bf16, 8 bits of mantissa).
//! `ferrotron doctor` and `tests/kernels_gpu.rs` run it where there is a GPU.

use crate::cuda::device::Device;
use crate::cuda::runtime::Gpu;
use crate::ops::ring_merge::attention_merge;
use crate::ops::tensor::{Place, Tensor};
use crate::ops::{self, AdamWSettings, Attn, DType, Precision};
use anyhow::{bail, Result};
use half::bf16;

/// Runs every check in f32 and bf16; one line per check, or the first failure.
pub fn self_test(gpu: &Gpu) -> Result<Vec<String>> {
    let mut report = Vec::new();
    for dtype in [DType::F32, DType::Bf16] {
        let mut c = Check { place: Place::Cuda(Device::new(gpu, dtype)?), dtype, seed: 0, report: &mut report };
        for (rows, dim, vocab) in [(7, 100, 53), (130, 64, 1000)] {
            c.linear(if dtype == DType::F32 { Precision::F32 } else { Precision::Bf16 }, (rows, dim, vocab))?;
            c.embedding(rows, dim, vocab)?;
            c.rmsnorm(rows, dim)?;
            c.swiglu(rows, dim)?;
            c.cross_entropy(rows, vocab)?;
            c.elementwise(rows, dim)?;
            c.experts((rows, 8, 2), dim)?;
        }
        c.rope(Attn { batch: 2, seq: 37, kv_seq: 37, heads: 4, kv_heads: 2, head_dim: 16 })?;
        for a in [
            Attn { batch: 2, seq: 37, kv_seq: 37, heads: 4, kv_heads: 2, head_dim: 16 },
            Attn { batch: 1, seq: 70, kv_seq: 70, heads: 3, kv_heads: 1, head_dim: 32 },
            Attn { batch: 1, seq: 65, kv_seq: 65, heads: 2, kv_heads: 2, head_dim: 128 },
            Attn { batch: 1, seq: 130, kv_seq: 130, heads: 8, kv_heads: 1, head_dim: 64 }, // GQA 8:1, three tiles
            Attn { batch: 1, seq: 33, kv_seq: 33, heads: 2, kv_heads: 1, head_dim: 24 },   // no tensor-core kernel
        ] {
            let pos: Vec<u32> = (0..a.seq as u32).collect();
            c.attention(a, (&pos, &pos))?;
        }
        // zigzag's two chunks per rank: tiles skipped by position, not by index
        let zigzag = Attn { batch: 1, seq: 64, kv_seq: 64, heads: 2, kv_heads: 1, head_dim: 64 };
        let pos: Vec<u32> = (0..32).chain(96..128).collect();
        c.attention(zigzag, (&pos, &pos))?;
        // one block of ring attention: 20 queries at positions 40.., 33 keys of which some lie after them
        let ring = Attn { batch: 2, seq: 20, kv_seq: 33, heads: 4, kv_heads: 2, head_dim: 16 };
        let (q_pos, k_pos): (Vec<u32>, Vec<u32>) = ((40..60).collect(), (30..63).collect());
        c.attention(ring, (&q_pos, &k_pos))?;
        // a block whose keys all lie after its first queries: those rows see nothing (out 0, lse −∞)
        let early = Attn { batch: 1, seq: 20, kv_seq: 33, heads: 2, kv_heads: 1, head_dim: 16 };
        let (q_pos, k_pos): (Vec<u32>, Vec<u32>) = ((0..20).collect(), (10..43).collect());
        c.attention(early, (&q_pos, &k_pos))?;
        c.attention_merge(ring)?;
        c.adamw(1000, DType::F32)?;
        if dtype == DType::Bf16 {
            // FP8 GEMMs (cast kernels and cuBLASLt) against the CPU's emulated casts: the same
            // bytes, so only the order of the sums differs; 7 rows: the weight gradient sums
            // over a length the cast pads to 16
            for shape in [(7, 64, 48), (144, 128, 80)] {
                c.linear(Precision::Fp8, shape)?;
            }
            c.adamw(1000, DType::Bf16)?; // bf16 moments (`train.optimizer_dtype`), with mixed precision
        }
    }
    Ok(report)
}

struct Check<'a> {
    place: Place,
    dtype: DType,
    seed: u64,
    report: &'a mut Vec<String>,
}

impl Check<'_> {
    /// Fresh N(0, 1) numbers, representable in the compute dtype.
    fn rand(&mut self, shape: &[usize]) -> Tensor {
        self.seed += 1;
        let t = crate::model::init::normal(self.seed, "kernel self-test", shape, 1.0);
        Tensor::from_vec(shape, t.to_vec().into_iter().map(|v| self.round(v)).collect())
    }

    fn round(&self, v: f32) -> f32 {
        match self.dtype {
            DType::F32 => v,
            DType::Bf16 => bf16::from_f32(v).to_f32(),
        }
    }

    /// An activation on the GPU, in the compute dtype.
    fn gpu(&self, t: &Tensor) -> Tensor {
        t.to(&self.place)
    }

    /// A weight on the GPU (in bf16 mode, an fp32 master with its bf16 copy).
    fn param(&self, t: &Tensor) -> Tensor {
        t.to_param(&self.place)
    }

    /// A gradient or statistic on the GPU: f32 in every mode.
    fn f32(&self, t: &Tensor) -> Tensor {
        t.to_dtype(&self.place, DType::F32)
    }

    fn same(&mut self, what: &str, got: &Tensor, want: &Tensor) -> Result<()> {
        let (got, want) = (got.to_vec(), want.to_vec());
        let scale = want.iter().fold(1e-6f32, |m, v| if v.is_finite() { m.max(v.abs()) } else { m });
        let err = got.iter().zip(&want).fold(0.0f32, |e, (g, w)| match (g.is_finite(), w.is_finite()) {
            (true, true) => e.max((g - w).abs() / scale),
            _ if g == w => e, // the same infinity (a row that sees no key has lse −∞)
            _ => f32::INFINITY,
        });
        let tol = if self.dtype == DType::F32 { 2e-5 } else { 2e-2 };
        let line = format!("{:?} {what}: max error {err:.1e} of the largest value (tolerance {tol:.0e})", self.dtype);
        if got.len() != want.len() || err > tol {
            bail!("kernel self-test failed: {line}");
        }
        self.report.push(line);
        Ok(())
    }

    fn linear(&mut self, p: Precision, (m, k, n): (usize, usize, usize)) -> Result<()> {
        let (mut x, w, dy, dw) = (self.rand(&[m, k]), self.rand(&[n, k]), self.rand(&[m, n]), self.rand(&[n, k]));
        let (mut gx, gw, gdy) = (self.gpu(&x), self.param(&w), self.gpu(&dy));
        self.same(&format!("linear ({p:?} GEMM) {m}×{k}→{n}"), &ops::linear(&gx, &gw, p), &ops::linear(&x, &w, p))?;
        // x written in place: the GPU must not read the FP8 copy it made of the old numbers
        ops::scale(&mut x, 2.0);
        ops::scale(&mut gx, 2.0);
        self.same("linear, its input written since", &ops::linear(&gx, &gw, p), &ops::linear(&x, &w, p))?;
        let want = ops::linear_input_grad(&dy, &w, p);
        let mut got = ops::linear_input_grad(&gdy, &gw, p);
        self.same("linear input gradient", &got, &want)?;
        // a second layer's input gradient added to it (the GEMM accumulating, β = 1)
        let mut twice = want.clone();
        ops::linear_input_grad_add(&dy, &w, p, &mut twice);
        ops::linear_input_grad_add(&gdy, &gw, p, &mut got);
        self.same("linear input gradient, added", &got, &twice)?;
        let (mut want, mut got) = (dw.clone(), self.f32(&dw)); // accumulates into what is there
        ops::linear_weight_grad(&dy, &x, &mut want, p);
        ops::linear_weight_grad(&gdy, &gx, &mut got, p);
        self.same("linear weight gradient (+=, f32)", &got, &want)
    }

    fn embedding(&mut self, rows: usize, dim: usize, vocab: usize) -> Result<()> {
        let table = self.rand(&[vocab, dim]);
        // a vocabulary slice starting at 3: ids below it and past it get zero rows; ids repeat
        let tokens: Vec<u32> = (0..rows).map(|i| ((i * 7) % (vocab + 5)) as u32).collect();
        let got = ops::embedding(&self.param(&table), &tokens, 3);
        self.same("embedding", &got, &ops::embedding(&table, &tokens, 3))?;
        let (dout, dtable) = (self.rand(&[rows, dim]), self.rand(&[vocab, dim]));
        let (mut want, mut got) = (dtable.clone(), self.f32(&dtable));
        ops::embedding_backward(&dout, &tokens, 3, &mut want);
        ops::embedding_backward(&self.gpu(&dout), &tokens, 3, &mut got);
        self.same("embedding backward (+=, f32)", &got, &want)
    }

    fn rmsnorm(&mut self, rows: usize, dim: usize) -> Result<()> {
        let (x, w, dy, dw) = (self.rand(&[rows, dim]), self.rand(&[dim]), self.rand(&[rows, dim]), self.rand(&[dim]));
        let (gx, gw) = (self.gpu(&x), self.param(&w));
        let (y, rstd) = ops::rmsnorm(&x, &w, 1e-5);
        let (gy, grstd) = ops::rmsnorm(&gx, &gw, 1e-5);
        self.same("rmsnorm", &gy, &y)?;
        self.same("rmsnorm 1/rms", &grstd, &rstd)?;
        let (mut want_dw, mut got_dw) = (dw.clone(), self.f32(&dw));
        let want = ops::rmsnorm_backward(&dy, &x, &w, &rstd, &mut want_dw, None);
        let got = ops::rmsnorm_backward(&self.gpu(&dy), &gx, &gw, &self.f32(&rstd), &mut got_dw, None);
        self.same("rmsnorm backward dx", &got, &want)?;
        self.same("rmsnorm backward dw (+=, f32)", &got_dw, &want_dw)?;
        // a block's residual forms: h += x then h's norm; dx plus the gradient around the norm
        let (mut h, mut gh) = (dy.clone(), self.gpu(&dy));
        let (y, rstd) = ops::add_rmsnorm(&mut h, &x, &w, 1e-5);
        let (gy, grstd) = ops::add_rmsnorm(&mut gh, &gx, &gw, 1e-5);
        self.same("add, then rmsnorm: the sum", &gh, &h)?;
        self.same("add, then rmsnorm", &gy, &y)?;
        self.same("add, then rmsnorm 1/rms", &grstd, &rstd)?;
        let want = ops::rmsnorm_backward(&dy, &x, &w, &rstd, &mut want_dw, Some(&h));
        let got = ops::rmsnorm_backward(&self.gpu(&dy), &gx, &gw, &grstd, &mut got_dw, Some(&gh));
        self.same("rmsnorm backward dx + residual", &got, &want)
    }

    fn rope(&mut self, a: Attn) -> Result<()> {
        let rows = a.batch * a.seq;
        let positions: Vec<u32> = (0..rows).map(|r| (r % a.seq) as u32 * 97).collect(); // large angles too
        let mut x = self.rand(&[rows, a.heads * a.head_dim]);
        let mut gx = self.gpu(&x);
        let rope = ops::Rope::plain(10000.0, a.head_dim);
        ops::rope(&mut x, &positions, &rope);
        ops::rope(&mut gx, &positions, &rope);
        self.same("rope", &gx, &x)?;
        ops::rope_backward(&mut x, &positions, &rope);
        ops::rope_backward(&mut gx, &positions, &rope);
        self.same("rope backward (inverse rotation)", &gx, &x)
    }

    fn attention(&mut self, a: Attn, pos: (&[u32], &[u32])) -> Result<()> {
        let q = self.rand(&[a.batch * a.seq, a.heads * a.head_dim]);
        let (k, v) = (
            self.rand(&[a.batch * a.kv_seq, a.kv_heads * a.head_dim]),
            self.rand(&[a.batch * a.kv_seq, a.kv_heads * a.head_dim]),
        );
        let (gq, gk, gv) = (self.gpu(&q), self.gpu(&k), self.gpu(&v));
        let what =
            format!("attention b{} q{} k{} h{}/{} d{}", a.batch, a.seq, a.kv_seq, a.heads, a.kv_heads, a.head_dim);
        let (out, lse) = ops::attention(a, &q, &k, &v, pos);
        let (gout, glse) = ops::attention(a, &gq, &gk, &gv, pos);
        self.same(&what, &gout, &out)?;
        self.same(&format!("{what} lse"), &glse, &lse)?;
        // backward from the reference forward (rounded to the compute dtype), so it is tested alone
        let out = Tensor::from_vec(out.shape(), out.to_vec().into_iter().map(|v| self.round(v)).collect());
        let dout = self.rand(out.shape());
        let want = ops::attention_backward(a, (&q, &k, &v), pos, (&out, &lse), &dout);
        let (gout, glse, gdout) = (self.gpu(&out), self.f32(&lse), self.gpu(&dout));
        let got = ops::attention_backward(a, (&gq, &gk, &gv), pos, (&gout, &glse), &gdout);
        self.same(&format!("{what} backward dq"), &got.0, &want.0)?;
        self.same(&format!("{what} backward dk"), &got.1, &want.1)?;
        self.same(&format!("{what} backward dv"), &got.2, &want.2)?;
        // the same bits again: no sum of the backward may depend on which block ran first
        let again = ops::attention_backward(a, (&gq, &gk, &gv), pos, (&gout, &glse), &gdout);
        for (name, first, second) in [("dq", &got.0, &again.0), ("dk", &got.1, &again.1), ("dv", &got.2, &again.2)] {
            let bits = |t: &Tensor| t.to_vec().into_iter().map(f32::to_bits).collect::<Vec<_>>();
            if bits(first) != bits(second) {
                bail!(
                    "kernel self-test failed: {:?} {what} backward {name}: two runs differ (not deterministic)",
                    self.dtype
                );
            }
        }
        self.report.push(format!("{:?} {what} backward: the same bits twice", self.dtype));
        Ok(())
    }

    fn attention_merge(&mut self, a: Attn) -> Result<()> {
        let (out, block_out) =
            (self.rand(&[a.batch * a.seq, a.heads * a.head_dim]), self.rand(&[a.batch * a.seq, a.heads * a.head_dim]));
        let lse_shape = [a.batch, a.heads, a.seq];
        // some rows have seen nothing yet (−∞), some blocks add nothing (−∞)
        let mut lse = self.rand(&lse_shape).to_vec();
        let mut block_lse = self.rand(&lse_shape).to_vec();
        lse.iter_mut().step_by(5).for_each(|l| *l = f32::NEG_INFINITY);
        block_lse.iter_mut().step_by(7).for_each(|l| *l = f32::NEG_INFINITY);
        let (mut out, mut lse, block_lse) =
            (out, Tensor::from_vec(&lse_shape, lse), Tensor::from_vec(&lse_shape, block_lse));
        let (mut gout, mut glse) = (self.gpu(&out), self.f32(&lse));
        attention_merge(a, (&mut out, &mut lse), &block_out, &block_lse);
        attention_merge(a, (&mut gout, &mut glse), &self.gpu(&block_out), &self.f32(&block_lse));
        self.same("attention merge", &gout, &out)?;
        self.same("attention merge lse", &glse, &lse)
    }

    fn swiglu(&mut self, rows: usize, dim: usize) -> Result<()> {
        let (g, u, dh) = (self.rand(&[rows, dim]), self.rand(&[rows, dim]), self.rand(&[rows, dim]));
        let (gg, gu) = (self.gpu(&g), self.gpu(&u));
        self.same("swiglu", &ops::swiglu(&gg, &gu), &ops::swiglu(&g, &u))?;
        let want = ops::swiglu_backward(&dh, &g, &u);
        let got = ops::swiglu_backward(&self.gpu(&dh), &gg, &gu);
        self.same("swiglu backward dgate", &got.0, &want.0)?;
        self.same("swiglu backward dup", &got.1, &want.1)
    }

    /// The routing of a mixture of experts: top-k, its backward, the rows by expert and back.
    fn experts(&mut self, (rows, experts, k): (usize, usize, usize), dim: usize) -> Result<()> {
        use crate::ops::moe;
        let logits = self.rand(&[rows, experts]);
        let (want, got) = (moe::route(&logits, k), moe::route(&self.gpu(&logits), k));
        if got.experts != want.experts {
            bail!("kernel self-test failed: {:?} route chose other experts than the CPU", self.dtype);
        }
        self.same("route probabilities", &got.probs, &want.probs)?;
        self.same("route weights", &got.weights, &want.weights)?;
        let (dw, balance) = (self.rand(&[rows, k]), self.rand(&[experts]).to_vec());
        let expected = moe::route_backward(&dw, &want, &balance);
        self.same("route backward", &moe::route_backward(&self.f32(&dw), &got, &balance), &expected)?;
        let n = rows * k;
        let order: Vec<u32> = (0..n).map(|i| (i * 7 % rows) as u32).collect(); // tokens, repeated
        let x = self.rand(&[rows, dim]);
        self.same("permute rows", &moe::permute_rows(&self.gpu(&x), &order), &moe::permute_rows(&x, &order))?;
        let slot: Vec<u32> = (0..n as u32).rev().collect(); // each routed row once
        let (ys, dy) = (self.rand(&[n, dim]), self.rand(&[rows, dim]));
        let (gys, w) = (self.gpu(&ys), &want.weights);
        let combined = moe::weighted_sum(&gys, &slot, Some(&got.weights), rows);
        self.same("weighted sum", &combined, &moe::weighted_sum(&ys, &slot, Some(w), rows))?;
        let (dys, dws) = moe::weighted_sum_backward(&self.gpu(&dy), &gys, &slot, &got.weights);
        let (want_dys, want_dws) = moe::weighted_sum_backward(&dy, &ys, &slot, w);
        self.same("weighted sum backward d rows", &dys, &want_dys)?;
        self.same("weighted sum backward d weights", &dws, &want_dws)
    }

    fn cross_entropy(&mut self, rows: usize, vocab: usize) -> Result<()> {
        let logits = self.rand(&[rows, vocab]);
        let gl = self.gpu(&logits);
        // a vocabulary slice starting at 5: targets below it, in it, past it, and ignored (−1)
        let targets: Vec<i32> =
            (0..rows).map(|i| if i % 4 == 3 { -1 } else { ((i * 13) % (vocab + 9)) as i32 }).collect();
        let (max, gmax) = (ops::row_max(&logits), ops::row_max(&gl));
        self.same("row max", &gmax, &max)?;
        let (sum, gsum) = (ops::row_sum_exp(&logits, &max), ops::row_sum_exp(&gl, &gmax));
        self.same("row sum of exponentials", &gsum, &sum)?;
        let (lse, glse) = (ops::log_sum_exp(&max, &sum), ops::log_sum_exp(&gmax, &gsum));
        self.same("log-sum-exp", &glse, &lse)?;
        self.same("target logits", &ops::target_logits(&gl, &targets, 5), &ops::target_logits(&logits, &targets, 5))?;
        let want = ops::cross_entropy_backward(&logits, &targets, 5, &lse, 0.25);
        self.same("cross-entropy backward", &ops::cross_entropy_backward(&gl, &targets, 5, &glse, 0.25), &want)
    }

    fn elementwise(&mut self, rows: usize, dim: usize) -> Result<()> {
        let (mut a, b) = (self.rand(&[rows, dim]), self.rand(&[rows, dim]));
        let mut ga = self.gpu(&a);
        ops::add_assign(&mut a, &b);
        ops::add_assign(&mut ga, &self.gpu(&b));
        ops::scale(&mut a, 0.75);
        ops::scale(&mut ga, 0.75);
        self.same("add and scale", &ga, &a)?;
        let (g1, g2) = (self.rand(&[rows, dim]), self.rand(&[dim]));
        let want = ops::sum_squares_total(&[&g1, &g2], &Place::Cpu);
        let got = ops::sum_squares_total(&[&self.f32(&g1), &self.f32(&g2)], &self.place);
        self.same("sum of squares (f32)", &got, &want)
    }

    fn adamw(&mut self, n: usize, moments: DType) -> Result<()> {
        // one launch of two parameters: one of several chunks with weight decay, one without
        let o = AdamWSettings {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 3,
            grad_scale: 0.5,
            moments,
        };
        let (mut cpu, mut gpu) = (Vec::new(), Vec::new());
        for shape in [[n, 3], [n + 1, 5]] {
            let (p, g, m) = (self.rand(&shape), self.rand(&shape), self.rand(&shape));
            let v = Tensor::from_vec(&shape, self.rand(&shape).to_vec().iter().map(|x| self.round(x * x)).collect());
            gpu.push((
                self.param(&p),
                self.f32(&g),
                m.to_dtype(&self.place, moments),
                v.to_dtype(&self.place, moments),
            ));
            cpu.push((p, g, m, v));
        }
        let decays = [o, AdamWSettings { weight_decay: 0.0, ..o }];
        let steps = |all: &mut Vec<(Tensor, Tensor, Tensor, Tensor)>| {
            let mut steps: Vec<_> = all.iter_mut().zip(decays).map(|((p, g, m, v), o)| (o, p, &*g, m, v)).collect();
            ops::adamw(&mut steps);
        };
        steps(&mut cpu);
        steps(&mut gpu);
        for ((p, _, m, v), (gp, _, gm, gv)) in cpu.iter().zip(&gpu) {
            self.same("adamw weight (fp32 master)", gp, p)?;
            self.same("adamw first moment", gm, m)?;
            self.same("adamw second moment", gv, v)?;
            // the copy the kernels compute with is the master rounded: read it through an embedding
            let rows: Vec<u32> = (0..p.rows() as u32).collect();
            let want = Tensor::from_vec(p.shape(), p.to_vec().into_iter().map(|x| self.round(x)).collect());
            self.same("adamw compute copy", &ops::embedding(gp, &rows, 0), &want)?;
        }
        Ok(())
    }
}
