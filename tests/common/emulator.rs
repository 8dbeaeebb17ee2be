//! Builds the CUDA kernels as C++ for the CPU emulator (`tests/emulator/`): every
//! `kernels/*.cu` file as NVRTC would see it, plus a glue file that calls each kernel of
//! `launch_table::catalogue()` by name from an array of argument pointers (`emu_launch`, the layout
//! of cuLaunchKernel's parameters, with the launch's dynamic shared bytes) and says which names
//! exist (`emu_has`). Shared by `tests/kernels_emulated.rs` (launches on host buffers) and
//! `tests/gpu_path_emulated.rs` (the same library behind a fake CUDA driver).

use ferrotron::cuda::launch_table::{self, Arg};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Compiles the kernels, the glue and `extra` (files of `tests/emulator/`) into `dir/lib`
/// under the test target folder; an error says why (no g++, or a compile error).
pub fn build(dir: &str, lib: &str, extra: &[&str]) -> Result<PathBuf, String> {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/emulator");
    let mut files = vec![dir.join("glue.cpp")];
    std::fs::write(&files[0], glue()).map_err(|e| e.to_string())?;
    for (name, _) in ferrotron::cuda::nvrtc::SOURCES {
        let path = dir.join(format!("{name}.cpp"));
        std::fs::write(&path, ferrotron::cuda::nvrtc::full_source(name).unwrap()).map_err(|e| e.to_string())?;
        files.push(path);
    }
    files.extend(extra.iter().map(|f| include.join(f)));
    let lib = dir.join(lib);
    let out = Command::new("g++")
        .args(["-std=c++20", "-O2", "-fPIC", "-shared", "-pthread", "-w", "-I"])
        .arg(&include)
        .args(&files)
        .arg("-o")
        .arg(&lib)
        .output()
        .map_err(|e| format!("g++ cannot run ({e}): install g++ (C++20) to emulate the kernels"))?;
    if !out.status.success() {
        return Err(format!("the kernels do not compile as C++:\n{}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(lib)
}

/// C++ that declares each kernel with its argument types and calls it from an argument array.
fn glue() -> String {
    let kernels: BTreeMap<String, Vec<&str>> = launch_table::catalogue()
        .into_iter()
        .map(|l| {
            let types = l.args.iter().map(|a| match a {
                Arg::Ptr(_) => "void*",
                Arg::I32(_) => "int",
                Arg::I64(_) => "long",
                Arg::F32(_) => "float",
                Arg::F64(_) => "double",
                Arg::Shape(_) => "Shape",
                Arg::Tensors(_) => "TensorList",
                Arg::AdamW(_) => "AdamWList",
            });
            (l.kernel.name().to_string(), types.collect())
        })
        .collect();
    let mut c = String::from("#include \"cuda_bf16.h\"\n#include <cstring>\nstruct Shape { int v[6]; };\n");
    // the multi-tensor lists: passed by value, the kernels' structs of the same size and alignment
    for (name, size) in
        [("TensorList", size_of::<launch_table::TensorList>()), ("AdamWList", size_of::<launch_table::AdamWList>())]
    {
        c += &format!("struct alignas(8) {name} {{ unsigned char bytes[{size}]; }};\n");
    }
    for (i, (name, types)) in kernels.iter().enumerate() {
        let args: Vec<String> = types.iter().enumerate().map(|(j, t)| format!("*({t}*)a[{j}]")).collect();
        c += &format!("extern \"C\" void {name}({});\n", types.join(", "));
        c += &format!("static void call{i}(void** a) {{ {name}({}); }}\n", args.join(", "));
    }
    c += "extern \"C\" int emu_launch(const char* name, unsigned x, unsigned y, unsigned z, unsigned block, unsigned shared, \
          void** a) {\n";
    for (i, name) in kernels.keys().enumerate() {
        c += &format!(
            "    if (!strcmp(name, \"{name}\")) {{ emu::run(call{i}, a, dim3{{x, y, z}}, block, shared); return 0; }}\n"
        );
    }
    c += "    return -1;\n}\n";
    let names: Vec<String> = kernels.keys().map(|n| format!("\"{n}\"")).collect();
    c += &format!("static const char* names[] = {{{}}};\n", names.join(", "));
    c + "extern \"C\" int emu_has(const char* name) {\n    for (const char* n : names) if (!strcmp(n, name)) return 1;\n    return 0;\n}\n"
}
