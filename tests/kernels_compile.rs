//! Every `kernels/*.cu` compiles with NVRTC for sm_80 (A100) and sm_90 (H100/H200), and its PTX
//! exports the kernels the CUDA backend launches. Where NVRTC or the CUDA headers are missing
//! the test prints why and passes, unless FERROTRON_REQUIRE_NVRTC=1 (CI sets it, after installing
//! the nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12 wheels).

use ferrotron::kernels::{compile, nvrtc_ready, SOURCES};

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    if let Err(e) = nvrtc_ready() {
        if std::env::var_os("FERROTRON_REQUIRE_NVRTC").is_some_and(|v| v == "1") {
            panic!("FERROTRON_REQUIRE_NVRTC=1 but NVRTC cannot run: {e:#}");
        }
        eprintln!("skipped: {e:#}");
        return;
    }
    let exported = [
        ("elementwise", "add_assign_bf16"),
        ("embedding", "embedding_backward_f32"),
        ("rmsnorm", "rmsnorm_backward_dw_bf16"),
        ("rope", "rope_bf16"),
        ("swiglu", "swiglu_backward_f32"),
        ("attention", "attention_dkdv_bf16"),
        ("cross_entropy", "cross_entropy_backward_bf16"),
        ("adamw", "adamw_bf16"),
    ];
    for (name, _) in SOURCES {
        for arch in ["sm_80", "sm_90"] {
            let ptx = compile(name, arch).unwrap_or_else(|e| panic!("{e:#}")).to_src();
            assert!(ptx.contains(&format!(".target {arch}")), "{name}: PTX for the wrong target");
            let (_, entry) = exported.iter().find(|(n, _)| *n == name).expect("every file has a checked entry");
            assert!(ptx.contains(&format!(".entry {entry}(")), "{name}.cu for {arch} does not export {entry}");
        }
    }
}
