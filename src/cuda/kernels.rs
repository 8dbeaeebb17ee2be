//! # The kernel table: every kernel the op layer launches, by number
//!
//! A step makes hundreds of launches, so finding a launch's kernel must cost nothing. Each
//! kernel is a place in one table, `KERNELS`, and a `Kernel` is that place: `kernel!("name")`
//! finds it while *compiling* (a misspelt or missing name does not build), the device resolves
//! the whole table into CUDA functions once, when it opens (`cuda/nvrtc.rs`), and a launch
//! indexes that list (`cuda/device.rs`). Nothing is formatted, hashed or searched per launch.

/// Every kernel: the file of `kernels/` it is in, and its `extern "C"` name. Functions with a
/// `_f32` and a `_bf16` form are the same code in the two compute dtypes; `flash_attention_*_dN`
/// is the tensor-core attention instantiated for head size N, `attention_wide_*` the readable one
/// for heads wider than 128.
pub const KERNELS: &[(&str, &str)] = &[
    ("elementwise", "cast_f32_to_bf16"),
    ("elementwise", "cast_bf16_to_f32"),
    ("elementwise", "add_assign_f32"),
    ("elementwise", "add_assign_bf16"),
    ("elementwise", "scale_f32"),
    ("elementwise", "scale_bf16"),
    ("elementwise", "sum_squares_list_f32"),
    ("elementwise", "zero_list_f32"),
    ("elementwise", "sum_rows_f32"),
    ("embedding", "embedding_forward_f32"),
    ("embedding", "embedding_forward_bf16"),
    ("embedding", "embedding_backward_f32"),
    ("embedding", "embedding_backward_bf16"),
    ("rmsnorm", "rmsnorm_forward_f32"),
    ("rmsnorm", "rmsnorm_forward_bf16"),
    ("rmsnorm", "add_rmsnorm_forward_f32"),
    ("rmsnorm", "add_rmsnorm_forward_bf16"),
    ("rmsnorm", "rmsnorm_backward_dx_f32"),
    ("rmsnorm", "rmsnorm_backward_dx_bf16"),
    ("rmsnorm", "rmsnorm_backward_dw_partial_f32"),
    ("rmsnorm", "rmsnorm_backward_dw_partial_bf16"),
    ("rmsnorm", "rmsnorm_backward_dw_sum"),
    ("rope", "rope_table"),
    ("rope", "rope_f32"),
    ("rope", "rope_bf16"),
    ("attention", "attention_forward_f32"),
    ("attention", "attention_forward_bf16"),
    ("attention", "attention_delta_f32"),
    ("attention", "attention_delta_bf16"),
    ("attention", "attention_dq_f32"),
    ("attention", "attention_dq_bf16"),
    ("attention", "attention_dkdv_f32"),
    ("attention", "attention_dkdv_bf16"),
    ("attention", "attention_wide_forward_f32"),
    ("attention", "attention_wide_forward_bf16"),
    ("attention", "attention_wide_dq_f32"),
    ("attention", "attention_wide_dq_bf16"),
    ("attention", "attention_wide_dkdv_f32"),
    ("attention", "attention_wide_dkdv_bf16"),
    ("attention", "attention_merge_f32"),
    ("attention", "attention_merge_bf16"),
    ("flash_attention", "flash_attention_forward_d16"),
    ("flash_attention", "flash_attention_forward_d32"),
    ("flash_attention", "flash_attention_forward_d64"),
    ("flash_attention", "flash_attention_forward_d128"),
    ("flash_attention", "flash_attention_backward_d16"),
    ("flash_attention", "flash_attention_backward_d32"),
    ("flash_attention", "flash_attention_backward_d64"),
    ("flash_attention", "flash_attention_backward_d128"),
    ("flash_attention", "flash_attention_sum_parts"),
    ("swiglu", "swiglu_forward_f32"),
    ("swiglu", "swiglu_forward_bf16"),
    ("swiglu", "swiglu_backward_f32"),
    ("swiglu", "swiglu_backward_bf16"),
    ("cross_entropy", "row_max_f32"),
    ("cross_entropy", "row_max_bf16"),
    ("cross_entropy", "row_sum_exp_f32"),
    ("cross_entropy", "row_sum_exp_bf16"),
    ("cross_entropy", "log_sum_exp"),
    ("cross_entropy", "target_logit_f32"),
    ("cross_entropy", "target_logit_bf16"),
    ("cross_entropy", "add_loss"),
    ("cross_entropy", "cross_entropy_backward_f32"),
    ("cross_entropy", "cross_entropy_backward_bf16"),
    ("moe", "route_f32"),
    ("moe", "route_bf16"),
    ("moe", "route_backward_f32"),
    ("moe", "route_backward_bf16"),
    ("moe", "permute_rows_f32"),
    ("moe", "permute_rows_bf16"),
    ("moe", "weighted_sum_f32"),
    ("moe", "weighted_sum_bf16"),
    ("moe", "weighted_sum_backward_f32"),
    ("moe", "weighted_sum_backward_bf16"),
    ("fp8", "fp8_amax_f32"),
    ("fp8", "fp8_amax_bf16"),
    ("fp8", "fp8_operand_f32"),
    ("fp8", "fp8_operand_bf16"),
    ("fp8", "fp8_cast_f32"),
    ("fp8", "fp8_cast_bf16"),
    ("fp8", "fp8_decode_f32"),
    ("fp8", "fp8_decode_bf16"),
    ("adamw", "adamw_list_m32"),
    ("adamw", "adamw_list_m16"),
];

/// A kernel of `KERNELS`, by its place there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernel(usize);

impl Kernel {
    /// The kernel called `name`. Meant for constants (`kernel!`): a name the table lacks stops
    /// the build there.
    pub const fn named(name: &str) -> Kernel {
        let mut i = 0;
        while i < KERNELS.len() {
            if same(KERNELS[i].1, name) {
                return Kernel(i);
            }
            i += 1;
        }
        panic!("a kernel name missing from cuda::kernels::KERNELS")
    }

    /// Its place in `KERNELS`, and in the device's list of functions.
    pub fn index(self) -> usize {
        self.0
    }

    pub fn name(self) -> &'static str {
        KERNELS[self.0].1
    }
}

/// `a == b`, in a constant.
const fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// The `Kernel` called `$name`, found while compiling.
macro_rules! kernel {
    ($name:expr) => {{
        const K: $crate::cuda::kernels::Kernel = $crate::cuda::kernels::Kernel::named($name);
        K
    }};
}
pub(crate) use kernel;
