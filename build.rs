//! Which optional test tools this machine has, as cfgs the tests read. A test that needs NVRTC
//! or g++ (the CPU emulator) where they are missing is *ignored* — cargo's summary counts it as
//! "N ignored" and `--list --ignored` names it — instead of passing without having run. CI
//! requires both (`FERROTRON_REQUIRE_NVRTC=1`, `FERROTRON_REQUIRE_EMULATOR=1`), so there they
//! always run, and fail if they cannot. (Tests that need a real GPU are `#[ignore]` everywhere;
//! `.ci/gpu_check` runs them on a GPU machine with `--include-ignored`.)
//!
//! The probe looks for the files; installing g++ or NVRTC later without changing PATH or
//! LD_LIBRARY_PATH needs a `touch build.rs` to be seen.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo::rustc-check-cfg=cfg(ferrotron_no_nvrtc)");
    println!("cargo::rustc-check-cfg=cfg(ferrotron_no_gxx)");
    println!("cargo::rerun-if-changed=build.rs");
    for var in
        ["PATH", "LD_LIBRARY_PATH", "CUDA_PATH", "CUDA_HOME", "FERROTRON_REQUIRE_NVRTC", "FERROTRON_REQUIRE_EMULATOR"]
    {
        println!("cargo::rerun-if-env-changed={var}");
    }
    let required = |var: &str| std::env::var_os(var).is_some_and(|v| v == "1");
    if !required("FERROTRON_REQUIRE_NVRTC") && !has_nvrtc() {
        println!("cargo::rustc-cfg=ferrotron_no_nvrtc");
    }
    if !required("FERROTRON_REQUIRE_EMULATOR") && !on_path("g++") {
        println!("cargo::rustc-cfg=ferrotron_no_gxx");
    }
}

fn dirs_of(var: &str) -> Vec<PathBuf> {
    std::env::var_os(var).map(|v| std::env::split_paths(&v).collect()).unwrap_or_default()
}

fn on_path(program: &str) -> bool {
    dirs_of("PATH").iter().any(|d| d.join(program).is_file())
}

/// A `libnvrtc.so*` where the dynamic loader looks: LD_LIBRARY_PATH, the CUDA toolkit, the
/// loader's cache.
fn has_nvrtc() -> bool {
    let mut dirs = dirs_of("LD_LIBRARY_PATH");
    for var in ["CUDA_PATH", "CUDA_HOME"] {
        dirs.extend(std::env::var_os(var).map(|d| Path::new(&d).join("lib64")));
    }
    dirs.extend(["/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"].map(PathBuf::from));
    let in_dirs = dirs.iter().any(|d| {
        std::fs::read_dir(d)
            .map(|entries| entries.flatten().any(|e| e.file_name().to_string_lossy().starts_with("libnvrtc.so")))
            .unwrap_or(false)
    });
    let cached = std::process::Command::new("ldconfig")
        .arg("-p")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("libnvrtc.so"));
    in_dirs || cached
}
