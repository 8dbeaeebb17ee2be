//! # `ferrotron doctor`: what this machine offers the CUDA backend, and does it work
//!
//! It lists the CUDA libraries (found or not, and the file that was loaded), compiles every kernel
//! with NVRTC when it can, shows the driver and its CUDA version and every GPU with its memory,
//! and then runs self-tests on GPU 0: every op of `ops/gpu.rs`, forward and backward, in f32 and bf16,
//! against the CPU reference (`commands/self_check.rs`),
//! and the tensor collectives on GPU tensors, over NCCL (a rank per GPU) and over the local hub
//! (three ranks sharing GPU 0), against answers computed on the host.
//! Without a GPU it says so and fails, so scripts can tell.

use crate::comm::launcher::{launch_on, Backend, Rank, Setup};
use crate::comm::process_grid::{Axis, Grid};
use crate::comm::ReduceOp;
use crate::cuda::runtime::{self, cuda_err, Gpu};
use crate::ops::tensor::{Place, Tensor};
use crate::ops::DType;
use anyhow::{anyhow, bail, Result};
use std::time::Duration;

/// Prints the report; an error when there is no usable GPU or a self-test fails.
pub fn doctor() -> Result<()> {
    let libs = runtime::libraries();
    crate::say!("libraries:");
    for lib in &libs {
        let at = if lib.found { loaded_from(lib.name).unwrap_or_else(|| "found".into()) } else { "NOT FOUND".into() };
        crate::say!("  {:<24} {at}", lib.name);
    }
    match crate::cuda::nvrtc::nvrtc_ready() {
        Ok(include) => {
            for (name, _) in crate::cuda::nvrtc::SOURCES {
                crate::cuda::nvrtc::compile(name, "sm_90")?;
            }
            crate::say!(
                "kernels: all {} kernel files compile with NVRTC for sm_90 (headers: {})",
                crate::cuda::nvrtc::SOURCES.len(),
                std::env::join_paths(&include).unwrap_or_default().to_string_lossy()
            );
        }
        Err(e) => crate::say!("kernels: not compiled: {e:#}"),
    }
    let count = runtime::device_count().map_err(|e| anyhow!("{e:#}\nno GPU here: device.kind = \"cpu\" works"))?;
    let mut version = 0;
    // SAFETY: the driver library is present (device_count checked it) and the pointer is valid.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
    crate::say!("driver: CUDA {}.{}", version / 1000, version % 1000 / 10);
    if count == 0 {
        bail!("the CUDA driver sees no GPU: device.kind = \"cpu\" works");
    }
    for ordinal in 0..count {
        let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(cuda_err)?;
        let (major, minor) = ctx.compute_capability().map_err(cuda_err)?;
        let name = ctx.name().map_err(cuda_err)?;
        let mem = ctx.total_mem().map_err(cuda_err)? as f64 / (1u64 << 30) as f64;
        crate::say!("GPU {ordinal}: {name}, sm_{major}{minor}, {mem:.1} GiB");
    }
    if crate::cuda::nvrtc::nvrtc_ready().is_ok() {
        // (a GPU error inside an op panics, to stop a rank: here it is the check's error)
        let report = crate::cuda::device::catching_panics(|| crate::commands::self_check::self_test(&Gpu::open(0)?))?;
        for line in &report {
            crate::say!("self-test: kernel {line}");
        }
        crate::say!(
            "self-test: all {} kernel checks passed (f32, bf16 and FP8 GEMMs against the CPU reference)",
            report.len()
        );
    }
    if libs.iter().any(|l| l.name.starts_with("NCCL") && l.found) {
        let gpus = runtime::device_count()?.min(8);
        comm_self_test(Grid::new(gpus, 1, 1, 1)?, Backend::Nccl)?;
        crate::say!("self-test: NCCL collectives on GPU tensors ({gpus} rank(s), one GPU each): ok");
    }
    comm_self_test(Grid::new(3, 1, 1, 1)?, Backend::Local)?;
    crate::say!("self-test: local collectives on GPU tensors (3 ranks sharing GPU 0): ok");
    Ok(())
}

/// The file a loaded library came from, read from this process's memory map.
fn loaded_from(name: &str) -> Option<String> {
    // SAFETY: `libraries` found the library, so these loads succeed; they keep it mapped.
    let stem = unsafe {
        match name.split(' ').next()? {
            "CUDA" => (cudarc::driver::sys::culib(), "libcuda.").1,
            "NVRTC" => (cudarc::nvrtc::sys::culib(), "libnvrtc").1,
            "cuBLAS" => (cudarc::cublas::sys::culib(), "libcublas.").1,
            "cuBLASLt" => (cudarc::cublaslt::sys::culib(), "libcublasLt").1,
            _ => (cudarc::nccl::sys::culib(), "libnccl").1,
        }
    };
    let maps = crate::files::read_text(std::path::Path::new("/proc/self/maps"), "/proc").ok()?;
    maps.lines().filter_map(|l| l.split_whitespace().nth(5)).find(|p| p.contains(stem)).map(str::to_string)
}

/// Every tensor collective of every rank of `grid` on GPU tensors, against answers computed on
/// the host; f32 and bf16. On `Nccl` they go through NCCL, on `Local` through host memory.
pub fn comm_self_test(grid: Grid, backend: Backend) -> Result<()> {
    let setup = Setup { cuda: true, backend, ..Setup::cpu(Duration::from_secs(60)) };
    launch_on(grid, setup, |me| {
        check_rank(me, DType::F32)?;
        check_rank(me, DType::Bf16)
    })
    .map(drop)
}

fn check_rank(me: &Rank, dtype: DType) -> Result<()> {
    let place = Place::for_rank(me.gpu.as_ref(), dtype)?;
    let g = me.group(Axis::World);
    let (n, r, k) = (g.size(), g.index(), 6);
    // small integers and halves: exact in bf16 and f32, so every sum is exact whatever the order
    let part = |rank: usize, len: usize| -> Vec<f32> { (0..len).map(|i| (rank * 10 + i) as f32 * 0.5 + 1.0).collect() };
    let on_gpu = |data: Vec<f32>| Tensor::from_host(&[data.len()], data, &place);
    let sum: Vec<f32> = (0..n * k).map(|i| (0..n).map(|q| part(q, n * k)[i]).sum()).collect();
    let max: Vec<f32> = part(n - 1, n * k);

    for (op, want) in [(ReduceOp::Sum, sum.clone()), (ReduceOp::Max, max)] {
        let mut t = on_gpu(part(r, n * k));
        g.all_reduce_tensor(&mut t, op)?;
        compare(&t, &want, &format!("all_reduce {op:?}"), dtype)?;
    }
    let mine = on_gpu(part(r, k));
    let gathered = g.all_gather_tensor(&mine)?;
    compare(&gathered, &(0..n).flat_map(|q| part(q, k)).collect::<Vec<_>>(), "all_gather", dtype)?;
    let chunk = g.reduce_scatter_tensor(&on_gpu(part(r, n * k)), ReduceOp::Sum)?;
    compare(&chunk, &sum[r * k..(r + 1) * k], "reduce_scatter", dtype)?;
    let mut t = on_gpu(part(r, k));
    g.broadcast_tensor(&mut t, n - 1)?;
    compare(&t, &part(n - 1, k), "broadcast", dtype)?;
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let got = g.send_recv_tensor(&mine, next, &[k], prev)?;
    compare(&got, &part(prev, k), "send_recv", dtype)?;
    let got = g.send_recv_tensor_async(on_gpu(part(r, k)), next, &[k], prev)?.wait()?;
    compare(&got, &part(prev, k), "send_recv (async)", dtype)
}

fn compare(t: &Tensor, want: &[f32], what: &str, dtype: DType) -> Result<()> {
    let got = t.to_vec();
    if got != want || t.dtype() != dtype {
        bail!("{what} on {dtype:?} GPU tensors gave {got:?} ({:?}), expected {want:?}", t.dtype());
    }
    Ok(())
}
