//! # The CUDA kernels, compiled at run time by NVRTC
//!
//! `kernels/*.cu` are compiled into the binary as text. On a GPU each file is compiled once per
//! process for the GPU's own architecture (`sm_90` on an H100) and the PTX is cached here; the
//! CUDA backend loads it into its context. Each file is preceded by `kernels/common.cuh` (the
//! f32/bf16 load and store helpers and the block reductions) before it is compiled, so NVRTC needs
//! no include path of ours, only the CUDA headers for `cuda_bf16.h`.
//!
//! Without a GPU the same compilation still runs, and `tests/kernels_compile.rs` uses it so CI
//! catches a kernel that does not compile: NVRTC and the headers come from the Python wheels
//! `nvidia-cuda-nvrtc-cu12` and `nvidia-cuda-runtime-cu12` (see `.ci/run`).

use anyhow::{anyhow, bail, Result};
use cudarc::nvrtc::{CompileOptions, Ptx};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

const COMMON: &str = include_str!("../kernels/common.cuh");

/// Every kernel file: (name, source).
pub const SOURCES: [(&str, &str); 8] = [
    ("elementwise", include_str!("../kernels/elementwise.cu")),
    ("embedding", include_str!("../kernels/embedding.cu")),
    ("rmsnorm", include_str!("../kernels/rmsnorm.cu")),
    ("rope", include_str!("../kernels/rope.cu")),
    ("swiglu", include_str!("../kernels/swiglu.cu")),
    ("attention", include_str!("../kernels/attention.cu")),
    ("cross_entropy", include_str!("../kernels/cross_entropy.cu")),
    ("adamw", include_str!("../kernels/adamw.cu")),
];

/// The folder holding `cuda_bf16.h`: `$FERROTRON_CUDA_INCLUDE`, else `$CUDA_HOME/include`, else
/// `/usr/local/cuda/include`.
pub fn include_dir() -> Result<PathBuf> {
    let candidates = [
        std::env::var_os("FERROTRON_CUDA_INCLUDE").map(PathBuf::from),
        std::env::var_os("CUDA_HOME").map(|h| PathBuf::from(h).join("include")),
        Some(PathBuf::from("/usr/local/cuda/include")),
    ];
    candidates.into_iter().flatten().find(|d| d.join("cuda_bf16.h").exists()).ok_or_else(|| {
        anyhow!("no CUDA headers (cuda_bf16.h) found: set FERROTRON_CUDA_INCLUDE or CUDA_HOME, or `pip install nvidia-cuda-runtime-cu12` and point FERROTRON_CUDA_INCLUDE at its nvidia/cuda_runtime/include")
    })
}

/// NVRTC's name of compute capability `major.minor` ("sm_90"); a `'static` string as NVRTC's
/// options want, made once per architecture.
pub fn arch_name(major: i32, minor: i32) -> &'static str {
    static NAMES: OnceLock<Mutex<HashMap<(i32, i32), &'static str>>> = OnceLock::new();
    let mut names = NAMES.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    names.entry((major, minor)).or_insert_with(|| format!("sm_{major}{minor}").leak())
}

/// Can this machine compile kernels? An error says what is missing.
pub fn nvrtc_ready() -> Result<PathBuf> {
    crate::gpu::require("NVRTC")?;
    include_dir()
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
    let include = nvrtc_ready()?;
    let options = CompileOptions {
        arch: Some(arch),
        include_paths: vec![include.display().to_string()],
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(text, options).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            anyhow!("kernels/{name}.cu does not compile for {arch}:\n{}", log.to_string_lossy())
        }
        other => anyhow!("kernels/{name}.cu for {arch}: NVRTC failed: {other:?}"),
    })
}
