//! # CUDA launches: the kernels of `kernels/*.cu` on a rank's GPU
//!
//! `Kernels` compiles each kernel file for the GPU's own architecture (once per process, see
//! `kernels.rs`), loads it into the rank's context, and launches kernels on the compute stream.
//! Each launch below mirrors one op of `src/ops.rs`, with the same shapes; `self_test` runs every
//! one of them in f32 on fresh random inputs and compares with the CPU reference. `ferrotron
//! doctor` and `tests/kernels_gpu.rs` run it where there is a GPU.
//!
//! Launch shapes follow the kernels' header comments: one block per row for row-wise ops (256
//! threads), grid-stride loops for elementwise ops, BQ = 64 query rows (or BK = 32 key rows) per
//! block for attention.

use crate::gpu::{cuda_err, Gpu};
use crate::ops::Attn;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The kernels loaded into one GPU's context.
pub struct Kernels {
    gpu: Gpu,
    arch: &'static str,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
}

/// The attention shape as `kernels/attention.cu` reads it (a `struct Shape` of six ints).
#[repr(C)]
#[derive(Clone, Copy)]
struct Shape {
    batch: i32,
    seq: i32,
    kv_seq: i32,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
}
// SAFETY: six i32 in C layout, as the kernel declares them.
unsafe impl DeviceRepr for Shape {}

const ROW_THREADS: u32 = 256;

fn rows_config(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 }
}

fn elementwise_config(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 4096) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

impl Kernels {
    pub fn new(gpu: &Gpu) -> Result<Kernels> {
        let (major, minor) = gpu.ctx.compute_capability().map_err(cuda_err)?;
        let arch = match (major, minor) {
            (8, 0) => "sm_80",
            (8, 6) => "sm_86",
            (8, 9) => "sm_89",
            (9, 0) => "sm_90",
            (10, 0) => "sm_100",
            (12, 0) => "sm_120",
            _ => bail!("GPU compute capability {major}.{minor} is not one ferrotron compiles for (sm_80 to sm_120)"),
        };
        Ok(Kernels { gpu: gpu.clone(), arch, modules: Mutex::new(HashMap::new()) })
    }

    fn function(&self, file: &'static str, name: &str) -> Result<CudaFunction> {
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        let module = match modules.get(file) {
            Some(m) => m.clone(),
            None => {
                let ptx = crate::kernels::ptx(file, self.arch)?;
                let m = self.gpu.ctx.load_module((*ptx).clone()).map_err(cuda_err)?;
                modules.insert(file, m.clone());
                m
            }
        };
        module.load_function(name).map_err(|e| anyhow!("kernels/{file}.cu has no kernel {name}: {e:?}"))
    }

    pub fn rmsnorm_f32(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        eps: f32,
        dim: usize,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
        let rows = x.len() / dim;
        let (mut y, mut rstd) = (self.gpu.zeros::<f32>(x.len())?, self.gpu.zeros::<f32>(rows)?);
        let f = self.function("rmsnorm", "rmsnorm_forward_f32")?;
        let dim_i = dim as i32;
        let mut l = self.gpu.compute.launch_builder(&f);
        l.arg(x).arg(w).arg(&eps).arg(&dim_i).arg(&mut y).arg(&mut rstd);
        // SAFETY: the argument list matches rmsnorm_forward_f32; every buffer has rows × dim or rows elements.
        unsafe { l.launch(rows_config(rows)) }.map_err(cuda_err)?;
        Ok((y, rstd))
    }

    pub fn swiglu_f32(&self, gate: &CudaSlice<f32>, up: &CudaSlice<f32>) -> Result<CudaSlice<f32>> {
        let n = gate.len();
        let mut h = self.gpu.zeros::<f32>(n)?;
        let f = self.function("swiglu", "swiglu_forward_f32")?;
        let n_i = n as i64;
        let mut l = self.gpu.compute.launch_builder(&f);
        l.arg(gate).arg(up).arg(&mut h).arg(&n_i);
        // SAFETY: matches swiglu_forward_f32; all buffers hold n elements.
        unsafe { l.launch(elementwise_config(n)) }.map_err(cuda_err)?;
        Ok(h)
    }

    /// Causal attention of queries at `q_pos` to keys at `k_pos` (as `ops::attention`).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_f32(
        &self,
        a: Attn,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        q_pos: &CudaSlice<u32>,
        k_pos: &CudaSlice<u32>,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
        if a.head_dim > 128 {
            bail!("the CUDA attention kernel supports head_dim up to 128, not {}", a.head_dim);
        }
        let shape = Shape {
            batch: a.batch as i32,
            seq: a.seq as i32,
            kv_seq: a.kv_seq as i32,
            heads: a.heads as i32,
            kv_heads: a.kv_heads as i32,
            head_dim: a.head_dim as i32,
        };
        let (mut out, mut lse) = (self.gpu.zeros::<f32>(q.len())?, self.gpu.zeros::<f32>(a.batch * a.heads * a.seq)?);
        let f = self.function("attention", "attention_forward_f32")?;
        let config = LaunchConfig {
            grid_dim: (a.seq.div_ceil(64) as u32, a.heads as u32, a.batch as u32),
            block_dim: (64, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.gpu.compute.launch_builder(&f);
        l.arg(&shape).arg(q).arg(k).arg(v).arg(q_pos).arg(k_pos).arg(&mut out).arg(&mut lse);
        // SAFETY: matches attention_forward_f32 and its grid (BQ = 64 query rows per block).
        unsafe { l.launch(config) }.map_err(cuda_err)?;
        Ok((out, lse))
    }

    /// Every kernel launched here against the CPU reference, in f32, on random inputs with odd
    /// sizes; returns one line per check.
    pub fn self_test(&self) -> Result<Vec<String>> {
        let mut report = Vec::new();
        let g = &self.gpu;
        let rand = |seed: u64, n: usize| crate::init::normal(seed, "self-test", &[n], 1.0).to_vec();
        let tensor = |shape: &[usize], data: Vec<f32>| crate::tensor::Tensor::from_vec(shape, data);
        let mut check = |what: &str, got: Vec<f32>, want: Vec<f32>, tol: f32| -> Result<()> {
            let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs() / (1.0 + b.abs())).fold(0.0f32, f32::max);
            if got.len() != want.len() || err > tol {
                bail!("kernel self-test {what}: relative error {err:.1e} above {tol:.0e}");
            }
            report.push(format!("{what}: ok (max relative error {err:.1e})"));
            Ok(())
        };
        // RMSNorm, 7 rows of 100
        let (rows, dim) = (7, 100);
        let (x, w) = (rand(1, rows * dim), rand(2, dim));
        let (y, rstd) = self.rmsnorm_f32(&g.upload(&x)?, &g.upload(&w)?, 1e-5, dim)?;
        let (want_y, want_rstd) = crate::ops::rmsnorm(&tensor(&[rows, dim], x), &tensor(&[dim], w), 1e-5);
        check("rmsnorm forward", g.download(&y)?, want_y.to_vec(), 1e-5)?;
        check("rmsnorm rstd", g.download(&rstd)?, want_rstd.to_vec(), 1e-5)?;
        // SwiGLU, 1001 elements
        let (gate, up) = (rand(3, 1001), rand(4, 1001));
        let h = self.swiglu_f32(&g.upload(&gate)?, &g.upload(&up)?)?;
        check(
            "swiglu forward",
            g.download(&h)?,
            crate::ops::swiglu(&tensor(&[1001], gate), &tensor(&[1001], up)).to_vec(),
            1e-5,
        )?;
        // attention: 2 sequences of 37, 4 heads sharing 2 KV heads of 16
        let a = Attn { batch: 2, seq: 37, kv_seq: 37, heads: 4, kv_heads: 2, head_dim: 16 };
        let (q, k, v) = (rand(5, 2 * 37 * 64), rand(6, 2 * 37 * 32), rand(7, 2 * 37 * 32));
        let pos: Vec<u32> = (0..37).collect();
        let (out, lse) =
            self.attention_f32(a, &g.upload(&q)?, &g.upload(&k)?, &g.upload(&v)?, &g.upload(&pos)?, &g.upload(&pos)?)?;
        let (want_out, want_lse) =
            crate::ops::attention(a, &tensor(&[74, 64], q), &tensor(&[74, 32], k), &tensor(&[74, 32], v), (&pos, &pos));
        check("attention forward", g.download(&out)?, want_out.to_vec(), 1e-4)?;
        check("attention lse", g.download(&lse)?, want_lse.to_vec(), 1e-4)?;
        Ok(report)
    }
}
