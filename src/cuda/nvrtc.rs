//! # The CUDA kernels, compiled at run time by NVRTC
//!
//! `kernels/*.cu` are compiled into the binary as text. On a GPU each file is compiled once per
//! process for the GPU's own architecture (`sm_90` on an H100) and cached here; `load_kernels`
//! loads every file into a GPU's context when its device opens. NVRTC gives PTX (the portable
//! assembly) *and* the cubin (machine code for that architecture), and the cubin is what is
//! loaded: the driver would have to JIT-compile PTX, and refuses PTX from an NVRTC newer than
//! itself. Only for an architecture this NVRTC does not know is PTX loaded, made for the newest
//! architecture it knows (`target`), for the driver to compile. Each file is preceded by `kernels/common.cuh` (the
//! f32/bf16 load and store helpers and the block reductions) before it is compiled, so NVRTC needs
//! no include path of ours, only the CUDA headers (`cuda_bf16.h`; the tensor cores are reached by
//! inline PTX).
//!
//! Without a GPU the same compilation still runs, and `tests/kernels_compile.rs` uses it so CI
//! catches a kernel that does not compile: NVRTC and the headers come from the Python wheels
//! `nvidia-cuda-nvrtc-cu12` and `nvidia-cuda-runtime-cu12` (see `.ci/run`).

use crate::cuda::kernels::KERNELS;
use crate::cuda::runtime::Gpu;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::{result, sys, Ptx};
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

const COMMON: &str = include_str!("../../kernels/common.cuh");

/// Every kernel file: (name, source).
pub const SOURCES: [(&str, &str); 11] = [
    ("elementwise", include_str!("../../kernels/elementwise.cu")),
    ("embedding", include_str!("../../kernels/embedding.cu")),
    ("rmsnorm", include_str!("../../kernels/rmsnorm.cu")),
    ("rope", include_str!("../../kernels/rope.cu")),
    ("swiglu", include_str!("../../kernels/swiglu.cu")),
    ("attention", include_str!("../../kernels/attention.cu")),
    ("flash_attention", include_str!("../../kernels/flash_attention.cu")),
    ("cross_entropy", include_str!("../../kernels/cross_entropy.cu")),
    ("moe", include_str!("../../kernels/moe.cu")),
    ("fp8", include_str!("../../kernels/fp8.cu")),
    ("adamw", include_str!("../../kernels/adamw.cu")),
];

/// The folders NVRTC searches for the CUDA headers the kernels include: `cuda_bf16.h`, and the
/// `crt/` headers it includes. A CUDA toolkit has both in one `include/`; the PyPI wheels may split
/// them (`nvidia/cuda_runtime/include`, `nvidia/cuda_nvcc/include`). Looked for in
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
    // cuda_bf16.h includes crt/ headers; some wheels keep them with the compiler's headers instead
    let crt = find("crt/host_defines.h").filter(|d| *d != bf16);
    Ok([Some(bf16), crt].into_iter().flatten().collect())
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

/// A kernel file compiled for one target: its PTX, and its cubin when the target is a real
/// architecture (`sm_90`; a virtual one, `compute_90`, has only PTX).
pub struct Compiled {
    pub ptx: String,
    pub cubin: Option<Vec<u8>>,
}

/// What to compile for a GPU of compute capability `major.minor`: its own architecture (`sm_90`)
/// when this NVRTC knows it, else PTX for the newest architecture it knows below it
/// (`compute_90`), which the driver compiles when it loads it.
pub fn target(major: i32, minor: i32) -> Result<&'static str> {
    let want = major * 10 + minor;
    let mut n = 0;
    // SAFETY: NVRTC is loaded (`nvrtc_ready`); a valid out-pointer, then a buffer of n ints.
    let known = unsafe {
        nvrtc_ready()?;
        sys::nvrtcGetNumSupportedArchs(&mut n).result().map_err(nvrtc_err)?;
        let mut archs = vec![0; n.max(0) as usize];
        sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()).result().map_err(nvrtc_err)?;
        archs
    };
    if known.contains(&want) {
        return Ok(arch_name(major, minor));
    }
    let Some(&best) = known.iter().filter(|&&a| a < want).max() else {
        bail!("this NVRTC cannot compile for sm_{want} or anything older it could run: use a newer NVRTC");
    };
    Ok(format!("compute_{best}").leak())
}

fn nvrtc_err(e: cudarc::nvrtc::result::NvrtcError) -> anyhow::Error {
    anyhow!("NVRTC: {e:?}")
}

/// Kernel file `name` compiled for `target` (e.g. "sm_90"), on first use; then from the cache.
pub fn compiled(name: &str, target: &'static str) -> Result<Arc<Compiled>> {
    type Cache = HashMap<(String, &'static str), Arc<Compiled>>;
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (name.to_string(), target);
    if let Some(c) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(c.clone());
    }
    let made = Arc::new(compile(name, target)?);
    cache.lock().unwrap_or_else(|e| e.into_inner()).insert(key, made.clone());
    Ok(made)
}

/// Kernel file `name` as it is compiled: `common.cuh`, then the file (its lines numbered as in
/// `kernels/{name}.cu`, for the compiler's messages). With `$FERROTRON_KERNELS` set to a folder,
/// a `{name}.cu` or `common.cuh` there replaces the built-in text: an edited kernel runs (and is
/// timed, on a GPU) without rebuilding the binary, and one binary can time several variants.
pub fn full_source(name: &str) -> Result<String> {
    source(name).map(|(_, text)| text)
}

/// Where kernel file `name` comes from (`kernels/{name}.cu`, or its replacement), for messages,
/// and its text as compiled.
fn source(name: &str) -> Result<(String, String)> {
    let Some((_, built_in)) = SOURCES.iter().find(|(n, _)| *n == name) else {
        bail!("no kernel file named {name}");
    };
    let common = replaced("common.cuh")?.map_or_else(|| COMMON.to_string(), |(_, text)| text);
    let (origin, line_name, text) = match replaced(&format!("{name}.cu"))? {
        Some((path, text)) => (path.display().to_string(), path.display().to_string(), text),
        None => (format!("kernels/{name}.cu"), format!("{name}.cu"), built_in.to_string()),
    };
    Ok((origin, format!("{common}\n#line 1 \"{line_name}\"\n{text}")))
}

/// `$FERROTRON_KERNELS/{file}` and its text, where the variable names a folder holding that file
/// (said once on stderr, so that a timing is never mistaken for the built-in kernels').
fn replaced(file: &str) -> Result<Option<(PathBuf, String)>> {
    let Some(dir) = std::env::var_os("FERROTRON_KERNELS").filter(|d| !d.is_empty()) else {
        return Ok(None);
    };
    let path = PathBuf::from(dir).join(file);
    if !path.is_file() {
        return Ok(None);
    }
    static SAID: OnceLock<Mutex<std::collections::HashSet<PathBuf>>> = OnceLock::new();
    if SAID.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner()).insert(path.clone()) {
        eprintln!("kernels: {} replaces the built-in {file} (FERROTRON_KERNELS)", path.display());
    }
    let text = crate::files::read_text(&path, "FERROTRON_KERNELS")
        .map_err(|e| anyhow!("{e:#}; fix the file or unset the variable"))?;
    Ok(Some((path, text)))
}

/// Compiles kernel file `name` for `target` (a real `sm_XY` or a virtual `compute_XY`
/// architecture); the error carries NVRTC's log.
pub fn compile(name: &str, target: &'static str) -> Result<Compiled> {
    let (origin, text) = source(name)?;
    let text = CString::new(text)?;
    let mut options = vec![format!("--gpu-architecture={target}"), "--std=c++17".to_string()];
    options.extend(nvrtc_ready()?.iter().map(|d| format!("--include-path={}", d.display())));
    let program = Program(result::create_program(&text, None).map_err(nvrtc_err)?);
    // SAFETY: a program just created, freed only by `Program`'s drop; buffers sized by NVRTC.
    unsafe {
        if result::compile_program(program.0, &options).is_err() {
            let log = result::get_program_log(program.0).map_err(nvrtc_err)?;
            let log = CStr::from_ptr(log.as_ptr()).to_string_lossy();
            bail!("{origin} does not compile for {target}:\n{log}");
        }
        let ptx = result::get_ptx(program.0).map_err(nvrtc_err)?;
        let ptx = CStr::from_ptr(ptx.as_ptr()).to_string_lossy().into_owned();
        let mut size = 0;
        let cubin = match target.starts_with("sm_") && sys::nvrtcGetCUBINSize(program.0, &mut size).result().is_ok() {
            true if size > 0 => {
                let mut bytes = vec![0u8; size];
                sys::nvrtcGetCUBIN(program.0, bytes.as_mut_ptr().cast()).result().map_err(nvrtc_err)?;
                Some(bytes)
            }
            _ => None,
        };
        Ok(Compiled { ptx, cubin })
    }
}

/// An NVRTC program, destroyed when dropped.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: made by create_program and destroyed only here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// Compiles every kernel file for `target` (`cuda/nvrtc.rs`), loads it into `gpu`'s context
/// (the cubin, or the PTX for the driver to compile) and looks up every kernel of the table
/// (`cuda/kernels.rs`), in its order: whatever cannot load fails now, before training, with the
/// versions involved.
pub fn load_kernels(gpu: &Gpu, target: &'static str) -> Result<Vec<CudaFunction>> {
    let mut modules: HashMap<&str, Arc<CudaModule>> = HashMap::new();
    for (file, _) in SOURCES {
        let compiled = compiled(file, target)?;
        let image = match &compiled.cubin {
            Some(cubin) => Ptx::from_binary(cubin.clone()),
            None => Ptx::from_src(compiled.ptx.clone()),
        };
        modules.insert(file, gpu.ctx.load_module(image).map_err(|e| load_error(file, target, e))?);
    }
    let function = |(file, name): &(&str, &str)| {
        let module = modules.get(file).ok_or_else(|| anyhow!("kernel {name}: no file kernels/{file}.cu"))?;
        module.load_function(name).map_err(|e| anyhow!("kernels/{file}.cu has no kernel {name}: {e:?}"))
    };
    KERNELS.iter().map(function).collect()
}

/// A module that does not load: most often code newer than the driver can read.
fn load_error(file: &str, target: &str, e: cudarc::driver::DriverError) -> anyhow::Error {
    let mut nvrtc = (0, 0);
    // SAFETY: NVRTC is loaded (the kernels were just compiled with it); two valid out-pointers.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut nvrtc.0, &mut nvrtc.1) };
    let mut driver = 0;
    // SAFETY: the driver is loaded (a context exists); a valid out-pointer.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) };
    anyhow!(
        "kernels/{file}.cu compiled for {target} but the GPU driver cannot load it ({e:?}); NVRTC is CUDA {}.{}, the driver \
         supports CUDA {}.{}: use an NVRTC no newer than the driver (FERROTRON_CUDA_INCLUDE and LD_LIBRARY_PATH \
         pick it) or update the driver",
        nvrtc.0,
        nvrtc.1,
        driver / 1000,
        driver % 1000 / 10
    )
}
