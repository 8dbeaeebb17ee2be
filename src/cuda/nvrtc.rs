//! # The CUDA kernels, compiled at run time by NVRTC
//!
//! `kernels/*.cu` are compiled into the binary as text. On a GPU each file is compiled once per
//! process for the GPU's own architecture (`sm_90` on an H100) and the PTX is cached here; the
//! CUDA backend loads it into its context. Each file is preceded by `kernels/common.cuh` (the
//! f32/bf16 load and store helpers and the block reductions) before it is compiled, so NVRTC needs
//! no include path of ours, only the CUDA headers (`cuda_bf16.h`, and `mma.h` for tensor cores).
//!
//! Without a GPU the same compilation still runs, and `tests/kernels_compile.rs` uses it so CI
//! catches a kernel that does not compile: NVRTC and the headers come from the Python wheels
//! `nvidia-cuda-nvrtc-cu12` and `nvidia-cuda-runtime-cu12` (see `.ci/run`).

use anyhow::{anyhow, bail, Result};
use cudarc::nvrtc::{CompileOptions, Ptx};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

const COMMON: &str = include_str!("../../kernels/common.cuh");

/// Every kernel file: (name, source).
pub const SOURCES: [(&str, &str); 9] = [
    ("elementwise", include_str!("../../kernels/elementwise.cu")),
    ("embedding", include_str!("../../kernels/embedding.cu")),
    ("rmsnorm", include_str!("../../kernels/rmsnorm.cu")),
    ("rope", include_str!("../../kernels/rope.cu")),
    ("swiglu", include_str!("../../kernels/swiglu.cu")),
    ("attention", include_str!("../../kernels/attention.cu")),
    ("attention_tc", include_str!("../../kernels/attention_tc.cu")),
    ("cross_entropy", include_str!("../../kernels/cross_entropy.cu")),
    ("adamw", include_str!("../../kernels/adamw.cu")),
];

/// The folders NVRTC searches for the CUDA headers the kernels include: `cuda_bf16.h`, and
/// `crt/mma.h` behind `mma.h` (tensor cores). A CUDA toolkit has both in one `include/`; the PyPI
/// wheels split them (`nvidia/cuda_runtime/include`, `nvidia/cuda_nvcc/include`). Looked for in
/// `$FERROTRON_CUDA_INCLUDE` (folders separated by ':'), `$CUDA_HOME/include`,
/// `/usr/local/cuda/include`, and beside each of them the wheels' `../../cuda_nvcc/include`.
pub fn include_dirs() -> Result<Vec<PathBuf>> {
    let mut candidates: Vec<PathBuf> =
        std::env::var_os("FERROTRON_CUDA_INCLUDE").map(|v| std::env::split_paths(&v).collect()).unwrap_or_default();
    candidates.extend(std::env::var_os("CUDA_HOME").map(|h| PathBuf::from(h).join("include")));
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    let wheel_siblings: Vec<PathBuf> = candidates.iter().map(|d| d.join("../../cuda_nvcc/include")).collect();
    candidates.extend(wheel_siblings);
    let find = |header: &str| candidates.iter().find(|d| d.join(header).exists()).cloned();
    let bf16 = find("cuda_bf16.h").ok_or_else(|| {
        anyhow!("no CUDA headers (cuda_bf16.h) found: set FERROTRON_CUDA_INCLUDE or CUDA_HOME, or `pip install nvidia-cuda-runtime-cu12 nvidia-cuda-nvcc-cu12` and point FERROTRON_CUDA_INCLUDE at its nvidia/cuda_runtime/include")
    })?;
    let mma = find("crt/mma.h").ok_or_else(|| {
        anyhow!("no crt/mma.h (the CUDA compiler's tensor-core header) found beside {}: install the CUDA toolkit's headers, or `pip install nvidia-cuda-nvcc-cu12` and add its nvidia/cuda_nvcc/include to FERROTRON_CUDA_INCLUDE (folders separated by ':')", bf16.display())
    })?;
    Ok(if bf16 == mma { vec![bf16] } else { vec![bf16, mma] })
}

/// NVRTC's name of compute capability `major.minor` ("sm_90"); a `'static` string as NVRTC's
/// options want, made once per architecture.
pub fn arch_name(major: i32, minor: i32) -> &'static str {
    static NAMES: OnceLock<Mutex<HashMap<(i32, i32), &'static str>>> = OnceLock::new();
    let mut names = NAMES.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    names.entry((major, minor)).or_insert_with(|| format!("sm_{major}{minor}").leak())
}

/// Can this machine compile kernels? An error says what is missing.
pub fn nvrtc_ready() -> Result<Vec<PathBuf>> {
    crate::cuda::runtime::require("NVRTC")?;
    include_dirs()
}

/// The PTX of kernel file `name` for `arch` (e.g. "sm_90"), compiled on first use.
pub fn ptx(name: &str, arch: &'static str) -> Result<Arc<Ptx>> {
    type Compiled = HashMap<(String, &'static str), Arc<Ptx>>;
    static CACHE: OnceLock<Mutex<Compiled>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (name.to_string(), arch);
    if let Some(p) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(p.clone());
    }
    let compiled = Arc::new(compile(name, arch)?);
    cache.lock().unwrap_or_else(|e| e.into_inner()).insert(key, compiled.clone());
    Ok(compiled)
}

/// Kernel file `name` as it is compiled: `common.cuh`, then the file (its lines numbered as in
/// `kernels/{name}.cu`, for the compiler's messages).
pub fn full_source(name: &str) -> Result<String> {
    let Some((_, source)) = SOURCES.iter().find(|(n, _)| *n == name) else {
        bail!("no kernel file named {name}");
    };
    Ok(format!("{COMMON}\n#line 1 \"{name}.cu\"\n{source}"))
}

/// Compiles kernel file `name` for `arch`; the error carries NVRTC's log.
pub fn compile(name: &str, arch: &'static str) -> Result<Ptx> {
    let text = full_source(name)?;
    let include_paths = nvrtc_ready()?.iter().map(|d| d.display().to_string()).collect();
    let options =
        CompileOptions { arch: Some(arch), include_paths, options: vec!["--std=c++17".into()], ..Default::default() };
    cudarc::nvrtc::compile_ptx_with_opts(text, options).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            anyhow!("kernels/{name}.cu does not compile for {arch}:\n{}", log.to_string_lossy())
        }
        other => anyhow!("kernels/{name}.cu for {arch}: NVRTC failed: {other:?}"),
    })
}
