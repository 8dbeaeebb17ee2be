//! The FlashAttention kernels read from their machine code, without a GPU. NVRTC compiles
//! `kernels/flash_attention.cu` for sm_90 exactly as the runtime does (`cuda::nvrtc::compile`),
//! `cuobjdump -sass` disassembles the cubin, and this test reports, for every kernel and head
//! size, the loop that runs once per tile (the hot loop: the loop with the most `HMMA`, the
//! tensor-core instruction of one `mma.sync`):
//!
//! ```text
//! kernel                       instr  HMMA  per HMMA  cycles/HMMA  regs  stack  smem   warps/SM  the loop, in order
//! flash_attention_forward_d64    744   128      5.81         10.2   168     0  75904      12   cp18 W1 B H64 E12 H E … H12 B
//!   and as many HMMA in    937            7.32  (the forward's tiles across the diagonal: cp18 W1 B H64 E12 …)
//! ```
//! - instructions per HMMA: a sub-partition issues one instruction a clock and one m16n8k16 keeps
//!   its tensor core busy 4–6 clocks, so above about 6 the issue slots, not the tensor cores, set
//!   the speed (FlashAttention-2's forward: about 4). Counted statically over the whole loop
//!   (a branch jumped over counts too: an upper bound of what one turn issues). The forward has
//!   two loops of as many HMMA, one turn each: its clear tiles', the hot loop, then, on its own
//!   line, its loop over the tiles across the diagonal, with the mask (one or two tiles of a
//!   block's walk under causal order).
//! - scheduler clocks per HMMA, estimated (`cycles_per_hmma`): instructions per HMMA over the
//!   issue rate w warps per scheduler reach, 1 − (1 − p)^w with p fitted to the H100's 0.43 at
//!   w = 2, plus an unhidden copy's latency where the loop waits for copies with no products in
//!   flight. The H100 measured about 33 for the kernels before this report and 17 for
//!   FlashAttention-2; the goal is 18.
//! - registers, stack, shared memory (static from `cuobjdump -res-usage`, plus the dynamic bytes
//!   the launch table gives a block) and the warps an H100 SM holds at
//!   once (64K registers in 256-register steps per warp, 228 KiB of shared memory with 1 KiB
//!   reserved a block, 64 warps, 32 blocks); 2 warps per scheduler (8 an SM) are too few to hide
//!   the latencies (`kernels/README.md`).
//! - the loop in order: runs of `cp` (LDGSTS, a 16-byte cp.async), `H` (HMMA), `E` (MUFU.EX2, an
//!   exponential), `W n` (DEPBAR.LE n: wait until n copy groups are in flight), `B` (a barrier).
//!   Copies, then a wait with n ≥ 1, then the products: the next tile's copies overlap them.
//!
//! It holds budgets, so that an edit that costs issue slots, occupancy or overlap fails here, not
//! months later on a GPU: instructions per HMMA at head sizes 64 and 128, the clocks per HMMA
//! estimate (at most 18 at head size 64, today's at 128), at least 8 warps per SM
//! for every kernel, no local memory (spills) inside a hot loop, and in both kernels the
//! overlap above (tests/kernels_compile.rs adds: no spill anywhere in these kernels). Needs NVRTC (as tests/kernels_compile.rs) and `cuobjdump` with `nvdisasm` (the
//! PyPI wheels nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm; 13.x reads NVRTC 12.9's cubins):
//! on the PATH or in `$FERROTRON_SASS_TOOLS`. Prints why and passes without them, unless
//! FERROTRON_REQUIRE_NVRTC=1 (CI). Run `cargo test --release --test kernels_sass -- --nocapture`
//! to read the report.

use ferrotron::cuda::launch_table::attention::{backward, forward, TENSOR_CORE_HEAD_DIMS};
use ferrotron::cuda::nvrtc::{compile, nvrtc_ready};
use ferrotron::ops::{Attn, DType};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The budgets: (kernel, most instructions per HMMA in its hot loop). Measured when set (last
/// on 2026-11-28, latest: both walks' next tile by arithmetic where positions are consecutive,
/// which adds its few instructions beside the scan that other positions keep; before that, the
/// forward's tiles across the diagonal in a loop of their own, so that the clear tiles' loop has
/// no mask; its key tiles in dynamic shared memory, shared addresses by the compiler's intrinsic,
/// one address for the two tensors a tile copies, dQ's rows addressed once a tile pair) and
/// rounded up a little: they catch regressions. The goal, 6, is met.
const PER_HMMA: [(&str, f64); 4] = [
    ("flash_attention_forward_d64", 5.9),
    ("flash_attention_forward_d128", 5.05),
    ("flash_attention_backward_d64", 6.0),
    ("flash_attention_backward_d128", 6.0),
];
/// The same for the forward's second loop, over the tiles across the diagonal (masked): one or
/// two tiles of a block's walk under causal order, against up to seq / 128 clear ones.
const ACROSS_PER_HMMA: [(&str, f64); 2] = [("flash_attention_forward_d64", 7.4), ("flash_attention_forward_d128", 5.9)];
const MIN_WARPS_PER_SM: u32 = 8;
/// The estimate of scheduler clocks per HMMA must not pass this at head size 64 (the issue's
/// goal, FlashAttention-2's measured 17 rounded up), nor rise more than 5 % above today's at 128.
const CYCLES_PER_HMMA_D64: f64 = 18.0;
const CYCLES_PER_HMMA_D128: [(&str, f64); 2] =
    [("flash_attention_forward_d128", 12.1), ("flash_attention_backward_d128", 14.4)];

/// The chance a warp can issue in a given clock: with `w` warps a scheduler issues in a clock
/// with probability 1 − (1 − P)^w. Fitted to the 0.43 instructions a clock an H100 issued at 2 warps
/// a scheduler (measured 2026-11-26, BENCHMARKS.md, "GPU: the FlashAttention-2 kernels on one H100,
/// 2026-11-26"): 1 − (1 − P)² = 0.43.
const P_READY: f64 = 0.245;
/// Clocks a copy takes to land when nothing hides it (global memory on an H100, about 600: an
/// assumption of the model, checked against the measured kernels in kernels/README.md).
const COPY_LATENCY: f64 = 600.0;

/// Scheduler clocks per HMMA, estimated: the loop's instructions over the issue rate its warps
/// per scheduler reach, plus, where the loop waits for copies it issued without products in
/// between (no overlap), their latency shared by the scheduler's warps. A model, not a
/// measurement: it leaves out barriers, the tensor pipe's own limit and the tail of a grid.
fn cycles_per_hmma(loop_: &Loop, warps_per_sm: u32) -> f64 {
    let w = warps_per_sm as f64 / 4.0; // four schedulers an SM
    let issue = loop_.instructions as f64 / loop_.hmma as f64 / (1.0 - (1.0 - P_READY).powf(w));
    let exposed = loop_.first_wait == Some(0) && loop_.copies_before_wait;
    issue + if exposed { COPY_LATENCY / (w * loop_.hmma as f64) } else { 0.0 }
}

#[test]
#[cfg_attr(
    ferrotron_no_nvrtc,
    ignore = "needs NVRTC (the nvidia-cuda-nvrtc-cu12 wheel; kernels/README.md); .ci/run installs it"
)]
fn the_attention_kernels_machine_code_keeps_its_budgets() {
    let required = std::env::var_os("FERROTRON_REQUIRE_NVRTC").is_some_and(|v| v == "1");
    if let Err(e) = nvrtc_ready() {
        assert!(!required, "FERROTRON_REQUIRE_NVRTC=1 but NVRTC cannot run: {e:#}");
        eprintln!("skipped: {e:#}");
        return;
    }
    let Some(tools) = sass_tools() else {
        assert!(!required, "FERROTRON_REQUIRE_NVRTC=1 but no cuobjdump: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, set FERROTRON_SASS_TOOLS to their bin/");
        eprintln!("skipped: no cuobjdump and nvdisasm (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)");
        return;
    };
    let cubin = compile("flash_attention", "sm_90").unwrap_or_else(|e| panic!("{e:#}")).cubin.expect("a cubin");
    let file = Path::new(env!("CARGO_TARGET_TMPDIR")).join("flash_attention_sm_90.cubin");
    std::fs::write(&file, cubin).unwrap();
    let report = Report::read(&tools, &file);
    let blocks = block_shapes();
    let mut failures = Vec::new();
    println!(
        "kernel                          instr  HMMA  per HMMA  cycles/HMMA  regs  stack   smem  warps/SM  the loop, in order"
    );
    for (name, k) in &report.kernels {
        let loops = k.hot_loops();
        let loop_ = loops.first().unwrap_or_else(|| panic!("{name}: no loop with HMMA"));
        let per_hmma = loop_.instructions as f64 / loop_.hmma as f64;
        let (threads, dynamic) = blocks[name];
        let shared = k.shared + dynamic; // static (the cubin's) and dynamic (the launch's)
        let warps = warps_per_sm(threads, k.registers, shared);
        let cycles = cycles_per_hmma(loop_, warps);
        println!(
            "{name:30} {:6} {:5} {per_hmma:9.2} {cycles:12.1} {:5} {:6} {:6} {warps:9}  {}",
            loop_.instructions, loop_.hmma, k.registers, k.stack, shared, loop_.events
        );
        for other in &loops[1..] {
            let per_hmma = other.instructions as f64 / other.hmma as f64;
            println!(
                "  and as many HMMA in {:6} {per_hmma:15.2}  (the forward's tiles across the diagonal: {})",
                other.instructions, other.events
            );
            if let Some((_, most)) =
                ACROSS_PER_HMMA.iter().find(|(n, _)| n == name).filter(|(_, most)| per_hmma > *most)
            {
                failures
                    .push(format!("{name}: {per_hmma:.2} instructions per HMMA across the diagonal, budget {most}"));
            }
        }
        if ACROSS_PER_HMMA.iter().any(|(n, _)| n == name) && loops.len() != 2 {
            failures.push(format!(
                "{name}: {} loops with the most HMMA, two wanted (clear tiles, then across)",
                loops.len()
            ));
        }
        let most_cycles = match name.strip_suffix("_d64") {
            Some(_) => Some(CYCLES_PER_HMMA_D64),
            None => CYCLES_PER_HMMA_D128.iter().find(|(n, _)| n == name).map(|b| b.1),
        };
        if let Some(most) = most_cycles.filter(|most| cycles > *most) {
            failures.push(format!("{name}: an estimated {cycles:.1} scheduler clocks per HMMA, budget {most}"));
        }
        if let Some((_, most)) = PER_HMMA.iter().find(|(n, _)| n == name) {
            if per_hmma > *most {
                failures.push(format!("{name}: {per_hmma:.2} instructions per HMMA, budget {most}"));
            }
        }
        if warps < MIN_WARPS_PER_SM {
            failures.push(format!("{name}: {warps} warps per SM, at least {MIN_WARPS_PER_SM} wanted"));
        }
        for l in loops.iter().filter(|l| l.local_memory > 0) {
            failures.push(format!("{name}: {} local-memory (spill) instructions in a hot loop", l.local_memory));
        }
        // the next tile's copies fly while this tile's products run: issued before the loop's
        // first wait, which leaves them in flight (n ≥ 1, the forward), or issued after it, with
        // products after them in the loop (the backward: dQ's, after the last read of Q and dO)
        let overlapped = match loop_.copies_before_wait {
            true => loop_.first_wait.is_some_and(|n| n >= 1),
            false => loop_.hmma_after_copies,
        };
        if !overlapped {
            failures.push(format!("{name}: no copy overlaps the products (the loop: {})", loop_.events));
        }
    }
    assert_eq!(report.kernels.len(), 2 * TENSOR_CORE_HEAD_DIMS.len(), "every kernel and head size disassembled");
    assert!(failures.is_empty(), "the machine code breaks its budgets:\n{}", failures.join("\n"));
}

/// The threads and the dynamic shared bytes of a block of each tensor-core kernel, as the launch
/// table launches it.
fn block_shapes() -> BTreeMap<String, (u32, u32)> {
    let mut threads = BTreeMap::new();
    for d in TENSOR_CORE_HEAD_DIMS {
        let a = Attn { batch: 1, seq: 128, kv_seq: 128, heads: 2, kv_heads: 1, head_dim: d };
        let f = forward(DType::Bf16, a, (0, 0, 0), (0, 0), 0, 0);
        let b = backward(DType::Bf16, a, (0, 0, 0), (0, 0), (0, 0, 0), 0, (0, 0, 0));
        for l in std::iter::once(&f).chain(&b) {
            threads.insert(l.kernel.name().to_string(), (l.block, l.shared));
        }
    }
    threads
}

/// Warps an H100 SM holds at once: registers are given a warp 256 at a time out of 64K, shared
/// memory 228 KiB with 1 KiB reserved a block; at most 64 warps and 32 blocks.
fn warps_per_sm(threads: u32, registers: u32, shared: u32) -> u32 {
    let warps = threads.div_ceil(32);
    let per_warp = (registers * 32).div_ceil(256) * 256;
    let by_registers = (65536 / per_warp.max(1)) / warps;
    let by_shared = (228 * 1024) / (shared + 1024);
    let blocks = by_registers.min(by_shared).min(64 / warps).min(32);
    blocks * warps
}

/// cuobjdump (with nvdisasm beside it or on the PATH): `$FERROTRON_SASS_TOOLS`, then the PATH.
fn sass_tools() -> Option<PathBuf> {
    let dirs = std::env::var_os("FERROTRON_SASS_TOOLS")
        .into_iter()
        .chain(std::env::var_os("PATH"))
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>());
    dirs.into_iter().find(|d| d.join("cuobjdump").is_file() && d.join("nvdisasm").is_file())
}

/// What cuobjdump says of every kernel of a cubin.
struct Report {
    kernels: BTreeMap<String, Kernel>,
}

#[derive(Default)]
struct Kernel {
    /// (address, instruction without its predicate's `@P0`)
    code: Vec<(u64, String)>,
    registers: u32,
    stack: u32,
    shared: u32,
}

/// The hot loop of a kernel, read from its instructions.
struct Loop {
    instructions: usize,
    hmma: usize,
    local_memory: usize,
    /// n of the loop's first DEPBAR.LE SB0, n
    first_wait: Option<u32>,
    /// a copy (LDGSTS) is issued before the loop's first wait
    copies_before_wait: bool,
    /// products (HMMA) follow the loop's last copy: they run while it flies
    hmma_after_copies: bool,
    events: String,
}

impl Report {
    fn read(tools: &Path, cubin: &Path) -> Report {
        let run = |flag: &str| {
            let path = std::env::join_paths(std::iter::once(tools.to_path_buf()).chain(
                std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect::<Vec<_>>()).unwrap_or_default(),
            ))
            .unwrap();
            let out = Command::new(tools.join("cuobjdump")).arg(flag).arg(cubin).env("PATH", path).output().unwrap();
            assert!(out.status.success(), "cuobjdump {flag}: {}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8(out.stdout).unwrap()
        };
        let mut kernels: BTreeMap<String, Kernel> = BTreeMap::new();
        // "        Function : NAME", then "        /*0a30*/   @!P0 HMMA.16816.F32.BF16 R4, R8, R12, R4 ;"
        let mut current = None;
        for line in run("-sass").lines() {
            if let Some(name) = line.split("Function : ").nth(1) {
                current = Some(name.trim().to_string());
                continue;
            }
            let (Some(name), Some(rest)) = (&current, line.trim().strip_prefix("/*")) else { continue };
            let Some((address, text)) = rest.split_once("*/") else { continue };
            // "INSTRUCTION ;   /* its encoding */"
            let (Ok(address), Some((text, _))) = (u64::from_str_radix(address, 16), text.split_once(';')) else {
                continue;
            };
            let text = text.trim();
            let text = if text.starts_with('@') { text.split_once(' ').map_or(text, |(_, t)| t) } else { text };
            kernels.entry(name.clone()).or_default().code.push((address, text.trim().to_string()));
        }
        // "Function NAME:" then " REG:168 STACK:8 SHARED:38656 LOCAL:0 ..."
        let mut current = None;
        for line in run("-res-usage").lines() {
            if let Some(rest) = line.trim().strip_prefix("Function ") {
                current = Some(rest.trim_end_matches(':').to_string());
            } else if let Some(k) = current.as_ref().and_then(|n| kernels.get_mut(n)) {
                let field = |key: &str| {
                    line.split_whitespace().find_map(|w| w.strip_prefix(key)).and_then(|v| v.parse().ok()).unwrap_or(0)
                };
                (k.registers, k.stack, k.shared) = (field("REG:"), field("STACK:"), field("SHARED:"));
            }
        }
        // the kernels made per head size (flash_attention_sum_parts has no products to read)
        let per_head_size = |name: &str| {
            name.rsplit('_').next().is_some_and(|d| d.strip_prefix('d').is_some_and(|n| n.parse::<u32>().is_ok()))
        };
        kernels.retain(|name, _| name.starts_with("flash_attention_") && per_head_size(name));
        Report { kernels }
    }
}

impl Kernel {
    /// The innermost loops (a backward branch and its target) with the most HMMA, shortest first:
    /// the hot loop, then any other that makes as many products (the forward's loop over the tiles
    /// across the diagonal, masked, is a second copy of its turn).
    fn hot_loops(&self) -> Vec<Loop> {
        let opcode = |t: &str| t.split_whitespace().next().unwrap_or("").to_string();
        let loops = self.code.iter().filter(|(_, t)| opcode(t) == "BRA").filter_map(|(at, t)| {
            let to = target(t)?;
            (to < *at).then_some((to, *at))
        });
        let body = |(from, to): (u64, u64)| -> Vec<&str> {
            let inside = self.code.iter().filter(|(a, t)| (from..=to).contains(a) && !t.starts_with("NOP"));
            inside.map(|(_, t)| t.as_str()).collect()
        };
        let mut loops: Vec<((u64, u64), Vec<&str>)> =
            loops.map(|l| (l, body(l))).filter(|(_, b)| hmma(b) > 0).collect();
        let most = loops.iter().map(|(_, b)| hmma(b)).max().unwrap_or(0);
        loops.retain(|(_, b)| hmma(b) == most);
        // an outer loop holds its inner loop's products (the backward's walk over key tiles)
        let inner =
            |&(from, to): &(u64, u64)| !loops.iter().any(|&((f, t), _)| (f, t) != (from, to) && from <= f && t <= to);
        let mut inner: Vec<&Vec<&str>> = loops.iter().filter(|(l, _)| inner(l)).map(|(_, b)| b).collect();
        inner.sort_by_key(|b| b.len());
        inner.into_iter().map(|b| Loop::read(b)).collect()
    }
}

fn hmma(body: &[&str]) -> usize {
    body.iter().filter(|t| t.starts_with("HMMA")).count()
}

/// A branch's target, or a wait's count: the instruction's last hexadecimal number.
fn target(t: &str) -> Option<u64> {
    let hex = t.split("0x").nth(1)?;
    u64::from_str_radix(hex.trim_end_matches(|c: char| !c.is_ascii_hexdigit()), 16).ok()
}

impl Loop {
    fn read(b: &[&str]) -> Loop {
        let position = |what: &str, nth: usize| b.iter().enumerate().filter(|(_, t)| t.starts_with(what)).nth(nth);
        let first_wait = position("DEPBAR.LE", 0);
        let first_copy = position("LDGSTS", 0).map(|(i, _)| i);
        let last_copy = b.iter().rposition(|t| t.starts_with("LDGSTS"));
        Loop {
            instructions: b.len(),
            hmma: hmma(b),
            local_memory: b.iter().filter(|t| t.starts_with("LDL") || t.starts_with("STL")).count(),
            first_wait: first_wait.and_then(|(_, t)| target(t).map(|n| n as u32)),
            copies_before_wait: matches!((first_copy, first_wait), (Some(c), Some((w, _))) if c < w),
            hmma_after_copies: last_copy.is_some_and(|c| b[c..].iter().any(|t| t.starts_with("HMMA"))),
            events: events(b),
        }
    }
}

/// The loop's copies, products, exponentials, waits and barriers in order, runs counted.
fn events(body: &[&str]) -> String {
    let mut out: Vec<(String, usize)> = Vec::new();
    for t in body {
        let event = match t.split_whitespace().next().unwrap_or("") {
            op if op.starts_with("LDGSTS") => "cp".to_string(),
            op if op.starts_with("HMMA") => "H".to_string(),
            op if op.starts_with("MUFU.EX2") => "E".to_string(),
            op if op.starts_with("DEPBAR.LE") => format!("W{}", t.rsplit("0x").next().unwrap_or("?")),
            op if op.starts_with("BAR.SYNC") => "B".to_string(),
            _ => continue,
        };
        match out.last_mut() {
            Some((last, n)) if *last == event && !event.starts_with('W') && event != "B" => *n += 1,
            _ => out.push((event, 1)),
        }
    }
    out.iter().map(|(e, n)| if *n > 1 { format!("{e}{n}") } else { e.clone() }).collect::<Vec<_>>().join(" ")
}
