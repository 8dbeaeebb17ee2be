//! The CUDA kernels, run on the CPU: every `kernels/*.cu` file is compiled as C++ with a small
//! CUDA emulator (`tests/emulator/cuda_bf16.h`: a fiber per CUDA thread, barriers for
//! `__syncthreads`, `__syncwarp` and warp shuffles), and the launches of `src/cuda/launch_table.rs` (kernel names, grids,
//! argument lists) run on host memory against the CPU reference of the op layer, in f32 and bf16.
//! So a kernel's indexing, masking and reductions, and every launch's argument order, are checked
//! on machines without a GPU. Needs g++ (C++20); skipped with a printed reason when g++ is missing
//! or cannot build the emulator, unless FERROTRON_REQUIRE_EMULATOR=1 (as in CI). The emulator's
//! grid and shared memory are process-wide: the launches run one at a time, from this one test.

use ferrotron::cuda::launch_table::{self, Addr, Arg, Launch};
use ferrotron::ops::ring_merge::attention_merge;
use ferrotron::ops::tensor::{Place, Tensor};
use ferrotron::ops::DType;
use ferrotron::ops::{self, AdamWSettings, Attn, Rope};
use half::bf16;
use std::ffi::{c_char, c_void, CString};
use std::io::Write;

#[path = "common/emulator.rs"]
mod emulator;

type LaunchFn = unsafe extern "C" fn(*const c_char, u32, u32, u32, u32, u32, *const *mut c_void) -> i32;

/// The compiled kernels and the emulator's entry point.
struct Emulator {
    launch: LaunchFn,
}

impl Emulator {
    fn build() -> Result<Emulator, String> {
        let lib = emulator::build("kernel_emulator", "libkernels.so", &[])?;
        let path = CString::new(lib.to_str().unwrap()).unwrap();
        // SAFETY: a library we just built; dlsym's result is checked and has the glue's signature.
        unsafe {
            let handle = libc::dlopen(path.as_ptr(), libc::RTLD_NOW);
            assert!(!handle.is_null(), "dlopen {}", lib.display());
            let f = libc::dlsym(handle, c"emu_launch".as_ptr());
            assert!(!f.is_null(), "no emu_launch");
            Ok(Emulator { launch: std::mem::transmute::<*mut c_void, LaunchFn>(f) })
        }
    }

    /// Runs one launch; its addresses point at host buffers.
    fn run(&self, l: &Launch) {
        // an 8-aligned slot of each argument's size (the largest: a multi-tensor AdamW list)
        let mut slots: Vec<Vec<u64>> = l.args.iter().map(|a| vec![0; arg_size(a).div_ceil(8)]).collect();
        for (slot, arg) in slots.iter_mut().zip(&l.args) {
            let p = slot.as_mut_ptr() as *mut u8;
            // SAFETY: each value fits its slot, sized and aligned for it.
            unsafe {
                match arg {
                    Arg::Ptr(a) => std::ptr::write(p as *mut u64, *a),
                    Arg::I32(v) => std::ptr::write(p as *mut i32, *v),
                    Arg::I64(v) => std::ptr::write(p as *mut i64, *v),
                    Arg::F32(v) => std::ptr::write(p as *mut f32, *v),
                    Arg::F64(v) => std::ptr::write(p as *mut f64, *v),
                    Arg::Shape(s) => std::ptr::write(p as *mut launch_table::Shape, *s),
                    Arg::Tensors(list) => std::ptr::write(p as *mut launch_table::TensorList, **list),
                    Arg::AdamW(list) => std::ptr::write(p as *mut launch_table::AdamWList, **list),
                }
            }
        }
        let ptrs: Vec<*mut c_void> = slots.iter_mut().map(|s| s.as_mut_ptr() as *mut c_void).collect();
        let name = CString::new(l.kernel.name()).unwrap();
        let (x, y, z) = l.grid;
        // SAFETY: the glue calls the kernel with these argument slots, typed as the launch says.
        let rc = unsafe { (self.launch)(name.as_ptr(), x, y, z, l.block, l.shared, ptrs.as_ptr()) };
        assert_eq!(rc, 0, "the emulator has no kernel {}", l.kernel.name());
    }
}

/// The bytes a kernel argument takes.
fn arg_size(a: &Arg) -> usize {
    match a {
        Arg::Shape(_) => size_of::<launch_table::Shape>(),
        Arg::Tensors(_) => size_of::<launch_table::TensorList>(),
        Arg::AdamW(_) => size_of::<launch_table::AdamWList>(),
        _ => 8,
    }
}

/// A host buffer the emulated kernels read and write, in f32 or bf16.
enum Buf {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

impl Buf {
    fn new(data: &[f32], dt: DType) -> Buf {
        match dt {
            DType::F32 => Buf::F32(data.to_vec()),
            DType::Bf16 => Buf::Bf16(data.iter().map(|&v| bf16::from_f32(v).to_bits()).collect()),
        }
    }
    fn zeros(n: usize, dt: DType) -> Buf {
        Buf::new(&vec![0.0; n], dt)
    }
    /// NaN everywhere: an output element a kernel forgets to write fails the comparison.
    fn poisoned(n: usize, dt: DType) -> Buf {
        Buf::new(&vec![f32::NAN; n], dt)
    }
    fn addr(&mut self) -> Addr {
        match self {
            Buf::F32(v) => v.as_mut_ptr() as Addr,
            Buf::Bf16(v) => v.as_mut_ptr() as Addr,
        }
    }
    fn values(&self) -> Vec<f32> {
        match self {
            Buf::F32(v) => v.clone(),
            Buf::Bf16(v) => v.iter().map(|&b| bf16::from_bits(b).to_f32()).collect(),
        }
    }
}

struct Check {
    emu: Emulator,
    dt: DType,
    seed: u64,
    checked: usize,
}

impl Check {
    /// Fresh N(0, 1) numbers, representable in the dtype (so CPU and kernel see the same inputs).
    fn rand(&mut self, shape: &[usize]) -> Tensor {
        self.seed += 1;
        let t = ferrotron::model::init::normal(self.seed, "emulated kernels", shape, 1.0).to_vec();
        Tensor::from_vec(shape, t.into_iter().map(|v| self.round(v)).collect())
    }
    fn round(&self, v: f32) -> f32 {
        if self.dt == DType::Bf16 {
            bf16::from_f32(v).to_f32()
        } else {
            v
        }
    }
    /// A buffer in the compute dtype, and one in f32 (statistics, gradients).
    fn buf(&self, t: &Tensor) -> Buf {
        Buf::new(&t.to_vec(), self.dt)
    }
    fn f32(&self, t: &Tensor) -> Buf {
        Buf::new(&t.to_vec(), DType::F32)
    }
    fn run(&self, l: &Launch) {
        self.emu.run(l);
    }
    fn same(&mut self, what: &str, got: &Buf, want: &Tensor) {
        let (got, want) = (got.values(), want.to_vec());
        assert_eq!(got.len(), want.len(), "{what}: sizes");
        let scale = want.iter().filter(|v| v.is_finite()).fold(1e-6f32, |m, v| m.max(v.abs()));
        let tol = if self.dt == DType::F32 { 2e-5 } else { 2e-2 };
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let ok = if w.is_finite() { (g - w).abs() <= tol * scale } else { g == w };
            assert!(ok, "{:?} {what}: element {i} is {g}, the CPU reference {w} (largest {scale})", self.dt);
        }
        self.checked += 1;
    }
    /// The same bits: two launches that must compute alike.
    fn identical(&mut self, what: &str, got: &Buf, want: &Buf) {
        let bits = |b: &Buf| b.values().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let (got, want) = (bits(got), bits(want));
        let first = got.iter().zip(&want).position(|(g, w)| g != w);
        assert!(first.is_none(), "{:?} {what}: element {} differs in its bits", self.dt, first.unwrap_or(0));
        self.checked += 1;
    }
}

fn emulator() -> Option<Emulator> {
    match Emulator::build() {
        Ok(e) => Some(e),
        Err(why) if std::env::var("FERROTRON_REQUIRE_EMULATOR").is_err() => {
            eprintln!("skipped: {why}");
            None
        }
        Err(why) => panic!("{why}"),
    }
}

#[test]
#[cfg_attr(ferrotron_no_gxx, ignore = "needs g++ (C++20) for the CPU emulator; .ci/run installs it")]
fn kernels_match_the_cpu_reference_on_the_emulator() {
    // The emulator stops a kernel whose threads wait at barriers the others never reach; one
    // that loops forever would hang the suite: stop it with a sentence instead.
    std::thread::spawn(|| {
        std::thread::sleep(std::time::Duration::from_secs(600));
        let why = "the emulated kernels took over 10 minutes: a kernel never finishes";
        let _ = writeln!(std::io::stderr(), "{why}"); // not eprintln!: the test harness would swallow it
        std::process::exit(1);
    });
    let Some(emu) = emulator() else { return };
    let mut checked = 0;
    for dt in [DType::F32, DType::Bf16] {
        let mut c = Check { emu: Emulator { launch: emu.launch }, dt, seed: 0, checked: 0 };
        for (rows, dim, vocab) in [(3, 40, 21), (5, 64, 300)] {
            rowwise(&mut c, rows, dim);
            cross_entropy(&mut c, rows, vocab);
            embedding(&mut c, rows, dim, vocab);
        }
        rowwise(&mut c, 130, 24); // RMSNorm's dw over three chunks of rows, the last one short
        let a = Attn { batch: 2, seq: 37, kv_seq: 37, heads: 4, kv_heads: 2, head_dim: 16 };
        let pos: Vec<u32> = (0..37).collect();
        attention(&mut c, a, (&pos, &pos));
        rope(&mut c, a);
        // a ring block whose first queries see no key (out 0, lse −∞)
        let ring = Attn { batch: 1, seq: 20, kv_seq: 33, heads: 2, kv_heads: 1, head_dim: 8 };
        let (q_pos, k_pos): (Vec<u32>, Vec<u32>) = ((0..20).collect(), (10..43).collect());
        attention(&mut c, ring, (&q_pos, &k_pos));
        merge(&mut c, ring);
        // in bf16 these run on tensor cores (flash_attention.cu): lengths that are not multiples
        // of a tile, several tiles, tiles skipped by causal order (contiguous, and zigzag's two
        // chunks), keys out of position order, every head size, GQA ratios 1, 2, 3 and 8, ring
        // blocks (queries that see no key, keys after every query), outputs poisoned with NaN
        // beforehand
        // (the forward's key tiles: 128 rows up to head size 64, 64 at 128; the backward's 64 and 32)
        let long = Attn { batch: 1, seq: 300, kv_seq: 300, heads: 2, kv_heads: 1, head_dim: 64 };
        let pos: Vec<u32> = (0..300).collect();
        attention(&mut c, long, (&pos, &pos));
        let zigzag = Attn { batch: 1, seq: 128, kv_seq: 128, heads: 2, kv_heads: 2, head_dim: 128 };
        let pos: Vec<u32> = (0..64).chain(192..256).collect();
        attention(&mut c, zigzag, (&pos, &pos));
        let zigzag = Attn { batch: 1, seq: 256, kv_seq: 256, heads: 1, kv_heads: 1, head_dim: 32 };
        let pos: Vec<u32> = (0..128).chain(384..512).collect();
        attention(&mut c, zigzag, (&pos, &pos));
        // keys out of position order: the first key tile (positions 128..256) lies across the
        // diagonal of both query blocks (128..256), the second (0..128) is clear, so the forward
        // walks the second first and turns back to the first (next_key_tile)
        let shuffled = Attn { batch: 1, seq: 128, kv_seq: 256, heads: 2, kv_heads: 1, head_dim: 64 };
        let (late, shuffled_keys): (Vec<u32>, Vec<u32>) = ((128..256).collect(), (128..256).chain(0..128).collect());
        attention(&mut c, shuffled, (&late, &shuffled_keys));
        // consecutive keys (the forward's range, made once a block) at its edges: a block of
        // queries 193..257, whose last sees only the first key of the third tile (256..384), and
        // one of 254..318, whose first is one key short of the second tile (128..256), so that
        // tile is across
        let edge = Attn { batch: 1, seq: 128, kv_seq: 384, heads: 2, kv_heads: 1, head_dim: 64 };
        let (edge_q, edge_k): (Vec<u32>, Vec<u32>) = ((193..257).chain(254..318).collect(), (0..384).collect());
        attention(&mut c, edge, (&edge_q, &edge_k));
        // and the backward's (consecutive queries): queries 1..129 against keys 0..128, so that
        // the second key tile (64..128) is first seen by the last query of the first query tile
        let shifted = Attn { batch: 1, seq: 128, kv_seq: 128, heads: 2, kv_heads: 2, head_dim: 64 };
        let (shifted_q, shifted_k): (Vec<u32>, Vec<u32>) = ((1..129).collect(), (0..128).collect());
        attention(&mut c, shifted, (&shifted_q, &shifted_k));
        attention(&mut c, Attn { head_dim: 32, ..ring }, (&q_pos, &k_pos));
        let gqa3 = Attn { batch: 2, seq: 75, kv_seq: 75, heads: 6, kv_heads: 2, head_dim: 64 };
        let pos: Vec<u32> = (0..75).collect();
        attention(&mut c, gqa3, (&pos, &pos));
        // a ring step of 8:1 GQA: 50 queries at 60..110 against 90 keys at 0..90 (the first tiles
        // seen by every query, the last by some) and a later block no query sees
        let gqa8 = Attn { batch: 1, seq: 50, kv_seq: 90, heads: 8, kv_heads: 1, head_dim: 32 };
        let (q_pos, k_pos): (Vec<u32>, Vec<u32>) = ((60..110).collect(), (0..90).collect());
        attention(&mut c, gqa8, (&q_pos, &k_pos));
        let late: Vec<u32> = (200..290).collect();
        attention(&mut c, Attn { head_dim: 128, heads: 2, ..gqa8 }, (&q_pos, &late));
        // heads past 128 (attention.cu's wide form, tiles of 8 rows, in bf16 too): latent
        // attention's 192 on a ring step (a last tile of one key, queries that see no key), and
        // generate's absorbed 576, one KV head, three new queries against the cache
        let wide = Attn { batch: 1, seq: 20, kv_seq: 33, heads: 2, kv_heads: 1, head_dim: 192 };
        let (q_pos, k_pos): (Vec<u32>, Vec<u32>) = ((10..30).collect(), (0..33).collect());
        attention(&mut c, wide, (&q_pos, &k_pos));
        let absorbed = Attn { batch: 2, seq: 3, kv_seq: 21, heads: 2, kv_heads: 1, head_dim: 576 };
        let (q_pos, k_pos): (Vec<u32>, Vec<u32>) = ((18..21).collect(), (0..21).collect());
        attention(&mut c, absorbed, (&q_pos, &k_pos));
        moe(&mut c, (13, 8, 2), 40);
        moe(&mut c, (5, 3, 3), 300); // every expert chosen, rows over one block of threads
        adamw(&mut c, 300, DType::F32);
        if c.dt == DType::Bf16 {
            adamw(&mut c, 300, DType::Bf16); // bf16 moments (train.optimizer_dtype), with mixed precision
        }
        checked += c.checked;
    }
    eprintln!("{checked} kernel outputs match the CPU reference");
    // the wide heads: 5 checks each in f32, 10 in bf16 (by range and by scan)
    assert_eq!(checked, 201 + 2 * 2 * 8 + 2 * 7 * 5 + 10 * 5 + 2 * 5 + 2 * 10, "every check ran");
}

fn rowwise(c: &mut Check, rows: usize, dim: usize) {
    let dt = c.dt;
    // RMSNorm forward and backward
    let (x, w, dy, dw) = (c.rand(&[rows, dim]), c.rand(&[dim]), c.rand(&[rows, dim]), c.rand(&[dim]));
    let (y, rstd) = ops::rmsnorm(&x, &w, 1e-5);
    let (mut bx, mut bw, mut by, mut brstd) =
        (c.buf(&x), c.buf(&w), Buf::zeros(rows * dim, dt), Buf::zeros(rows, DType::F32));
    c.run(&launch_table::rmsnorm(dt, bx.addr(), bw.addr(), 1e-5, (rows, dim), by.addr(), brstd.addr()));
    c.same("rmsnorm", &by, &y);
    c.same("rmsnorm 1/rms", &brstd, &rstd);
    let mut want_dw = dw.clone();
    // with the gradient that passed the norm by added to dx (a block's residual)
    let residual = c.rand(&[rows, dim]);
    let dx = ops::rmsnorm_backward(&dy, &x, &w, &rstd, &mut want_dw, Some(&residual));
    let (mut bdy, mut bdx, mut bdw, mut brstd) = (c.buf(&dy), Buf::zeros(rows * dim, dt), c.f32(&dw), c.f32(&rstd));
    let (mut partial, mut bres) =
        (Buf::zeros(launch_table::rmsnorm_partial_len((rows, dim)), DType::F32), c.buf(&residual));
    let inputs = (bdy.addr(), bx.addr(), bw.addr(), brstd.addr());
    let outputs = (bdx.addr(), bres.addr());
    for l in launch_table::rmsnorm_backward(dt, inputs, (rows, dim), outputs, (bdw.addr(), partial.addr())) {
        c.run(&l);
    }
    c.same("rmsnorm backward dx + residual", &bdx, &dx);
    c.same("rmsnorm backward dw (+=)", &bdw, &want_dw);
    // the residual add fused into the norm after it: x += add, then RMSNorm(x)
    let (mut h, add) = (c.rand(&[rows, dim]), c.rand(&[rows, dim]));
    let (mut bh, mut badd, mut by, mut brstd) =
        (c.buf(&h), c.buf(&add), Buf::zeros(rows * dim, dt), Buf::zeros(rows, DType::F32));
    c.run(&launch_table::add_rmsnorm(
        dt,
        (bh.addr(), badd.addr()),
        bw.addr(),
        1e-5,
        (rows, dim),
        (by.addr(), brstd.addr()),
    ));
    let (y, rstd) = ops::add_rmsnorm(&mut h, &add, &w, 1e-5);
    c.same("add, then rmsnorm: the sum", &bh, &h);
    c.same("add, then rmsnorm", &by, &y);
    c.same("add, then rmsnorm 1/rms", &brstd, &rstd);
    // SwiGLU forward and backward
    let n = rows * dim;
    let (g, u, dh) = (c.rand(&[n]), c.rand(&[n]), c.rand(&[n]));
    let (mut bg, mut bu, mut bh, mut bdh) = (c.buf(&g), c.buf(&u), Buf::zeros(n, dt), c.buf(&dh));
    c.run(&launch_table::swiglu(dt, (bg.addr(), bu.addr()), bh.addr(), n));
    c.same("swiglu", &bh, &ops::swiglu(&g, &u));
    let (dg, du) = ops::swiglu_backward(&dh, &g, &u);
    let (mut bdg, mut bdu) = (Buf::zeros(n, dt), Buf::zeros(n, dt));
    c.run(&launch_table::swiglu_backward(dt, (bdh.addr(), bg.addr(), bu.addr()), (bdg.addr(), bdu.addr()), n));
    c.same("swiglu backward dgate", &bdg, &dg);
    c.same("swiglu backward dup", &bdu, &du);
    // add, scale, and (f32) the sum of squares and the casts
    let (mut a, b) = (c.rand(&[n]), c.rand(&[n]));
    let (mut ba, mut bb) = (c.buf(&a), c.buf(&b));
    c.run(&launch_table::add_assign(dt, ba.addr(), bb.addr(), n));
    c.run(&launch_table::scale(dt, ba.addr(), 0.75, n));
    ops::add_assign(&mut a, &b);
    ops::scale(&mut a, 0.75);
    c.same("add and scale", &ba, &a);
    // the gradient norm's sums and the zeroing, multi-tensor: an empty tensor, one of several
    // chunks, and more tensors than one launch takes
    let sizes: Vec<usize> =
        [n, 0, launch_table::LIST_CHUNK + 7].into_iter().chain((0..70).map(|i| 1 + i % 5)).collect();
    let grads: Vec<Tensor> = sizes.iter().map(|&k| c.rand(&[k])).collect();
    let mut bgrads: Vec<Buf> = grads.iter().map(|t| c.f32(t)).collect();
    let xs: Vec<(u64, usize)> = bgrads.iter_mut().zip(&sizes).map(|(b, &k)| (b.addr(), k)).collect();
    let mut partial = Buf::poisoned(launch_table::partial_sums(sizes.iter().copied()), DType::F32);
    let (launches, at) = (launch_table::sum_squares(&xs, partial.addr()), partial.addr());
    assert_eq!(launches.len(), 2, "{} tensors in launches of {}", sizes.len(), launch_table::LIST_TENSORS);
    launches.iter().for_each(|l| c.run(l));
    let mut total = Buf::zeros(1, DType::F32);
    c.run(&launch_table::sum_rows(at, (1, partial.values().len()), total.addr()));
    let refs: Vec<&Tensor> = grads.iter().collect();
    c.same("sum of squares", &total, &ops::sum_squares_total(&refs, &Place::Cpu));
    launch_table::fill_zeros(&xs).iter().for_each(|l| c.run(l));
    assert!(bgrads.iter().all(|b| b.values().iter().all(|&v| v == 0.0)), "zeroed");
    let (mut f, mut h) = (c.f32(&a), Buf::zeros(n, DType::Bf16));
    c.run(&launch_table::cast_f32_to_bf16(f.addr(), h.addr(), n));
    let mut back = Buf::zeros(n, DType::F32);
    c.run(&launch_table::cast_bf16_to_f32(h.addr(), back.addr(), n));
    let rounded = Tensor::from_vec(&[n], a.to_vec().iter().map(|&v| bf16::from_f32(v).to_f32()).collect());
    let exact = std::mem::replace(&mut c.dt, DType::F32); // the round trip is exact: compare as f32
    c.same("casts f32 → bf16 → f32", &back, &rounded);
    c.dt = exact;
}

fn cross_entropy(c: &mut Check, rows: usize, vocab: usize) {
    let dt = c.dt;
    let logits = c.rand(&[rows, vocab]);
    let targets: Vec<i32> = (0..rows).map(|i| if i % 4 == 3 { -1 } else { ((i * 13) % (vocab + 9)) as i32 }).collect();
    let (max, sum) = (ops::row_max(&logits), ops::row_sum_exp(&logits, &ops::row_max(&logits)));
    let lse = ops::log_sum_exp(&max, &sum);
    let mut bl = c.buf(&logits);
    let stat = || Buf::zeros(rows, DType::F32);
    let (mut bmax, mut bsum, mut blse, mut bz) = (stat(), stat(), stat(), stat());
    c.run(&launch_table::row_max(dt, bl.addr(), (rows, vocab), bmax.addr()));
    c.same("row max", &bmax, &max);
    c.run(&launch_table::row_sum_exp(dt, bl.addr(), (rows, vocab), bmax.addr(), bsum.addr()));
    c.same("row sum of exponentials", &bsum, &sum);
    c.run(&launch_table::log_sum_exp(bmax.addr(), bsum.addr(), blse.addr(), rows));
    c.same("log-sum-exp", &blse, &lse);
    let mut bt: Vec<u32> = targets.iter().map(|&t| t as u32).collect();
    let t = bt.as_mut_ptr() as Addr;
    c.run(&launch_table::target_logit(dt, bl.addr(), (rows, vocab), t, 5, bz.addr()));
    c.same("target logits (slice from 5)", &bz, &ops::target_logits(&logits, &targets, 5));
    let mut bd = Buf::zeros(rows * vocab, dt);
    c.run(&launch_table::cross_entropy_backward(dt, (bl.addr(), t), 5, (blse.addr(), 0.25), (rows, vocab), bd.addr()));
    c.same("cross-entropy backward", &bd, &ops::cross_entropy_backward(&logits, &targets, 5, &lse, 0.25));
}

fn embedding(c: &mut Check, rows: usize, dim: usize, vocab: usize) {
    let dt = c.dt;
    let (table, dout, dtable) = (c.rand(&[vocab, dim]), c.rand(&[rows, dim]), c.rand(&[vocab, dim]));
    let mut tokens: Vec<u32> = (0..rows).map(|i| ((i * 7) % (vocab + 5)) as u32).collect(); // repeats, and ids past the slice
    let ids = tokens.as_mut_ptr() as Addr;
    let (mut bt, mut out) = (c.buf(&table), Buf::zeros(rows * dim, dt));
    c.run(&launch_table::embedding(dt, (bt.addr(), vocab), (ids, rows), 3, dim, out.addr()));
    c.same("embedding (slice from 3)", &out, &ops::embedding(&table, &tokens, 3));
    let (mut bdout, mut bdtable) = (c.buf(&dout), c.f32(&dtable));
    let mut grouped = launch_table::tokens_by_id(&tokens, 3, vocab);
    let at = (grouped.packed.as_mut_ptr() as Addr, grouped.distinct);
    c.run(&launch_table::embedding_backward(dt, bdout.addr(), at, dim, bdtable.addr()));
    let mut want = dtable.clone();
    ops::embedding_backward(&dout, &tokens, 3, &mut want);
    c.same("embedding backward (+=)", &bdtable, &want);
}

fn rope(c: &mut Check, a: Attn) {
    // plain RoPE, and frequencies and a scale as a longer context's (YaRN's) are
    let mut scaled = Rope::plain(10000.0, a.head_dim);
    scaled.inv_freq.iter_mut().enumerate().for_each(|(i, f)| *f /= 1.0 + i as f64);
    scaled.scale = 1.3;
    for rope in [Rope::plain(10000.0, a.head_dim), scaled] {
        let dt = c.dt;
        let n = a.batch * a.seq;
        let mut positions: Vec<u32> = (0..n).map(|r| (r % a.seq) as u32 * 97).collect();
        let mut x = c.rand(&[n, a.heads * a.head_dim]);
        let mut bx = c.buf(&x);
        let pos = positions.as_mut_ptr() as Addr;
        let half = a.head_dim / 2;
        let (mut cos, mut sin) = (Buf::zeros(n * half, DType::F32), Buf::zeros(n * half, DType::F32));
        let table = (cos.addr(), sin.addr());
        let mut inv_freq = rope.inv_freq.clone();
        c.run(&launch_table::rope_table(pos, (n, half), (inv_freq.as_mut_ptr() as Addr, rope.scale), table));
        c.run(&launch_table::rope(dt, bx.addr(), table, (n, a.heads, a.head_dim), false));
        ops::rope(&mut x, &positions, &rope);
        c.same("rope", &bx, &x);
        c.run(&launch_table::rope(dt, bx.addr(), table, (n, a.heads, a.head_dim), true));
        ops::rope_backward(&mut x, &positions, &rope);
        c.same("rope backward", &bx, &x);
    }
}

fn attention(c: &mut Check, a: Attn, pos: (&[u32], &[u32])) {
    let dt = c.dt;
    let q = c.rand(&[a.batch * a.seq, a.heads * a.head_dim]);
    let (k, v) = (
        c.rand(&[a.batch * a.kv_seq, a.kv_heads * a.head_dim]),
        c.rand(&[a.batch * a.kv_seq, a.kv_heads * a.head_dim]),
    );
    let (out, lse) = ops::attention(a, &q, &k, &v, pos);
    let (mut qp, mut kp) = (pos.0.to_vec(), pos.1.to_vec());
    let positions = (qp.as_mut_ptr() as Addr, kp.as_mut_ptr() as Addr);
    let (mut bq, mut bk, mut bv) = (c.buf(&q), c.buf(&k), c.buf(&v));
    let (mut bout, mut blse) = (Buf::poisoned(out.numel(), dt), Buf::poisoned(lse.numel(), DType::F32));
    let qkv = (bq.addr(), bk.addr(), bv.addr());
    c.run(&launch_table::attention::forward(dt, a, qkv, positions, bout.addr(), blse.addr()));
    let what = format!("attention q{} k{} h{}/{} d{}", a.seq, a.kv_seq, a.heads, a.kv_heads, a.head_dim);
    c.same(&what, &bout, &out);
    c.same(&format!("{what} lse"), &blse, &lse);
    // Consecutive positions (keys in the tensor-core forward, queries in its backward) make each
    // walk a range, found once a block; others are scanned. The same rows at doubled positions
    // (each key still seen by the same queries, the tiles in the same order, but with gaps) go by
    // the scan, and must give the same bits.
    let consecutive = |p: &[u32]| p.windows(2).all(|w| w[1] == w[0] + 1);
    let both_ways = dt == DType::Bf16 && (consecutive(pos.0) || consecutive(pos.1));
    let (mut q2, mut k2): (Vec<u32>, Vec<u32>) =
        (qp.iter().map(|p| 2 * p).collect(), kp.iter().map(|p| 2 * p).collect());
    let gaps = (q2.as_mut_ptr() as Addr, k2.as_mut_ptr() as Addr);
    if both_ways {
        let (mut sout, mut slse) = (Buf::poisoned(out.numel(), dt), Buf::poisoned(lse.numel(), DType::F32));
        c.run(&launch_table::attention::forward(dt, a, qkv, gaps, sout.addr(), slse.addr()));
        c.identical(&format!("{what}, by its range and by its scan"), &bout, &sout);
        c.identical(&format!("{what} lse, by its range and by its scan"), &blse, &slse);
    }
    // backward from the reference forward, rounded to the compute dtype
    let out = Tensor::from_vec(out.shape(), out.to_vec().into_iter().map(|v| c.round(v)).collect());
    let dout = c.rand(out.shape());
    let (dq, dk, dv) = ops::attention_backward(a, (&q, &k, &v), pos, (&out, &lse), &dout);
    let scratch = launch_table::attention::backward_scratch(dt, a);
    let (mut bout, mut blse, mut bdout, mut scratch) =
        (c.buf(&out), c.f32(&lse), c.buf(&dout), Buf::poisoned(scratch, DType::F32));
    let (mut bdq, mut bdk, mut bdv) =
        (Buf::poisoned(dq.numel(), dt), Buf::poisoned(dk.numel(), dt), Buf::poisoned(dv.numel(), dt));
    let saved = (bout.addr(), blse.addr(), bdout.addr());
    let grads = (bdq.addr(), bdk.addr(), bdv.addr());
    for l in launch_table::attention::backward(dt, a, qkv, positions, saved, scratch.addr(), grads) {
        c.run(&l);
    }
    c.same(&format!("{what} dq"), &bdq, &dq);
    c.same(&format!("{what} dk"), &bdk, &dk);
    c.same(&format!("{what} dv"), &bdv, &dv);
    if both_ways {
        let mut scanned = [&dq, &dk, &dv].map(|t| Buf::poisoned(t.numel(), dt));
        let grads = (scanned[0].addr(), scanned[1].addr(), scanned[2].addr());
        for l in launch_table::attention::backward(dt, a, qkv, gaps, saved, scratch.addr(), grads) {
            c.run(&l);
        }
        for ((name, got), want) in ["dq", "dk", "dv"].iter().zip(&scanned).zip([&bdq, &bdk, &bdv]) {
            c.identical(&format!("{what} {name}, by its range and by its scan"), want, got);
        }
    }
}

fn merge(c: &mut Check, a: Attn) {
    let dt = c.dt;
    let shape = [a.batch * a.seq, a.heads * a.head_dim];
    let (mut out, block_out) = (c.rand(&shape), c.rand(&shape));
    let lse_shape = [a.batch, a.heads, a.seq];
    let mut l = c.rand(&lse_shape).to_vec();
    let mut bl = c.rand(&lse_shape).to_vec();
    l.iter_mut().step_by(5).for_each(|x| *x = f32::NEG_INFINITY);
    bl.iter_mut().step_by(7).for_each(|x| *x = f32::NEG_INFINITY);
    let (mut lse, block_lse) = (Tensor::from_vec(&lse_shape, l), Tensor::from_vec(&lse_shape, bl));
    let (mut bout, mut blse, mut bbo, mut bbl) = (c.buf(&out), c.f32(&lse), c.buf(&block_out), c.f32(&block_lse));
    c.run(&launch_table::attention::merge(dt, a, (bout.addr(), blse.addr()), (bbo.addr(), bbl.addr())));
    attention_merge(a, (&mut out, &mut lse), &block_out, &block_lse);
    c.same("attention merge", &bout, &out);
    c.same("attention merge lse", &blse, &lse);
}

fn adamw(c: &mut Check, n: usize, moments: DType) {
    // three parameters in one launch: one of several chunks, a norm (no decay), a lone number
    let (lr, beta1, beta2, eps) = (1e-2, 0.9, 0.95, 1e-8);
    let o = AdamWSettings { lr, beta1, beta2, eps, weight_decay: 0.1, step: 3, grad_scale: 0.5, moments };
    let params = [(n, o), (launch_table::LIST_CHUNK + 9, AdamWSettings { weight_decay: 0.0, ..o }), (1, o)];
    let mixed = c.dt == DType::Bf16;
    let mut host = Vec::new(); // (p, g, m, v) on the CPU, and their buffers (p, g, m, v, copy)
    for (k, _) in params {
        let (p, g, m) = (c.rand(&[k]), c.rand(&[k]), c.rand(&[k]));
        let v = Tensor::from_vec(&[k], c.rand(&[k]).to_vec().iter().map(|x| c.round(x * x)).collect());
        let bufs = [
            c.f32(&p),
            c.f32(&g),
            Buf::new(&m.to_vec(), moments),
            Buf::new(&v.to_vec(), moments),
            Buf::zeros(k, DType::Bf16),
        ];
        host.push(([p, g, m, v], bufs));
    }
    let steps: Vec<_> = host
        .iter_mut()
        .zip(params)
        .map(|((_, [bp, bg, bm, bv, copy]), (k, o))| {
            (o, (bp.addr(), bg.addr(), bm.addr(), bv.addr()), mixed.then(|| copy.addr()), k)
        })
        .collect();
    let launches = launch_table::adamw(&steps);
    assert_eq!(launches.len(), 1, "one launch for parameters that differ only in weight decay");
    c.run(&launches[0]);
    for (([mut p, g, mut m, mut v], [bp, _, bm, bv, copy]), (_, o)) in host.into_iter().zip(params) {
        ops::adamw(&mut [(o, &mut p, &g, &mut m, &mut v)]);
        let exact = std::mem::replace(&mut c.dt, DType::F32); // AdamW computes in f32 in every mode
        c.same("adamw weight", &bp, &p);
        c.dt = moments; // the moments as they are kept
        c.same("adamw first moment", &bm, &m);
        c.same("adamw second moment", &bv, &v);
        c.dt = exact;
        if mixed {
            let rounded = Tensor::from_vec(p.shape(), p.to_vec().iter().map(|&x| bf16::from_f32(x).to_f32()).collect());
            c.same("adamw bf16 compute copy", &copy, &rounded);
        }
    }
}

/// The routing of a mixture of experts (`kernels/moe.cu`): top-k, its backward (with a balance
/// term), the rows sorted by expert, their weighted sum back, and that sum's backward.
fn moe(c: &mut Check, (rows, experts, k): (usize, usize, usize), dim: usize) {
    let dt = c.dt;
    let logits = c.rand(&[rows, experts]);
    let want = ferrotron::ops::moe::route(&logits, k);
    let mut bl = c.buf(&logits);
    let (mut probs, mut weights, mut ids) =
        (Buf::zeros(rows * experts, DType::F32), Buf::zeros(rows * k, DType::F32), Buf::zeros(rows * k, DType::F32));
    let outs = (probs.addr(), weights.addr(), ids.addr());
    c.run(&launch_table::moe::route(dt, bl.addr(), (rows, experts, k), outs));
    let got_ids: Vec<u32> = ids.values().iter().map(|&i| i as u32).collect();
    // the inputs are the same numbers in both: the same experts, unless two are within rounding
    assert_eq!(got_ids, want.experts, "{dt:?} route: the chosen experts");
    c.same("route probabilities", &probs, &want.probs);
    c.same("route weights", &weights, &want.weights);
    let (dweights, balance) = (c.rand(&[rows, k]), c.rand(&[experts]));
    let mut bdw = c.f32(&dweights);
    let mut bbalance = c.f32(&balance);
    let mut dlogits = Buf::zeros(rows * experts, dt);
    let inputs = (bdw.addr(), probs.addr(), weights.addr(), ids.addr());
    c.run(&launch_table::moe::route_backward(dt, inputs, bbalance.addr(), (rows, experts, k), dlogits.addr()));
    c.same(
        "route backward (with a balance term)",
        &dlogits,
        &ferrotron::ops::moe::route_backward(&dweights, &want, &balance.to_vec()),
    );
    // sorted by expert: each token's rows, in the order of a counting sort of the ids
    let x = c.rand(&[rows, dim]);
    let n = rows * k;
    let mut order: Vec<u32> = (0..n as u32).map(|i| i / k as u32).collect();
    order.sort_by_key(|&t| (want.experts[t as usize * k] as usize * 7 + t as usize) % n); // some permutation with repeats
    let (mut bx, mut xs) = (c.buf(&x), Buf::zeros(n * dim, dt));
    c.run(&launch_table::moe::permute_rows(dt, bx.addr(), (order.as_mut_ptr() as Addr, n), dim, xs.addr()));
    c.same("permute rows", &xs, &ferrotron::ops::moe::permute_rows(&x, &order));
    let mut slot: Vec<u32> = (0..n as u32).rev().collect(); // a permutation: each routed row once
    let ys = c.rand(&[n, dim]);
    let rw = Tensor::from_vec(&[rows, k], weights.values());
    let (mut bys, mut y) = (c.buf(&ys), Buf::zeros(rows * dim, dt));
    let at = slot.as_mut_ptr() as Addr;
    c.run(&launch_table::moe::weighted_sum(dt, (bys.addr(), at, weights.addr()), (rows, k, dim), y.addr()));
    c.same("weighted sum (weighted)", &y, &ferrotron::ops::moe::weighted_sum(&ys, &slot, Some(&rw), rows));
    let mut y1 = Buf::zeros(rows * dim, dt);
    c.run(&launch_table::moe::weighted_sum(dt, (bys.addr(), at, 0), (rows, k, dim), y1.addr()));
    c.same("weighted sum (unit weights)", &y1, &ferrotron::ops::moe::weighted_sum(&ys, &slot, None, rows));
    let dy = c.rand(&[rows, dim]);
    let (want_dys, want_dw) = ferrotron::ops::moe::weighted_sum_backward(&dy, &ys, &slot, &rw);
    let (mut bdy, mut dys, mut dw) = (c.buf(&dy), Buf::zeros(n * dim, dt), Buf::zeros(n, DType::F32));
    let inputs = (bdy.addr(), bys.addr(), at, weights.addr());
    c.run(&launch_table::moe::weighted_sum_backward(dt, inputs, (rows, k, dim), (dys.addr(), dw.addr())));
    c.same("weighted sum backward d rows", &dys, &want_dys);
    c.same("weighted sum backward d weights", &dw, &want_dw);
}
