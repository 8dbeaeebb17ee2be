//! Every `kernels/*.cu` compiles with NVRTC for sm_80 (A100) and sm_90 (H100/H200), and its PTX
//! exports every kernel the CUDA backend launches (`launch_table::catalogue`). Then `ptxas`, the
//! assembler the driver runs when it loads PTX, turns it into machine code, and its report is
//! checked: every kernel fits the 48 KiB of static shared memory a block may have, and the
//! tensor-core attention keeps its fragments and accumulators in registers (no spills, no stack)
//! and uses the tensor-core instructions it is written around (mma.sync, ldmatrix, cp.async).
//! NVRTC also gives each file's cubin (what the GPU loads, so an NVRTC newer than the driver still
//! works), and a GPU newer than this NVRTC knows gets PTX for the newest architecture it does.
//! Where NVRTC, the CUDA headers or ptxas are missing the test prints why and passes, unless
//! FERROTRON_REQUIRE_NVRTC=1 (CI sets it, after installing the nvidia-cuda-nvrtc-cu12,
//! nvidia-cuda-runtime-cu12 and nvidia-cuda-nvcc-cu12 wheels).

use ferrotron::cuda::kernels::KERNELS;
use ferrotron::cuda::nvrtc::{compile, include_dirs, nvrtc_ready, target, SOURCES};
use std::path::PathBuf;
use std::process::Command;

fn required() -> bool {
    std::env::var_os("FERROTRON_REQUIRE_NVRTC").is_some_and(|v| v == "1")
}

/// Whether NVRTC can run here; where it cannot, a test returns, unless CI requires it.
fn nvrtc_here() -> bool {
    match nvrtc_ready() {
        Ok(_) => true,
        Err(e) => {
            assert!(!required(), "FERROTRON_REQUIRE_NVRTC=1 but NVRTC cannot run: {e:#}");
            eprintln!("skipped: {e:#}");
            false
        }
    }
}

#[test]
#[cfg_attr(
    ferrotron_no_nvrtc,
    ignore = "needs NVRTC (the nvidia-cuda-nvrtc-cu12 wheel; kernels/README.md); .ci/run installs it"
)]
fn a_gpu_nvrtc_does_not_know_gets_ptx_for_the_newest_architecture_it_does() {
    if !nvrtc_here() {
        return;
    }
    assert_eq!(target(9, 0).unwrap(), "sm_90");
    let newer = target(9, 9).unwrap(); // no such GPU: the newest architecture below it
    assert!(newer.starts_with("compute_"), "{newer}");
    let compiled = compile("elementwise", newer).unwrap();
    assert!(compiled.cubin.is_none() && compiled.ptx.contains(".target sm_"), "PTX only, for the driver");
    let err = format!("{:#}", target(1, 0).unwrap_err());
    assert!(err.contains("cannot compile for sm_10"), "{err}");
}

#[test]
#[cfg_attr(
    ferrotron_no_nvrtc,
    ignore = "needs NVRTC (the nvidia-cuda-nvrtc-cu12 wheel; kernels/README.md); .ci/run installs it"
)]
fn every_kernel_compiles_for_sm80_and_sm90() {
    if !nvrtc_here() {
        return;
    }
    let ptxas = ptxas();
    if ptxas.is_none() {
        assert!(!required(), "FERROTRON_REQUIRE_NVRTC=1 but no ptxas: pip install nvidia-cuda-nvcc-cu12");
        eprintln!("ptxas not found: the PTX is not assembled (pip install nvidia-cuda-nvcc-cu12)");
    }
    let launches = ferrotron::cuda::launch_table::catalogue();
    let mut assembled = 0;
    for (name, _) in SOURCES {
        for arch in ["sm_80", "sm_90"] {
            let compiled = compile(name, arch).unwrap_or_else(|e| panic!("{e:#}"));
            assert!(compiled.cubin.as_ref().is_some_and(|c| c.starts_with(b"\x7fELF")), "{name}: no cubin for {arch}");
            let ptx = compiled.ptx;
            assert!(ptx.contains(&format!(".target {arch}")), "{name}: PTX for the wrong target");
            for (_, entry) in KERNELS.iter().filter(|(file, _)| *file == name) {
                assert!(ptx.contains(&format!(".entry {entry}(")), "{name}.cu for {arch} does not export {entry}");
            }
            if name == "flash_attention" {
                uses_tensor_core_instructions(&ptx);
            }
            if let Some(ptxas) = &ptxas {
                for k in assemble(ptxas, name, arch, &ptx) {
                    assert!(
                        k.smem <= 48 * 1024,
                        "{} for {arch}: {} bytes of shared memory, over 48 KiB",
                        k.name,
                        k.smem
                    );
                    let in_registers = !k.name.starts_with("flash_attention") || k.spilled + k.stack == 0;
                    assert!(
                        in_registers,
                        "{} for {arch}: {} bytes spilled, {} bytes of stack",
                        k.name, k.spilled, k.stack
                    );
                    assembled += 1;
                }
            }
        }
    }
    assert!(SOURCES.iter().all(|(name, _)| KERNELS.iter().any(|(file, _)| file == name)), "every file is launched");
    if ptxas.is_some() {
        eprintln!("{assembled} kernels assembled by ptxas for sm_80 and sm_90");
        assert!(assembled >= launches.len(), "ptxas reported fewer kernels than are launched");
    }
}

/// The table of kernels (`cuda/kernels.rs`) against the launches (`cuda/launch_table.rs`).
#[test]
fn each_kernel_is_in_the_table_once_and_the_catalogue_launches_it() {
    let launches = ferrotron::cuda::launch_table::catalogue();
    // a name twice in the table would give its second function a number no launch gets
    let names: std::collections::BTreeSet<_> = KERNELS.iter().map(|(_, n)| n).collect();
    assert_eq!(names.len(), KERNELS.len(), "a kernel name twice in cuda::kernels::KERNELS");
    // the catalogue (argument types for the emulator) launches every kernel of the table
    for (index, (_, name)) in KERNELS.iter().enumerate() {
        assert!(launches.iter().any(|l| l.kernel.index() == index), "no launch of {name} in the catalogue");
    }
}

/// A kernel's dynamic shared memory is its own (the same at every shape, which is what a device
/// opts each function in to when it opens: `launch_table::dynamic_shared`), and fits every GPU the
/// kernels are built for: past 48 KiB, up to the 99 KiB an sm_86 or sm_89 block may opt in to.
#[test]
fn a_kernel_asks_the_same_dynamic_shared_memory_at_every_shape() {
    use ferrotron::cuda::launch_table::{attention, dynamic_shared};
    use ferrotron::ops::{Attn, DType};
    let opted = dynamic_shared();
    assert!(!opted.is_empty(), "the tensor-core forward keeps its tiles in dynamic shared memory");
    for (kernel, bytes) in &opted {
        assert!(*bytes <= 99 << 10, "{}: {bytes} bytes of dynamic shared memory a block", kernel.name());
    }
    for (batch, seq, heads, kv_heads) in [(1, 1, 1, 1), (3, 70, 6, 2), (8, 2048, 9, 3), (1, 8192, 64, 8)] {
        for head_dim in attention::TENSOR_CORE_HEAD_DIMS {
            let a = Attn { batch, seq, kv_seq: seq, heads, kv_heads, head_dim };
            let l = attention::forward(DType::Bf16, a, (0, 0, 0), (0, 0), 0, 0);
            let opted_in = opted.iter().find(|(k, _)| *k == l.kernel).map_or(0, |o| o.1);
            assert_eq!(l.shared, opted_in, "{} at {a:?}", l.kernel.name());
        }
    }
}

/// ptxas on the PATH, or in the `bin/` beside the CUDA headers (a toolkit, or the nvcc wheel).
fn ptxas() -> Option<PathBuf> {
    let beside_headers = include_dirs().ok()?.into_iter().map(|d| d.join("../bin/ptxas"));
    let on_path =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).map(|d| d.join("ptxas")).collect::<Vec<_>>());
    beside_headers.chain(on_path.unwrap_or_default()).find(|p| p.is_file())
}

/// The FlashAttention kernels are written around three PTX instructions; an edit that made the
/// compiler drop one (a fragment computed in another way) would keep results right and lose the
/// speed, so the PTX is checked for each.
fn uses_tensor_core_instructions(ptx: &str) {
    for instruction in [
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
        "cp.async.cg.shared.global",
        "cp.async.wait_group",
    ] {
        assert!(ptx.contains(instruction), "flash_attention's PTX has no {instruction}");
    }
}

/// What ptxas -v reports of one kernel.
struct Kernel {
    name: String,
    spilled: usize,
    stack: usize,
    smem: usize,
}

fn assemble(ptxas: &PathBuf, name: &str, arch: &str, ptx: &str) -> Vec<Kernel> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let file = dir.join(format!("{name}_{arch}.ptx"));
    std::fs::write(&file, ptx).unwrap();
    let out = Command::new(ptxas)
        .args(["-v", "-arch", arch, "-o"])
        .arg(dir.join(format!("{name}_{arch}.cubin")))
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", ptxas.display()));
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "ptxas rejects {name}.cu for {arch}:\n{log}");
    // "Compiling entry function 'NAME' for 'sm_90'", "... N bytes spill stores ...", "... M bytes smem"
    let number_before = |line: &str, what: &str| {
        let words: Vec<&str> = line.split([' ', ',']).filter(|w| !w.is_empty()).collect();
        words.windows(3).find(|w| w[1] == "bytes" && w[2] == what).map(|w| w[0].parse::<usize>().unwrap())
    };
    let mut kernels: Vec<Kernel> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap().to_string();
            kernels.push(Kernel { name, spilled: 0, stack: 0, smem: 0 });
        } else if let Some(k) = kernels.last_mut() {
            k.spilled += number_before(line, "spill").unwrap_or(0);
            k.stack = number_before(line, "stack").unwrap_or(k.stack);
            k.smem = number_before(line, "smem").unwrap_or(k.smem);
        }
    }
    kernels
}

/// `FERROTRON_KERNELS=DIR`: a kernel file there replaces the built-in one (said on stderr), and a
/// replacement that does not compile is named by its own path. Run through `ferrotron doctor`,
/// which compiles every kernel file even without a GPU, so the variable stays in the child.
#[test]
#[cfg_attr(
    ferrotron_no_nvrtc,
    ignore = "needs NVRTC (the nvidia-cuda-nvrtc-cu12 wheel; kernels/README.md); .ci/run installs it"
)]
fn a_kernel_file_in_ferrotron_kernels_replaces_the_built_in_one() {
    if !nvrtc_here() {
        return;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("replaced_kernels");
    std::fs::create_dir_all(&dir).unwrap();
    let doctor = || {
        let out = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
            .arg("doctor")
            .env("FERROTRON_KERNELS", &dir)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
    };
    let rope = SOURCES.iter().find(|(n, _)| *n == "rope").unwrap().1;
    std::fs::write(dir.join("rope.cu"), rope).unwrap();
    let said = doctor();
    assert!(said.contains("replaced_kernels/rope.cu replaces the built-in rope.cu"), "{said}");
    assert!(said.contains("kernel files compile with NVRTC"), "{said}");
    std::fs::write(dir.join("rope.cu"), format!("{rope}\nthis is not CUDA;\n")).unwrap();
    let said = doctor();
    assert!(said.contains("replaced_kernels/rope.cu does not compile for sm_90"), "{said}");
}
