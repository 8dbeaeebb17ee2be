//! # Kernel launches: which kernel each op runs, on what grid, with which arguments
//!
//! Every CUDA kernel launch of the op layer is written here once, as a `Launch` value built from
//! buffer addresses and shapes: the kernel (`name_f32` or `name_bf16` by the compute dtype, a
//! number in the table of `cuda/kernels.rs`), its grid and block, and its arguments in the order
//! its `extern "C"` signature declares them (`long` is i64, `int` i32, pointers are addresses).
//! `ops/gpu.rs` queues them on a GPU; `tests/kernels_emulated.rs` runs the very same launches on
//! the CPU through a thread-per-CUDA-thread emulator, so the kernels and these argument lists are
//! tested where there is no GPU.
//!
//! Launch shapes follow the kernels' header comments: one block of 256 threads per row for
//! row-wise ops (per distinct token for the embedding gradient), one thread per element (or per
//! column, for the last sum of RMSNorm's weight gradient) otherwise, BQ = 64 query rows per block
//! for attention and its dq, BK = 32 key rows for dk/dv (on tensor cores, `flash_attention.cu`:
//! 64 query rows and 4 warps a block for the forward and dq, 16 key rows a warp for dk/dv; the
//! attention's launches are in `launch_table/attention.rs`).

use crate::cuda::kernels::{kernel, Kernel};
use crate::ops::types::{AdamWSettings, Attn, DType};

/// A device address (on the CPU emulator, a host address).
pub type Addr = u64;

/// One kernel argument, as the kernel declares it.
#[derive(Clone, Debug)]
pub enum Arg {
    Ptr(Addr),
    I32(i32),
    I64(i64),
    F32(f32),
    F64(f64),
    Shape(Shape),
    /// The tensors of a multi-tensor launch (the gradient norm's sums, zeroing).
    Tensors(Box<TensorList>),
    /// The parameters of a multi-tensor AdamW launch.
    AdamW(Box<AdamWList>),
}

/// The attention shape as `kernels/attention.cu` reads it (a `struct Shape` of six ints).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    batch: i32,
    seq: i32,
    kv_seq: i32,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
}
// SAFETY: six i32 in C layout, as the kernel declares them.
unsafe impl cudarc::driver::DeviceRepr for Shape {}

impl From<Attn> for Shape {
    fn from(a: Attn) -> Shape {
        let i = |v: usize| v as i32;
        Shape {
            batch: i(a.batch),
            seq: i(a.seq),
            kv_seq: i(a.kv_seq),
            heads: i(a.heads),
            kv_heads: i(a.kv_heads),
            head_dim: i(a.head_dim),
        }
    }
}

/// One launch of `kernel`. `typed!` and `tensor_core!` pick it while compiling (a `match` of
/// constants), and the device indexes the functions it resolved when it opened with it.
#[derive(Clone, Debug)]
pub struct Launch {
    pub kernel: Kernel,
    pub grid: (u32, u32, u32),
    pub block: u32,
    /// Bytes of dynamic shared memory a block gets (`extern __shared__`): a kernel's own need, the
    /// same at every shape (0 for all but the tensor-core forward). Past 48 KiB a function must
    /// opt in first: the device does so for each kernel when it opens (`dynamic_shared`).
    pub shared: u32,
    pub args: Vec<Arg>,
}

pub const THREADS: u32 = 256;
/// Blocks of the FP8 amax kernel, each writing one partial maximum.
pub const NORM_BLOCKS: usize = 256;

fn launch(kernel: Kernel, (grid, block): ((u32, u32, u32), u32), args: Vec<Arg>) -> Launch {
    Launch { kernel, grid, block, shared: 0, args }
}

/// The kernels that launch with dynamic shared memory, and the bytes they ask for: what a device
/// raises CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES to when it loads them.
pub fn dynamic_shared() -> Vec<(Kernel, u32)> {
    catalogue().into_iter().filter(|l| l.shared > 0).map(|l| (l.kernel, l.shared)).collect()
}

/// The kernel `name_f32` or `name_bf16` by the dtype.
macro_rules! typed {
    ($name:literal, $dt:expr) => {
        match $dt {
            DType::F32 => kernel!(concat!($name, "_f32")),
            DType::Bf16 => kernel!(concat!($name, "_bf16")),
        }
    };
}

pub mod attention; // attention.cu and flash_attention.cu
pub mod moe; // the routing of a mixture of experts

/// One block per row.
fn rows(n: usize) -> ((u32, u32, u32), u32) {
    ((n as u32, 1, 1), THREADS)
}

/// One thread per item.
fn each(n: usize) -> ((u32, u32, u32), u32) {
    ((n.div_ceil(THREADS as usize).max(1) as u32, 1, 1), THREADS)
}

use Arg::{Ptr, F32, F64, I32, I64};

fn long(v: usize) -> Arg {
    I64(v as i64)
}

fn int(v: usize) -> Arg {
    I32(v as i32)
}

pub fn cast_f32_to_bf16(from: Addr, to: Addr, n: usize) -> Launch {
    launch(kernel!("cast_f32_to_bf16"), each(n), vec![Ptr(from), Ptr(to), long(n)])
}

pub fn cast_bf16_to_f32(from: Addr, to: Addr, n: usize) -> Launch {
    launch(kernel!("cast_bf16_to_f32"), each(n), vec![Ptr(from), Ptr(to), long(n)])
}

/// Max |x| of each of `blocks` slices of `x` (n numbers) into `partial` (`kernels/fp8.cu`).
pub fn fp8_amax(dt: DType, x: Addr, n: usize, (partial, blocks): (Addr, usize)) -> Launch {
    launch(typed!("fp8_amax", dt), ((blocks as u32, 1, 1), THREADS), vec![Ptr(x), long(n), Ptr(partial)])
}

/// The blocks `fp8_amax` takes for `n` numbers: one per 4096 (each thread reads 16 an iteration),
/// at least 1 and at most `most` (NORM_BLOCKS for a weight's maxima on the wire, which every rank
/// must have as many of; AMAX_BLOCKS for a GEMM operand, enough to fill an H100 with loads).
pub fn amax_blocks(n: usize, most: usize) -> usize {
    n.div_ceil(16 * THREADS as usize).clamp(1, most)
}

/// The most blocks `fp8_amax` takes for a GEMM operand.
pub const AMAX_BLOCKS: usize = 1024;

/// The numbers a block of `fp8_operand` casts: a tile of FP8_TILE × FP8_TILE.
pub const FP8_TILE: usize = 64;

/// `x` `[rows, cols]` cast to FP8 (E5M2 or E4M3) with current scaling of the `partials` maxima
/// at `partial`, written twice, the summed index contiguous in each: `y` `[rows, cols16]` and
/// `yt` `[cols, rows16]` (n16: n rounded up to 16, the padding zeros); 1/scale into
/// `inverse_scale`. A block a tile of both.
pub fn fp8_operand(
    dt: DType,
    (x, rows, cols): (Addr, usize, usize),
    e5m2: bool,
    (partial, partials): (Addr, usize),
    (y, yt, inverse_scale): (Addr, Addr, Addr),
) -> Launch {
    let tiles = |n: usize| n.next_multiple_of(16).div_ceil(FP8_TILE);
    let format = int(e5m2 as usize);
    let args =
        vec![Ptr(x), long(rows), long(cols), format, Ptr(partial), int(partials), Ptr(y), Ptr(yt), Ptr(inverse_scale)];
    let blocks = (tiles(rows) * tiles(cols)) as u32;
    launch(typed!("fp8_operand", dt), ((blocks, 1, 1), THREADS), args)
}

/// `n` numbers of `x` cast to E4M3 bytes `y` with current scaling of the NORM_BLOCKS maxima at
/// `partial` (a weight packed for the wire: `ops/packing.rs`).
pub fn fp8_cast(dt: DType, (x, n): (Addr, usize), partial: Addr, y: Addr) -> Launch {
    launch(typed!("fp8_cast", dt), each(n), vec![Ptr(x), long(n), Ptr(partial), int(NORM_BLOCKS), Ptr(y)])
}

/// `n` E4M3 bytes `q` decoded into `out` (dtype `dt`), divided by the scale of the maxima in
/// `partial` (NORM_BLOCKS of them).
pub fn fp8_decode(dt: DType, (q, n): (Addr, usize), partial: Addr, out: Addr) -> Launch {
    launch(typed!("fp8_decode", dt), each(n), vec![Ptr(q), long(n), Ptr(partial), int(NORM_BLOCKS), Ptr(out)])
}

/// out[tokens, dim] from a table of `table_rows` ids starting at `first`.
pub fn embedding(
    dt: DType,
    (table, table_rows): (Addr, usize),
    (ids, tokens): (Addr, usize),
    first: usize,
    dim: usize,
    out: Addr,
) -> Launch {
    let args = vec![Ptr(table), Ptr(ids), long(first), long(table_rows), int(dim), Ptr(out)];
    launch(typed!("embedding_forward", dt), rows(tokens), args)
}

/// The tokens of a table slice (ids `first..first + rows`) grouped by id, packed in one index
/// array for the embedding backward: the distinct table rows (id − first, ascending), then where
/// each one's tokens start in `order` (and where the last ends), then `order`, the token indices
/// id by id, ascending within an id.
pub struct TokensById {
    pub packed: Vec<u32>,
    pub distinct: usize,
}

pub fn tokens_by_id(tokens: &[u32], first: usize, rows: usize) -> TokensById {
    let row = |t: u32| (tokens[t as usize] as usize).wrapping_sub(first);
    let mut order: Vec<u32> = (0..tokens.len() as u32).filter(|&t| row(t) < rows).collect();
    order.sort_by_key(|&t| row(t)); // stable: token order within an id
    let (mut distinct, mut starts) = (Vec::new(), Vec::new());
    for (e, &t) in order.iter().enumerate() {
        if distinct.last() != Some(&(row(t) as u32)) {
            distinct.push(row(t) as u32);
            starts.push(e as u32);
        }
    }
    starts.push(order.len() as u32);
    TokensById { distinct: distinct.len(), packed: [distinct, starts, order].concat() }
}

/// dtable[row] += the rows of dout of its tokens, one block per distinct id; `grouped` is the
/// device address of `tokens_by_id(..).packed`.
pub fn embedding_backward(
    dt: DType,
    dout: Addr,
    (grouped, distinct): (Addr, usize),
    dim: usize,
    dtable: Addr,
) -> Launch {
    let (starts, order) = (grouped + 4 * distinct as Addr, grouped + 4 * (2 * distinct + 1) as Addr);
    let args = vec![Ptr(dout), Ptr(grouped), Ptr(starts), Ptr(order), int(dim), Ptr(dtable)];
    launch(typed!("embedding_backward", dt), rows(distinct), args)
}

pub fn rmsnorm(dt: DType, x: Addr, w: Addr, eps: f32, (n, dim): (usize, usize), y: Addr, rstd: Addr) -> Launch {
    launch(typed!("rmsnorm_forward", dt), rows(n), vec![Ptr(x), Ptr(w), F32(eps), int(dim), Ptr(y), Ptr(rstd)])
}

/// x += add (in place), then y = RMSNorm(x) and its rstd: one block per row.
pub fn add_rmsnorm(
    dt: DType,
    (x, add): (Addr, Addr),
    w: Addr,
    eps: f32,
    (n, dim): (usize, usize),
    (y, rstd): (Addr, Addr),
) -> Launch {
    let args = vec![Ptr(x), Ptr(add), Ptr(w), F32(eps), int(dim), Ptr(y), Ptr(rstd)];
    launch(typed!("add_rmsnorm_forward", dt), rows(n), args)
}

/// Rows per chunk of RMSNorm's weight gradient: each chunk is summed by its own blocks.
pub const NORM_CHUNK_ROWS: usize = 64;

/// The f32 scratch `rmsnorm_backward` needs for `n` rows of `dim` features: a partial dw per chunk.
pub fn rmsnorm_partial_len((n, dim): (usize, usize)) -> usize {
    n.div_ceil(NORM_CHUNK_ROWS).max(1) * dim
}

/// dx (one block per row; plus `residual`'s rows where it is not 0); the partial dw of each
/// chunk of rows (blocks over columns × chunks); then dw += their sum (f32, one thread per
/// feature column, chunks in order).
pub fn rmsnorm_backward(
    dt: DType,
    (dy, x, w, rstd): (Addr, Addr, Addr, Addr),
    (n, dim): (usize, usize),
    (dx, residual): (Addr, Addr),
    (dw, partial): (Addr, Addr),
) -> [Launch; 3] {
    let chunks = n.div_ceil(NORM_CHUNK_ROWS).max(1);
    let chunk_grid = ((dim.div_ceil(THREADS as usize) as u32, chunks as u32, 1), THREADS);
    [
        launch(
            typed!("rmsnorm_backward_dx", dt),
            rows(n),
            vec![Ptr(dy), Ptr(x), Ptr(w), Ptr(rstd), Ptr(residual), int(dim), Ptr(dx)],
        ),
        launch(
            typed!("rmsnorm_backward_dw_partial", dt),
            chunk_grid,
            vec![Ptr(dy), Ptr(x), Ptr(rstd), long(n), int(dim), int(NORM_CHUNK_ROWS), Ptr(partial)],
        ),
        launch(kernel!("rmsnorm_backward_dw_sum"), each(dim), vec![Ptr(partial), int(chunks), int(dim), Ptr(dw)]),
    ]
}

/// cos and sin `[n, half]` (f32) of the rotation angles of n positions: position · inv_freq[i]
/// (`half` f64 frequencies on the device), both times `scale`.
pub fn rope_table(
    positions: Addr,
    (n, half): (usize, usize),
    (inv_freq, scale): (Addr, f64),
    (cos, sin): (Addr, Addr),
) -> Launch {
    let args = vec![Ptr(positions), long(n), int(half), Ptr(inv_freq), F64(scale), Ptr(cos), Ptr(sin)];
    launch(kernel!("rope_table"), each(n * half), args)
}

/// Rotates x[n, heads·head_dim] in place by the angles of `rope_table` (by −angle when `inverse`).
pub fn rope(
    dt: DType,
    x: Addr,
    (cos, sin): (Addr, Addr),
    (n, heads, head_dim): (usize, usize, usize),
    inverse: bool,
) -> Launch {
    let args = vec![Ptr(x), Ptr(cos), Ptr(sin), long(n), int(heads), int(head_dim), I32(inverse as i32)];
    launch(typed!("rope", dt), each(n * heads * head_dim / 2), args)
}

pub fn swiglu(dt: DType, (gate, up): (Addr, Addr), h: Addr, n: usize) -> Launch {
    launch(typed!("swiglu_forward", dt), each(n), vec![Ptr(gate), Ptr(up), Ptr(h), long(n)])
}

pub fn swiglu_backward(dt: DType, (dh, gate, up): (Addr, Addr, Addr), (dgate, dup): (Addr, Addr), n: usize) -> Launch {
    let args = vec![Ptr(dh), Ptr(gate), Ptr(up), Ptr(dgate), Ptr(dup), long(n)];
    launch(typed!("swiglu_backward", dt), each(n), args)
}

pub fn row_max(dt: DType, logits: Addr, (n, vocab): (usize, usize), max: Addr) -> Launch {
    launch(typed!("row_max", dt), rows(n), vec![Ptr(logits), int(vocab), Ptr(max)])
}

pub fn row_sum_exp(dt: DType, logits: Addr, (n, vocab): (usize, usize), max: Addr, sum: Addr) -> Launch {
    launch(typed!("row_sum_exp", dt), rows(n), vec![Ptr(logits), int(vocab), Ptr(max), Ptr(sum)])
}

pub fn log_sum_exp(max: Addr, sum: Addr, lse: Addr, n: usize) -> Launch {
    launch(kernel!("log_sum_exp"), each(n), vec![Ptr(max), Ptr(sum), Ptr(lse), long(n)])
}

/// z[row] = the target's logit where it lies in this vocabulary slice, one thread per row.
pub fn target_logit(
    dt: DType,
    logits: Addr,
    (n, vocab): (usize, usize),
    targets: Addr,
    first: usize,
    z: Addr,
) -> Launch {
    let args = vec![Ptr(logits), int(vocab), Ptr(targets), long(first), long(n), Ptr(z)];
    launch(typed!("target_logit", dt), each(n), args)
}

/// loss[0] += scale · Σ (lse − z) over the rows with a target: one block.
pub fn add_loss((lse, z, targets): (Addr, Addr, Addr), n: usize, scale: f32, loss: Addr) -> Launch {
    let args = vec![Ptr(lse), Ptr(z), Ptr(targets), long(n), F32(scale), Ptr(loss)];
    launch(kernel!("add_loss"), ((1, 1, 1), THREADS), args)
}

/// d(scale · loss)/d logits, with `lse` the rows' log-sum-exp over the whole vocabulary.
pub fn cross_entropy_backward(
    dt: DType,
    (logits, targets): (Addr, Addr),
    first: usize,
    (lse, scale): (Addr, f32),
    (n, vocab): (usize, usize),
    d: Addr,
) -> Launch {
    let args = vec![Ptr(logits), Ptr(targets), long(first), Ptr(lse), F32(scale), int(vocab), Ptr(d)];
    launch(typed!("cross_entropy_backward", dt), rows(n), args)
}

pub fn add_assign(dt: DType, a: Addr, b: Addr, n: usize) -> Launch {
    launch(typed!("add_assign", dt), each(n), vec![Ptr(a), Ptr(b), long(n)])
}

pub fn scale(dt: DType, a: Addr, s: f32, n: usize) -> Launch {
    launch(typed!("scale", dt), each(n), vec![Ptr(a), F32(s), long(n)])
}

/// Tensors a multi-tensor launch takes, and elements a block of it takes (`kernels/common.cuh`).
pub const LIST_TENSORS: usize = 64;
pub const LIST_CHUNK: usize = 4096;

/// Up to LIST_TENSORS f32 tensors for one launch, by value (`struct TensorList` of
/// `kernels/common.cuh`, the same C layout).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TensorList {
    x: [Addr; LIST_TENSORS],
    n: [i64; LIST_TENSORS],
    first_block: [i32; LIST_TENSORS + 1],
    count: i32,
}
// SAFETY: addresses, i64, i32 in C layout, as the kernels declare them.
unsafe impl cudarc::driver::DeviceRepr for TensorList {}

/// Up to LIST_TENSORS parameters for one AdamW launch (`struct AdamWList`, `kernels/adamw.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AdamWList {
    p: [Addr; LIST_TENSORS],
    g: [Addr; LIST_TENSORS],
    m: [Addr; LIST_TENSORS],
    v: [Addr; LIST_TENSORS],
    copy: [Addr; LIST_TENSORS],
    n: [i64; LIST_TENSORS],
    decay: [f32; LIST_TENSORS],
    first_block: [i32; LIST_TENSORS + 1],
    count: i32,
}
// SAFETY: as TensorList.
unsafe impl cudarc::driver::DeviceRepr for AdamWList {}

/// Blocks of a multi-tensor launch over tensors of `sizes`: where each tensor's first block is,
/// and how many there are (LIST_CHUNK elements a block; none for an empty tensor).
fn chunks(sizes: impl Iterator<Item = usize>) -> ([i32; LIST_TENSORS + 1], u32) {
    let mut first = [0; LIST_TENSORS + 1];
    let mut blocks = 0;
    for (t, n) in sizes.enumerate() {
        first[t] = blocks as i32;
        blocks += n.div_ceil(LIST_CHUNK);
        first[t + 1] = blocks as i32;
    }
    (first, blocks as u32)
}

fn tensor_lists(xs: &[(Addr, usize)]) -> impl Iterator<Item = (TensorList, u32)> + '_ {
    xs.chunks(LIST_TENSORS).map(|part| {
        let (first_block, blocks) = chunks(part.iter().map(|x| x.1));
        let mut list = TensorList { x: [0; LIST_TENSORS], n: [0; LIST_TENSORS], first_block, count: part.len() as i32 };
        for (t, &(x, n)) in part.iter().enumerate() {
            (list.x[t], list.n[t]) = (x, n as i64);
        }
        (list, blocks)
    })
}

/// Blocks that `sum_squares` over tensors of these sizes writes partial sums from.
pub fn partial_sums(sizes: impl Iterator<Item = usize>) -> usize {
    sizes.map(|n| n.div_ceil(LIST_CHUNK)).sum()
}

/// Partial sums of x² over the f32 tensors `xs` (address, numbers) into partial[0..
/// partial_sums(...)], a launch per LIST_TENSORS tensors, each block one chunk's sum.
pub fn sum_squares(xs: &[(Addr, usize)], partial: Addr) -> Vec<Launch> {
    let mut at = partial;
    let launches = tensor_lists(xs).map(|(list, blocks)| {
        let l = launch(
            kernel!("sum_squares_list_f32"),
            ((blocks, 1, 1), THREADS),
            vec![Arg::Tensors(Box::new(list)), Ptr(at)],
        );
        at += 4 * blocks as u64;
        l
    });
    launches.collect()
}

/// The f32 tensors `xs` (address, numbers) set to zero, a launch per LIST_TENSORS of them.
pub fn fill_zeros(xs: &[(Addr, usize)]) -> Vec<Launch> {
    tensor_lists(xs)
        .map(|(list, blocks)| {
            launch(kernel!("zero_list_f32"), ((blocks, 1, 1), THREADS), vec![Arg::Tensors(Box::new(list))])
        })
        .collect()
}

/// out[r] = Σ of row r of x `[rows, cols]`: one block per row.
pub fn sum_rows(x: Addr, (n, cols): (usize, usize), out: Addr) -> Launch {
    launch(kernel!("sum_rows_f32"), rows(n), vec![Ptr(x), int(cols), Ptr(out)])
}

/// One parameter's AdamW step: its settings, its f32 p, g, m, v, its bf16 compute copy (mixed
/// precision) and its size.
pub type AdamWStep = (AdamWSettings, (Addr, Addr, Addr, Addr), Option<Addr>, usize);

/// AdamW on every parameter of `steps`: a launch per LIST_TENSORS of them that share their
/// settings but the weight decay (every parameter of a step does; norms decay by 0).
pub fn adamw(steps: &[AdamWStep]) -> Vec<Launch> {
    let same = |a: &AdamWSettings, b: &AdamWSettings| {
        AdamWSettings { weight_decay: 0.0, ..*a } == AdamWSettings { weight_decay: 0.0, ..*b }
    };
    let mut launches = Vec::new();
    let mut rest = steps;
    while let Some((o, ..)) = rest.first() {
        let take = rest.iter().take(LIST_TENSORS).take_while(|s| same(&s.0, o)).count();
        let (part, after) = rest.split_at(take);
        let (first_block, blocks) = chunks(part.iter().map(|s| s.3));
        let mut list = AdamWList {
            p: [0; LIST_TENSORS],
            g: [0; LIST_TENSORS],
            m: [0; LIST_TENSORS],
            v: [0; LIST_TENSORS],
            copy: [0; LIST_TENSORS],
            n: [0; LIST_TENSORS],
            decay: [0.0; LIST_TENSORS],
            first_block,
            count: take as i32,
        };
        for (t, (o, (p, g, m, v), copy, n)) in part.iter().enumerate() {
            (list.p[t], list.g[t], list.m[t], list.v[t]) = (*p, *g, *m, *v);
            (list.copy[t], list.n[t], list.decay[t]) = (copy.unwrap_or(0), *n as i64, o.weight_decay);
        }
        let args = vec![
            Arg::AdamW(Box::new(list)),
            F32(o.lr),
            F32(o.beta1),
            F32(o.beta2),
            F32(o.eps),
            I32(o.step as i32),
            F32(o.grad_scale),
        ];
        let kernel = match o.moments {
            DType::F32 => kernel!("adamw_list_m32"),
            DType::Bf16 => kernel!("adamw_list_m16"),
        };
        launches.push(launch(kernel, ((blocks, 1, 1), THREADS), args));
        rest = after;
    }
    launches
}

/// One launch of every kind the op layer makes, in both dtypes, with placeholder addresses and
/// sizes: the kernels the backend needs and their argument types (`tests/kernels_compile.rs`
/// checks that the PTX exports each; the CPU emulator's glue calls them).
pub fn catalogue() -> Vec<Launch> {
    let a = Attn { batch: 1, seq: 1, kv_seq: 1, heads: 1, kv_heads: 1, head_dim: 2 };
    let o = AdamWSettings {
        lr: 0.0,
        beta1: 0.0,
        beta2: 0.0,
        eps: 0.0,
        weight_decay: 0.0,
        step: 1,
        grad_scale: 1.0,
        moments: DType::F32,
    };
    let mut all = vec![
        cast_f32_to_bf16(0, 0, 1),
        cast_bf16_to_f32(0, 0, 1),
        log_sum_exp(0, 0, 0, 1),
        add_loss((0, 0, 0), 1, 1.0, 0),
        sum_rows(0, (1, 1), 0),
        rope_table(0, (1, 1), (0, 1.0), (0, 0)),
    ];
    all.extend(sum_squares(&[(0, 1)], 0));
    all.extend(fill_zeros(&[(0, 1)]));
    all.extend(adamw(&[
        (o, (0, 0, 0, 0), None, 1),
        (AdamWSettings { moments: DType::Bf16, ..o }, (0, 0, 0, 0), Some(0), 1),
    ]));
    for dt in [DType::F32, DType::Bf16] {
        all.push(embedding(dt, (0, 1), (0, 1), 0, 1, 0));
        all.push(embedding_backward(dt, 0, (0, 1), 1, 0));
        all.push(rmsnorm(dt, 0, 0, 0.0, (1, 1), 0, 0));
        all.push(add_rmsnorm(dt, (0, 0), 0, 0.0, (1, 1), (0, 0)));
        all.extend(rmsnorm_backward(dt, (0, 0, 0, 0), (1, 1), (0, 0), (0, 0)));
        all.push(rope(dt, 0, (0, 0), (1, 1, 2), false));
        all.push(attention::forward(dt, a, (0, 0, 0), (0, 0), 0, 0));
        all.extend(attention::backward(dt, a, (0, 0, 0), (0, 0), (0, 0, 0), 0, (0, 0, 0)));
        all.push(attention::merge(dt, a, (0, 0), (0, 0)));
        all.push(swiglu(dt, (0, 0), 0, 1));
        all.push(swiglu_backward(dt, (0, 0, 0), (0, 0), 1));
        all.push(row_max(dt, 0, (1, 1), 0));
        all.push(row_sum_exp(dt, 0, (1, 1), 0, 0));
        all.push(target_logit(dt, 0, (1, 1), 0, 0, 0));
        all.push(cross_entropy_backward(dt, (0, 0), 0, (0, 1.0), (1, 1), 0));
        all.push(add_assign(dt, 0, 0, 1));
        all.push(fp8_amax(dt, 0, 1, (0, 1)));
        all.push(fp8_operand(dt, (0, 1, 1), false, (0, 1), (0, 0, 0)));
        all.push(fp8_cast(dt, (0, 1), 0, 0));
        all.push(fp8_decode(dt, (0, 1), 0, 0));
        all.push(scale(dt, 0, 1.0, 1));
        all.extend(moe::catalogue(dt));
    }
    // the readable attention's wide form
    for dt in [DType::F32, DType::Bf16] {
        let a = Attn { head_dim: 192, ..a };
        all.push(attention::forward(dt, a, (0, 0, 0), (0, 0), 0, 0));
        all.extend(attention::backward(dt, a, (0, 0, 0), (0, 0), (0, 0, 0), 0, (0, 0, 0)));
    }
    // the tensor-core attention: bf16, each head size it is built for
    for head_dim in attention::TENSOR_CORE_HEAD_DIMS {
        let a = Attn { head_dim, ..a };
        all.push(attention::forward(DType::Bf16, a, (0, 0, 0), (0, 0), 0, 0));
        all.extend(attention::backward(DType::Bf16, a, (0, 0, 0), (0, 0), (0, 0, 0), 0, (0, 0, 0)));
    }
    all
}
