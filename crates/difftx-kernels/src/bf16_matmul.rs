//! bf16 matrix products with f32 accumulation, for mixed-precision training: C = A·B where every
//! element of A and B is first rounded to bf16 (round to nearest, ties to even, denormals to zero)
//! and the products are summed in f32. C, the inputs and everything around the product stay f32.
//!
//! Layout: A `[m, k]` and B `[k, n]` are f32 views with any strides (so transposed operands of
//! the backward need no copy); C is row-major `[m, n]`. k is taken in chunks (so that packed B
//! stays in cache); per chunk (kp = chunk padded to a multiple of 32):
//! * B is packed once as bf16 pairs along k (low half `B[2p][j]`, high half `B[2p+1][j]`, the "VNNI"
//!   layout both instructions read) in panels of 16 columns: `[np/16][kp/2][16]` u32, columns
//!   padded to a multiple of 32;
//! * each task packs its 32 rows of A as `[kp/32][32 rows][32]` bf16.
//!
//! Every tile the AMX kernel loads (16 rows of 64 bytes) is then 1 KiB of consecutive memory:
//! rows a power-of-two stride apart would land in the same L1 sets and evict each other.
//!
//! Zero padding contributes nothing, so every 32×32 block of C is computed whole and only its
//! valid part stored. Two backends, one packed format:
//! * **AMX** (`tdpbf16ps`, Intel Sapphire Rapids and later): four 16×16 f32 accumulator tiles per
//!   32×32 block, 16×32 bf16 tiles of A and 16-pair × 16 tiles of B, 32 values of k per step.
//! * **AVX512_BF16** (`vdpbf16ps`, AMD Zen 4 and Zen 5, Intel Cooper Lake and later): 8 rows × 32
//!   columns of accumulators; each step broadcasts one (k, k+1) pair of a row of A against a pair
//!   row of B.
//!
//! Where neither exists, [`bf16_backend`] is `None` and callers stay in f32 (the model's
//! `--precision bf16` says so). The order of summation differs between the backends (AMX adds a
//! 32-wide k step per instruction), so results agree to f32 rounding of the sums, not bitwise.

use crate::cpu::filled;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::mem::MaybeUninit;
use std::sync::OnceLock;

/// C = A·B for f32 tensors A `[m, k]` and B `[k, n]` (any strides: pass `w.t()` for a linear
/// layer) with bf16 products and f32 sums, on [`bf16_backend`]; an error where there is none.
/// Backward through the same bf16 product: dA = dC·Bᵀ, dB = Aᵀ·dC (f32 results, like autocast).
pub fn matmul_bf16(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let Some(backend) = bf16_backend() else {
        bail!("difftx_kernels::matmul_bf16: this CPU has neither AMX-BF16 nor AVX512_BF16");
    };
    check_operands("matmul_bf16", a, b)?;
    a.apply_op2(b, MatmulBf16 { backend: Some(backend) })
}

/// The same product as [`matmul_bf16`] (bf16-rounded inputs, the gradient rounded the same way
/// in the backward) computed by f32 gemm on rounded copies: the reference path, on any CPU.
/// The two differ only in the order of the f32 sums.
pub fn matmul_bf16_emulated(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    check_operands("matmul_bf16_emulated", a, b)?;
    a.apply_op2(b, MatmulBf16 { backend: None })
}

/// Both operands f32 matrices whose inner dimensions agree.
fn check_operands(op: &str, a: &Tensor, b: &Tensor) -> Result<()> {
    let ((m, k), (k2, n)) = (a.dims2()?, b.dims2()?);
    if k != k2 {
        bail!("difftx_kernels::{op}: cannot multiply [{m}, {k}] by [{k2}, {n}]");
    }
    if a.dtype() != DType::F32 || b.dtype() != DType::F32 {
        bail!("difftx_kernels::{op}: f32 operands only, got {:?} and {:?}", a.dtype(), b.dtype());
    }
    Ok(())
}

/// `backend` None: the emulated reference.
struct MatmulBf16 {
    backend: Option<Bf16Backend>,
}

/// The values of `v` rounded to bf16, row-major `[rows, cols]`.
fn rounded(v: &MatRef) -> Vec<f32> {
    (0..v.rows * v.cols).map(|x| bf16_to_f32(bf16_bits(v.at(x / v.cols, x % v.cols)))).collect()
}

/// c = a·b in f32 by gemm (row-major, contiguous).
fn gemm_f32(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize) {
    // SAFETY: the slices hold m·k, k·n and m·n values in row-major order, as the strides say.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            1,
            n as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(rayon::current_num_threads()),
        )
    }
}

/// The f32 view of a 2-d candle storage.
fn view<'a>(s: &'a CpuStorage, l: &Layout) -> Result<MatRef<'a>> {
    let data = &s.as_slice::<f32>()?[l.start_offset()..];
    let (dims, st) = (l.dims(), l.stride());
    Ok(MatRef { data, rows: dims[0], cols: dims[1], rs: st[0], cs: st[1] })
}

impl CustomOp2 for MatmulBf16 {
    fn name(&self) -> &'static str {
        "difftx-matmul-bf16"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        self.product(view(s1, l1)?, view(s2, l2)?)
    }

    fn bwd(&self, a: &Tensor, b: &Tensor, _res: &Tensor, dc: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dc = dc.to_dtype(DType::F32)?;
        let product = |x: &Tensor, y: &Tensor| x.apply_op2(y, MatmulBf16 { backend: self.backend });
        Ok((Some(product(&dc, &b.t()?)?), Some(product(&a.t()?, &dc)?)))
    }
}

impl MatmulBf16 {
    /// C = A·B as a new storage.
    fn product(&self, a: MatRef, b: MatRef) -> Result<(CpuStorage, Shape)> {
        let (m, k, n) = (a.rows, a.cols, b.cols);
        let c = match self.backend {
            Some(backend) => {
                // The kernel writes every value of C: no zero fill first (a pass over C as long
                // as a small product itself).
                let mut c: Vec<f32> = Vec::with_capacity(m * n);
                matmul_uninit(backend, a, b, &mut c.spare_capacity_mut()[..m * n]).map_err(candle_core::Error::Msg)?;
                // SAFETY: matmul_uninit initialised all m·n values (or returned an error above).
                unsafe { c.set_len(m * n) };
                c
            }
            None => {
                let mut c = vec![0f32; m * n];
                if k > 0 {
                    gemm_f32(&rounded(&a), &rounded(&b), &mut c, m, k, n);
                }
                c
            }
        };
        Ok((CpuStorage::F32(c), Shape::from_dims(&[m, n])))
    }
}

/// A linear layer's `x·wᵀ` (x `[m, in]`, w `[out, in]`) with bf16 products on [`bf16_backend`],
/// as [`matmul_bf16`]`(x, wᵀ)`, but with the weight's gradient handed back in w's own layout.
/// Through `matmul_bf16(x, &w.t())` it would come back as a transposed view, which candle's
/// gradient store copies value by value (~3.7% of a bf16 training step, docs/design.md §7.17).
pub fn linear_bf16(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let Some(backend) = bf16_backend() else {
        bail!("difftx_kernels::linear_bf16: this CPU has neither AMX-BF16 nor AVX512_BF16");
    };
    check_linear("linear_bf16", x, w)?;
    x.apply_op2(&w.contiguous()?, LinearBf16 { backend: Some(backend) })
}

/// [`linear_bf16`] on the emulated product of [`matmul_bf16_emulated`] (any CPU).
pub fn linear_bf16_emulated(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    check_linear("linear_bf16_emulated", x, w)?;
    x.apply_op2(&w.contiguous()?, LinearBf16 { backend: None })
}

/// x `[m, k]` and w `[n, k]`, both f32 (the error names the weight as the caller passed it).
fn check_linear(op: &str, x: &Tensor, w: &Tensor) -> Result<()> {
    let ((m, k), (n, k2)) = (x.dims2()?, w.dims2()?);
    if k != k2 {
        bail!("difftx_kernels::{op}: x [{m}, {k}] does not end in the weight's input size {k2} (w [{n}, {k2}])");
    }
    check_operands(op, x, &w.t()?)
}

/// `x·wᵀ` with w contiguous `[n, k]`; `backend` None: the emulated reference.
struct LinearBf16 {
    backend: Option<Bf16Backend>,
}

impl CustomOp2 for LinearBf16 {
    fn name(&self) -> &'static str {
        "difftx-linear-bf16"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let w = view(s2, l2)?;
        let wt = MatRef { rows: w.cols, cols: w.rows, rs: w.cs, cs: w.rs, ..w };
        MatmulBf16 { backend: self.backend }.product(view(s1, l1)?, wt)
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = dy.to_dtype(DType::F32)?;
        let product = |a: &Tensor, b: &Tensor| a.apply_op2(b, MatmulBf16 { backend: self.backend });
        // dw = (xᵀ·dy)ᵀ: the product in the order whose packing is fast (§7.15 of
        // docs/design.md: dyᵀ·x measured slower), then a blocked transpose into w's layout.
        let dwt = product(&x.t()?, &dy)?;
        let (k, n) = dwt.dims2()?;
        let dw = crate::cpu::with_slice(&dwt, |v| Tensor::from_vec(transposed(v, k, n), (n, k), w.device()))?;
        Ok((Some(product(&dy, w)?), Some(dw)))
    }
}

/// Side of the square blocks [`transposed`] copies (32 f32 rows: 4 KiB read and written per block).
const TRANSPOSE_BLOCK: usize = 32;

/// `x` (`[rows, cols]`, row-major) transposed into a new row-major `[cols, rows]`, on the pool:
/// each task writes 32 whole rows of the result, block by block, so that both sides of a block
/// stay in L1 (a value-by-value strided copy walks the source a cache line per value).
fn transposed(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    assert_eq!(x.len(), rows * cols, "transposed: {rows}x{cols} values");
    if rows == 0 {
        return Vec::new();
    }
    // SAFETY: each chunk is TRANSPOSE_BLOCK whole rows of the result (the last one fewer), and
    // for every one of its rows j every column i < rows is written.
    unsafe {
        crate::cpu::par_output_uninit(rows * cols, TRANSPOSE_BLOCK * rows, |c, out| {
            let (j0, width) = (c * TRANSPOSE_BLOCK, out.len() / rows);
            for i0 in (0..rows).step_by(TRANSPOSE_BLOCK) {
                for i in i0..(i0 + TRANSPOSE_BLOCK).min(rows) {
                    let src = &x[i * cols + j0..i * cols + j0 + width];
                    for (jj, &v) in src.iter().enumerate() {
                        out[jj * rows + i].write(v);
                    }
                }
            }
        })
    }
}

/// Which instruction set computes bf16 products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Backend {
    /// Intel AMX tiles (`amx-bf16`).
    Amx,
    /// AVX-512 dot products of bf16 pairs (`avx512bf16`).
    Avx512Bf16,
}

/// The fastest bf16 backend this CPU and OS allow, detected once; `None` where there is none.
/// `DIFFTX_BF16_BACKEND=avx512_bf16` picks the AVX-512 kernel on an AMX machine (to measure or
/// check it); an unavailable choice is ignored. Whether it beats f32 here is
/// [`bf16_faster_than_f32`].
pub fn bf16_backend() -> Option<Bf16Backend> {
    static BACKEND: OnceLock<Option<Bf16Backend>> = OnceLock::new();
    *BACKEND.get_or_init(|| {
        if avx512bf16_forced() && avx512bf16_available() {
            Some(Bf16Backend::Avx512Bf16)
        } else if amx_available() {
            Some(Bf16Backend::Amx)
        } else if avx512bf16_available() {
            Some(Bf16Backend::Avx512Bf16)
        } else {
            None
        }
    })
}

/// Whether bf16 products on [`bf16_backend`] outpace f32 ones on this CPU ([`bf16_outpaces_f32`]
/// on its facts): what decides whether `--precision bf16` runs bf16 or falls back to f32.
pub fn bf16_faster_than_f32() -> bool {
    static FASTER: OnceLock<bool> = OnceLock::new();
    *FASTER.get_or_init(|| bf16_outpaces_f32(bf16_backend(), intel_cpu(), avx512bf16_forced()))
}

/// Whether bf16 products on `backend` outpace f32 ones (`intel`: the CPU is Intel's). AMX's
/// always do. AVX512_BF16's do on AMD (the bf16 kernel ran 195–317 GFLOP/s against candle's f32
/// gemm at 138–188 on the Zen 4, 1.4–2.2× it on the Zen 5), not on Intel, where
/// `vdpbf16ps` (32 products) issues at a quarter of the rate of 16-wide f32 FMAs: half their
/// products (family 6 model 207, AMX hidden by its hypervisor: 43 against 88 GMAC/s on one core,
/// sixteen independent chains each; the bf16 kernel ran 0.53–0.78× candle's f32 gemm and trained
/// at about 0.65× f32's tokens/s, design.md §7.26). Cooper Lake, the Intel CPU with AVX512_BF16
/// and no AMX by design, was not measured.
/// `forced` (`DIFFTX_BF16_BACKEND=avx512_bf16`) counts AVX512_BF16 as faster anyway.
pub fn bf16_outpaces_f32(backend: Option<Bf16Backend>, intel: bool, forced: bool) -> bool {
    match backend {
        None => false,
        Some(Bf16Backend::Amx) => true,
        Some(Bf16Backend::Avx512Bf16) => forced || !intel,
    }
}

/// `DIFFTX_BF16_BACKEND=avx512_bf16`. Any other value is ignored, with a warning on stderr the
/// first time it is read (a typo would otherwise pass unseen).
fn avx512bf16_forced() -> bool {
    static FORCED: OnceLock<bool> = OnceLock::new();
    *FORCED.get_or_init(|| {
        let value = std::env::var("DIFFTX_BF16_BACKEND").ok();
        forced_by(value.as_deref()).unwrap_or_else(|warning| {
            eprintln!("{warning}");
            false
        })
    })
}

/// Whether a `DIFFTX_BF16_BACKEND` value (`None`: unset) forces the AVX512_BF16 kernel, or the
/// warning for a value that names nothing.
fn forced_by(value: Option<&str>) -> std::result::Result<bool, String> {
    match value {
        None | Some("") => Ok(false),
        Some("avx512_bf16") => Ok(true),
        Some(other) => Err(format!(
            "warning: DIFFTX_BF16_BACKEND={other:?} is ignored: the one value it takes is avx512_bf16 \
             (AMX, where present, is the default)"
        )),
    }
}

/// Whether CPUID's vendor string is "GenuineIntel".
fn intel_cpu() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // CPUID leaf 0: the vendor string in EBX, EDX, ECX ("Genu", "ineI", "ntel").
        let id = std::arch::x86_64::__cpuid(0);
        (id.ebx, id.edx, id.ecx) == (0x756e_6547, 0x4965_6e69, 0x6c65_746e)
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether `backend` can run here (tests use this to cover every backend the machine has).
pub fn bf16_backend_available(backend: Bf16Backend) -> bool {
    match backend {
        Bf16Backend::Amx => amx_available(),
        Bf16Backend::Avx512Bf16 => avx512bf16_available(),
    }
}

fn avx512bf16_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// AMX needs the CPU feature and the kernel's permission to use the tile data state (Linux asks
/// each process to request it once, `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`).
fn amx_available() -> bool {
    static AMX: OnceLock<bool> = OnceLock::new();
    *AMX.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            // CPUID leaf 7: EDX bit 22 = AMX-BF16, bit 24 = AMX-TILE (std's detection of these
            // is not stable yet).
            let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
            edx & (1 << 22) != 0 && edx & (1 << 24) != 0 && avx512bf16_available() && amx::request_permission()
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        false
    })
}

/// An f32 matrix view: element (i, j) is `data[i * rs + j * cs]`.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl MatRef<'_> {
    #[inline]
    fn at(&self, i: usize, j: usize) -> f32 {
        self.data[i * self.rs + j * self.cs]
    }

    fn check(&self, what: &str) -> std::result::Result<(), String> {
        if self.rows == 0 || self.cols == 0 {
            return Ok(());
        }
        let last = (self.rows - 1) * self.rs + (self.cols - 1) * self.cs;
        if last >= self.data.len() {
            return Err(format!(
                "bf16 matmul: {what} view {}x{} (strides {}, {}) reaches element {last} of {}",
                self.rows,
                self.cols,
                self.rs,
                self.cs,
                self.data.len()
            ));
        }
        Ok(())
    }
}

/// f32 -> bf16 bits as the hardware converts (`vcvtne2ps2bf16`): round to nearest with ties to
/// even, NaN stays (quiet) NaN, and denormals become zero of the same sign (AMX reads denormal
/// bf16 inputs as zero too). Every packing path gives these bits.
#[inline]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let (exp, abs) = (b & 0x7f80_0000, b & 0x7fff_ffff);
    if abs > 0x7f80_0000 {
        ((b >> 16) | 0x40) as u16
    } else if exp == 0 {
        ((b >> 16) & 0x8000) as u16
    } else {
        (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
    }
}

/// `dst[i] = bf16_bits(src[i])` (lengths equal), 32 values per instruction on x86_64.
///
/// # Safety
/// On x86_64 the CPU must have AVX512F and AVX512_BF16 (every bf16 backend implies both). The
/// packers carry the same target features, so this inlines into their loops.
#[inline]
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx512f,avx512bf16"))]
pub(crate) unsafe fn to_bf16(src: &[f32], dst: &mut [u16]) {
    debug_assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    convert::to_bf16(src, dst);
    #[cfg(not(target_arch = "x86_64"))]
    for (o, &v) in dst.iter_mut().zip(src) {
        *o = bf16_bits(v);
    }
}

/// `dst[j] = bf16(lo[j]) | bf16(hi[j]) << 16` (hi absent: zero), 16 pairs per step on x86_64.
///
/// # Safety
/// As [`to_bf16`].
#[inline]
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx512f,avx512bf16"))]
pub(crate) unsafe fn to_bf16_pairs(lo: &[f32], hi: Option<&[f32]>, dst: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    convert::to_bf16_pairs(lo, hi, dst);
    #[cfg(not(target_arch = "x86_64"))]
    for (j, o) in dst.iter_mut().enumerate() {
        *o = bf16_pair(lo[j], hi.map_or(0.0, |h| h[j]));
    }
}

/// Pair row `p` of a row-contiguous B, rows `lo` (2p) and `hi` (2p + 1; `None` past k), into every
/// one of `panels` panels: panel `pi`'s 16 values (columns 16·pi ..) at `out + pi·panel_stride`,
/// columns past the row's end zero (an empty `lo`: all zero).
///
/// # Safety
/// As [`to_bf16`]; `out + pi·panel_stride .. + 16` writable for every `pi < panels`.
#[inline]
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx512f,avx512bf16"))]
unsafe fn pair_row_into_panels(lo: &[f32], hi: Option<&[f32]>, panels: usize, out: *mut u32, panel_stride: usize) {
    #[cfg(target_arch = "x86_64")]
    convert::pair_row_into_panels(lo, hi, panels, out, panel_stride);
    #[cfg(not(target_arch = "x86_64"))]
    for pi in 0..panels {
        for c in 0..16 {
            let j = 16 * pi + c;
            let v = if j < lo.len() { bf16_pair(lo[j], hi.map_or(0.0, |h| h[j])) } else { 0 };
            *out.add(pi * panel_stride + c) = v;
        }
    }
}

/// bf16 bits -> f32 (exact).
#[inline]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// Block edge of the packed operands and of one C block.
const BLOCK: usize = 32;

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// Rows `i0..i0 + 32` of A packed into `blk` as `[kp/32][32][32]` bf16: for each step of 32
/// values of k, a 32×32 row-major chunk (zero padded).
///
/// # Safety
/// As [`to_bf16`].
#[inline(never)]
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx512f,avx512bf16"))]
unsafe fn pack_a_block(a: &MatRef, i0: usize, kp: usize, blk: &mut [u16]) {
    const CHUNK: usize = BLOCK * BLOCK;
    debug_assert_eq!(blk.len(), BLOCK * kp);
    let (rows, cols) = (BLOCK.min(a.rows - i0), a.cols);
    if rows < BLOCK || cols < kp {
        // Padding rows or columns must read as zero; a full block overwrites everything.
        blk.fill(0);
    }
    if a.cs == 1 {
        // Rows contiguous: convert 32 values at a time into each chunk's row.
        for r in 0..rows {
            let src = &a.data[(i0 + r) * a.rs..(i0 + r) * a.rs + cols];
            for (c, part) in src.chunks(BLOCK).enumerate() {
                let at = c * CHUNK + r * BLOCK;
                to_bf16(part, &mut blk[at..at + part.len()]);
            }
        }
    } else if a.rs == 1 {
        // Columns contiguous (a transposed operand, xᵀ in dw = xᵀ·dy): each column's run of
        // rows is contiguous. Whole 32×32 chunks by in-register transposes (a 128-byte load per
        // column, one 64-byte store per row); a last partial block of rows or columns value by
        // value, down one chunk (64-byte stride, within 2 KiB).
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if rows == BLOCK {
            while done + BLOCK <= cols {
                convert::transpose_chunk(a, i0, done, blk.as_mut_ptr().add((done / BLOCK) * CHUNK));
                done += BLOCK;
            }
        }
        let mut run = [0u16; BLOCK];
        for j in done..cols {
            let start = j * a.cs + i0;
            to_bf16(&a.data[start..start + rows], &mut run[..rows]);
            let base = (j / BLOCK) * CHUNK + j % BLOCK;
            for (r, &h) in run[..rows].iter().enumerate() {
                blk[base + r * BLOCK] = h;
            }
        }
    } else {
        for r in 0..rows {
            for j in 0..cols {
                blk[(j / BLOCK) * CHUNK + r * BLOCK + j % BLOCK] = bf16_bits(a.at(i0 + r, j));
            }
        }
    }
}

/// bf16(lo) in the low half, bf16(hi) in the high half: a pair as `vdpbf16ps` reads it.
#[inline]
pub(crate) fn bf16_pair(lo: f32, hi: f32) -> u32 {
    bf16_bits(lo) as u32 | (bf16_bits(hi) as u32) << 16
}

/// Width of a packed B panel: one AMX tile's columns.
const PANEL: usize = 16;

/// Pairs of k per task when B's rows are contiguous (64 rows: 64 KiB of f32 at n = 256).
const PAIR_BLOCK: usize = 32;

/// B packed as pairs along k in panels of 16 columns, `[np/16][kp/2][16]` u32 (low half: even
/// k), zero padded. Every value is written by one task (no separate zero fill on the calling
/// thread first).
#[inline(never)]
fn pack_b(b: &MatRef, kp: usize, np: usize) -> Vec<u32> {
    let pairs_p = kp / 2;
    let len = np * pairs_p;
    let mut out: Vec<u32> = Vec::with_capacity(len);
    if b.cs == 1 {
        // Rows contiguous (x and dy as the B of dw = xᵀ·dy): each task reads its pairs of rows
        // once, start to end, and writes each pair's 16 values into every panel. Panel by panel
        // over the task's rows instead (one cache line of every row, then the next), the loads
        // waited on memory for ~60% of the packing's samples on the Zen 4 (docs/design.md §7.36);
        // a task per panel read one cache line of every row of the whole B, a stride the hardware
        // prefetcher does not follow.
        let dst = Spare(out.spare_capacity_mut().as_mut_ptr());
        let (k, n, panels) = (b.rows, b.cols, np / PANEL);
        (0..pairs_p.div_ceil(PAIR_BLOCK)).into_par_iter().for_each(|t| {
            let (p0, p1) = (t * PAIR_BLOCK, ((t + 1) * PAIR_BLOCK).min(pairs_p));
            for p in p0..p1 {
                let row = |r: usize| &b.data[r * b.rs..r * b.rs + n];
                // Pairs past k (padding) are zeros: an empty row.
                let lo = if 2 * p < k { row(2 * p) } else { &[] };
                let hi = (2 * p + 1 < k).then(|| row(2 * p + 1));
                // SAFETY: pair p of panel pi is at pi·pairs_p·16 + p·16, 16 values inside the
                // buffer's `len` (pi < np/16, p < pairs_p), written by this task only (tasks
                // cover disjoint pairs); matmul_into runs only with a backend, and every backend
                // implies the features.
                unsafe { pair_row_into_panels(lo, hi, panels, dst.at(p * PANEL), pairs_p * PANEL) };
            }
        });
    } else {
        out.spare_capacity_mut()[..len].par_chunks_mut(PANEL * pairs_p).enumerate().for_each(|(pi, panel)| {
            let panel = filled(panel, 0);
            if pi < b.cols.div_ceil(PANEL) {
                // SAFETY: as above.
                unsafe { pack_b_panel(b, pi, panel) }
            }
        });
    }
    // SAFETY: every value was written (the row-contiguous tasks write all 16 values of every pair
    // of every panel; the panel tasks fill every panel through `filled`).
    unsafe { out.set_len(len) };
    out
}

/// The spare capacity of [`pack_b`]'s buffer, shared by tasks that write disjoint runs of it.
#[derive(Clone, Copy)]
struct Spare(*mut MaybeUninit<u32>);

// SAFETY: pack_b's tasks write disjoint runs of it, and the buffer outlives them.
unsafe impl Send for Spare {}
unsafe impl Sync for Spare {}

impl Spare {
    /// Where value `at` of the buffer is (writing there is the caller's to make safe).
    fn at(&self, at: usize) -> *mut u32 {
        self.0.wrapping_add(at) as *mut u32
    }
}

/// Panel `pi` (columns 16·pi .. 16·pi + 16) of [`pack_b`] for a B whose rows are not
/// contiguous, into `panel` (zero-filled).
///
/// # Safety
/// As [`to_bf16`].
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx512f,avx512bf16"))]
unsafe fn pack_b_panel(b: &MatRef, pi: usize, panel: &mut [u32]) {
    let (k, n) = (b.rows, b.cols);
    let pairs = k.div_ceil(2);
    let j0 = pi * PANEL;
    let w = PANEL.min(n - j0);
    if b.rs == 1 {
        // Columns contiguous (the transpose of a row-major weight): consecutive bf16 values
        // along k, read as u32, are exactly the pairs.
        let mut run = vec![0u16; 2 * pairs];
        for jj in 0..w {
            let src = &b.data[(j0 + jj) * b.cs..(j0 + jj) * b.cs + k];
            to_bf16(src, &mut run[..k]);
            for (p, ch) in run.chunks_exact(2).enumerate() {
                panel[p * PANEL + jj] = ch[0] as u32 | (ch[1] as u32) << 16;
            }
        }
    } else {
        for p in 0..pairs {
            for jj in 0..w {
                let hi = if 2 * p + 1 < k { b.at(2 * p + 1, j0 + jj) } else { 0.0 };
                panel[p * PANEL + jj] = bf16_pair(b.at(2 * p, j0 + jj), hi);
            }
        }
    }
}

/// C (row-major `[m, n]`, overwritten) = A·B with bf16 inputs and f32 sums, on `backend`.
/// Errors if the shapes disagree, a view reaches outside its data, or the backend cannot run here.
pub fn matmul_into(backend: Bf16Backend, a: MatRef, b: MatRef, c: &mut [f32]) -> std::result::Result<(), String> {
    // SAFETY: MaybeUninit<f32> has f32's layout, and only initialised values are written.
    let c = unsafe { &mut *(c as *mut [f32] as *mut [MaybeUninit<f32>]) };
    matmul_uninit(backend, a, b, c)
}

/// [`matmul_into`] into possibly uninitialised memory: every value of `c` is written (unless an
/// error is returned).
fn matmul_uninit(
    backend: Bf16Backend,
    a: MatRef,
    b: MatRef,
    c: &mut [MaybeUninit<f32>],
) -> std::result::Result<(), String> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if b.rows != k {
        return Err(format!("bf16 matmul: A is {m}x{k} but B is {}x{n}", b.rows));
    }
    if c.len() != m * n {
        return Err(format!("bf16 matmul: C holds {} values, expected {m}x{n}", c.len()));
    }
    a.check("A")?;
    b.check("B")?;
    if !bf16_backend_available(backend) {
        return Err(format!("bf16 matmul: the {backend:?} backend is not available on this CPU"));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        c.fill(MaybeUninit::new(0.0));
        return Ok(());
    }
    let np = round_up(n, BLOCK);
    // k in chunks whose packed B (kc/2 rows of np pairs) stays near 512 KiB: every row block's
    // task then reads B from its core's cache, not from memory (dw = dyᵀ·x has k = tokens).
    let kc_max = ((512 << 10) / (np * 2)).max(BLOCK) / BLOCK * BLOCK;
    let mut k0 = 0;
    while k0 < k {
        let kc = kc_max.min(k - k0);
        let kcp = round_up(kc, BLOCK);
        let a_chunk = MatRef { data: &a.data[k0 * a.cs..], cols: kc, ..a };
        let b_chunk = MatRef { data: &b.data[k0 * b.rs..], rows: kc, ..b };
        let packed_b = pack_b(&b_chunk, kcp, np);
        let accumulate = k0 > 0;
        // One task per 32-row block of C: it packs its rows of A, then walks every column block.
        c.par_chunks_mut(BLOCK * n).enumerate().for_each_init(
            || vec![0u16; BLOCK * kcp],
            |blk, (rb, c_rows)| {
                // SAFETY: a backend is available, and every backend implies the features.
                unsafe { pack_a_block(&a_chunk, rb * BLOCK, kcp, blk) };
                run_row_block(backend, blk, &packed_b, kcp, n, accumulate, c_rows);
            },
        );
        k0 += kc;
    }
    Ok(())
}

/// `c_rows` (up to 32 rows of C, `n` wide) = (`c_rows` if `accumulate`) + the packed A block ·
/// packed B.
fn run_row_block(
    backend: Bf16Backend,
    a: &[u16],
    b: &[u32],
    kp: usize,
    n: usize,
    accumulate: bool,
    c_rows: &mut [MaybeUninit<f32>],
) {
    #[cfg(target_arch = "x86_64")]
    {
        let rows = c_rows.len() / n;
        // Only values written by this call (or by the previous k chunk, when accumulating)
        // are ever read.
        let c_ptr = c_rows.as_mut_ptr() as *mut f32;
        let mut tmp = [0f32; BLOCK * BLOCK];
        if backend == Bf16Backend::Amx {
            // SAFETY: amx_available() was checked by matmul_into; tiles are configured per thread.
            unsafe { amx::configure() };
        }
        for c0 in (0..n).step_by(BLOCK) {
            let cols = BLOCK.min(n - c0);
            // Whole blocks are stored straight into C; edge blocks through `tmp`.
            let whole = rows == BLOCK && cols == BLOCK;
            // SAFETY (pointer arithmetic): c0 < n, inside the rows of c_rows.
            let (out, ldc) = if whole { (unsafe { c_ptr.add(c0) }, n) } else { (tmp.as_mut_ptr(), BLOCK) };
            if !whole && accumulate {
                tmp.fill(0.0);
                for r in 0..rows {
                    // SAFETY: the previous k chunk wrote these values; the ranges do not overlap.
                    unsafe {
                        std::ptr::copy_nonoverlapping(c_ptr.add(r * n + c0), tmp.as_mut_ptr().add(r * BLOCK), cols)
                    };
                }
            }
            // SAFETY: the packed buffers hold whole 32x32 blocks (padded); `out` has 32 rows of
            // `ldc` with 32 columns from it; the backend's instructions were detected at run time.
            unsafe {
                match backend {
                    Bf16Backend::Amx => amx::block(a, BLOCK * BLOCK, b, kp, c0, out, ldc, accumulate),
                    Bf16Backend::Avx512Bf16 => avx512::block(a, b, kp, c0, out, ldc, accumulate),
                }
            }
            if !whole {
                for r in 0..rows {
                    // SAFETY: row r, columns c0..c0+cols of c_rows; tmp is a separate buffer.
                    unsafe { std::ptr::copy_nonoverlapping(tmp.as_ptr().add(r * BLOCK), c_ptr.add(r * n + c0), cols) };
                }
            }
        }
        if backend == Bf16Backend::Amx {
            // SAFETY: as above; releases this thread's tile state.
            unsafe { amx::release() };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (backend, a, b, kp, n, accumulate, c_rows);
        unreachable!("no bf16 backend is available off x86_64");
    }
}

/// The slow reference: bf16-rounded inputs, products summed in f64, rounded to f32 once.
pub fn matmul_reference(a: MatRef, b: MatRef) -> Vec<f32> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0f64;
            for l in 0..k {
                s += bf16_to_f32(bf16_bits(a.at(i, l))) as f64 * bf16_to_f32(bf16_bits(b.at(l, j))) as f64;
            }
            c[i * n + j] = s as f32;
        }
    }
    c
}

#[cfg(target_arch = "x86_64")]
mod convert {
    use super::{bf16_bits, bf16_pair};
    use crate::tile::avx512::{lane_mask, transpose16};
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn to_bf16(src: &[f32], dst: &mut [u16]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 32 <= n {
            let lo = _mm512_loadu_ps(src.as_ptr().add(i));
            let hi = _mm512_loadu_ps(src.as_ptr().add(i + 16));
            // The second operand fills the low half.
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(dst.as_mut_ptr().add(i) as *mut __m512i, v);
            i += 32;
        }
        for j in i..n {
            dst[j] = bf16_bits(src[j]);
        }
    }

    /// The whole 32×32 chunk of a column-contiguous A at rows i0.., columns j0.. (both inside
    /// A) as 32 rows of 32 bf16 at `out`: column j's 16-value halves are contiguous, and two
    /// 16×16 transposes give each row's 32 values.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn transpose_chunk(a: &super::MatRef, i0: usize, j0: usize, out: *mut u16) {
        const B: usize = super::BLOCK;
        for half in 0..2 {
            let mut t = [[_mm512_setzero_ps(); 16]; 2];
            for (jh, tj) in t.iter_mut().enumerate() {
                for (jj, v) in tj.iter_mut().enumerate() {
                    let at = a.data.as_ptr().add((j0 + jh * 16 + jj) * a.cs + i0 + 16 * half);
                    // The next chunk's column: a stride the hardware prefetcher does not follow
                    // (§7.13 of docs/design.md). Any address may be prefetched.
                    _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(B * a.cs) as *const i8);
                    *v = _mm512_loadu_ps(at);
                }
                transpose16(tj);
            }
            for (r, (&lo, &hi)) in t[0].iter().zip(&t[1]).enumerate() {
                // The second operand fills the low half (columns 0..16).
                let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_storeu_si512(out.add((16 * half + r) * B) as *mut __m512i, v);
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn pair_row_into_panels(
        lo: &[f32],
        hi: Option<&[f32]>,
        panels: usize,
        out: *mut u32,
        panel_stride: usize,
    ) {
        let n = lo.len();
        for pi in 0..panels {
            let j = 16 * pi;
            let v = if j >= n {
                _mm512_setzero_si512()
            } else {
                match hi {
                    Some(hi) => _mm512_or_si512(halves(lo, j), _mm512_slli_epi32(halves(hi, j), 16)),
                    None => halves(lo, j),
                }
            };
            _mm512_storeu_si512(out.add(pi * panel_stride) as *mut __m512i, v);
        }
    }

    /// `row[j..j + 16]` (fewer past the row's end, as zeros) rounded to bf16, one per 32-bit lane
    /// (the low half).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn halves(row: &[f32], j: usize) -> __m512i {
        // Lanes past the row load as 0.0, whose bf16 is 0: the panels' zero padding.
        let mask = lane_mask(row.len() - j);
        let v: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, row.as_ptr().add(j))));
        _mm512_cvtepu16_epi32(v)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn to_bf16_pairs(lo: &[f32], hi: Option<&[f32]>, dst: &mut [u32]) {
        let n = dst.len();
        let mut j = 0;
        while j + 16 <= n {
            let l: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(lo.as_ptr().add(j))));
            let mut v = _mm512_cvtepu16_epi32(l);
            if let Some(hi) = hi {
                let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(hi.as_ptr().add(j))));
                v = _mm512_or_si512(v, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            }
            _mm512_storeu_si512(dst.as_mut_ptr().add(j) as *mut __m512i, v);
            j += 16;
        }
        for q in j..n {
            dst[q] = bf16_pair(lo[q], hi.map_or(0.0, |h| h[q]));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{BLOCK, PANEL};
    use std::arch::x86_64::*;

    /// out (32 rows of stride `ldc`, 32 columns) = (out if `accumulate`) + A block (packed
    /// `[kp/32][32][32]` bf16) · B columns c0..c0+32 (packed panels `[np/16][kp/2][16]`).
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn block(
        a: &[u16],
        b: &[u32],
        kp: usize,
        c0: usize,
        out: *mut f32,
        ldc: usize,
        accumulate: bool,
    ) {
        let pairs = kp / 2;
        let b0 = b.as_ptr().add((c0 / PANEL) * pairs * PANEL);
        let b1 = b0.add(pairs * PANEL);
        for rg in 0..BLOCK / 8 {
            let mut acc = [[_mm512_setzero_ps(); 2]; 8];
            if accumulate {
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let row = out.add((rg * 8 + r) * ldc);
                    *acc_r = [_mm512_loadu_ps(row), _mm512_loadu_ps(row.add(16))];
                }
            }
            for p in 0..pairs {
                let bv0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b0.add(p * PANEL) as *const __m512i));
                let bv1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b1.add(p * PANEL) as *const __m512i));
                // Pair p of row r sits in chunk p/16, at row r, values 2(p%16) and 2(p%16)+1.
                let arow = a.as_ptr().add((p / 16) * BLOCK * BLOCK + (rg * 8) * BLOCK + 2 * (p % 16));
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let pair = (arow.add(r * BLOCK) as *const i32).read_unaligned();
                    let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                    acc_r[0] = _mm512_dpbf16_ps(acc_r[0], av, bv0);
                    acc_r[1] = _mm512_dpbf16_ps(acc_r[1], av, bv1);
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                let row = out.add((rg * 8 + r) * ldc);
                _mm512_storeu_ps(row, acc_r[0]);
                _mm512_storeu_ps(row.add(16), acc_r[1]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx {
    use super::{BLOCK, PANEL};
    use std::arch::asm;
    use std::cell::Cell;

    thread_local! {
        /// Whether this thread's tiles hold [`configure`]'s configuration (cleared by
        /// [`release`]), so that the attention kernels' small products configure once per thread
        /// instead of once per product.
        static CONFIGURED: Cell<bool> = const { Cell::new(false) };
    }

    /// The 64-byte tile configuration (palette 1): tiles 0-7 all 16 rows of 64 bytes.
    #[repr(C, align(64))]
    struct TileConfig {
        palette: u8,
        start_row: u8,
        reserved: [u8; 14],
        colsb: [u16; 16],
        rows: [u8; 16],
    }

    /// Asks Linux for the AMX tile data state for this process (arch_prctl(ARCH_REQ_XCOMP_PERM,
    /// XFEATURE_XTILEDATA)); false if refused (old kernel, or a VM that hides it).
    #[cfg(target_os = "linux")]
    pub(super) fn request_permission() -> bool {
        const SYS_ARCH_PRCTL: i64 = 158;
        const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
        const XFEATURE_XTILEDATA: i64 = 18;
        let ret: i64;
        // SAFETY: a plain syscall with integer arguments; it changes only this process's permission.
        unsafe {
            asm!("syscall", inlateout("rax") SYS_ARCH_PRCTL => ret, in("rdi") ARCH_REQ_XCOMP_PERM,
                 in("rsi") XFEATURE_XTILEDATA, lateout("rcx") _, lateout("r11") _, options(nostack));
        }
        ret == 0
    }

    /// Loads the tile configuration on this thread (tile state is per thread).
    pub(super) unsafe fn configure() {
        let mut cfg = TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        for t in 0..8 {
            cfg.colsb[t] = 64;
            cfg.rows[t] = 16;
        }
        asm!("ldtilecfg [{}]", in(reg) &cfg as *const TileConfig, options(nostack));
        CONFIGURED.set(true);
    }

    /// [`configure`] unless this thread's tiles are configured already.
    ///
    /// # Safety
    /// The CPU has AMX and Linux gave this process its tile state (`amx_available()`).
    pub(crate) unsafe fn ensure_configured() {
        if !CONFIGURED.get() {
            configure();
        }
    }

    pub(super) unsafe fn release() {
        asm!("tilerelease", options(nostack, nomem));
        CONFIGURED.set(false);
    }

    /// out (32 rows of stride `ldc`, 32 columns) = (out if `accumulate`) + A block (32 rows of
    /// 32 bf16 per k block, the k blocks `a_step` values apart: `BLOCK²` in this module's
    /// packing `[kp/32][32][32]`, more in the attention tiles', whose k blocks hold every row) ·
    /// B columns c0..c0+32 (packed panels `[np/16][kp/2][16]`).
    /// Tiles: 0-3 accumulate C (rows 0-15 / 16-31 × cols 0-15 / 16-31), 4-5 hold A, 6-7 hold B.
    ///
    /// # Safety
    /// The tiles are configured on this thread; every tile read lies inside `a` and `b`; `out`
    /// has 32 writable rows of `ldc` with 32 columns each.
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn block(
        a: &[u16],
        a_step: usize,
        b: &[u32],
        kp: usize,
        c0: usize,
        out: *mut f32,
        ldc: usize,
        accumulate: bool,
    ) {
        // Every A and B tile is 16 rows of 64 consecutive bytes.
        let (sa, sb, sc) = (64usize, 64usize, ldc * 4);
        let pairs = kp / 2;
        let panel0 = b.as_ptr().add((c0 / PANEL) * pairs * PANEL);
        let panel1 = panel0.add(pairs * PANEL);
        let t = out;
        if accumulate {
            asm!(
                "tileloadd tmm0, [{t0} + {sc}*1]",
                "tileloadd tmm1, [{t1} + {sc}*1]",
                "tileloadd tmm2, [{t2} + {sc}*1]",
                "tileloadd tmm3, [{t3} + {sc}*1]",
                t0 = in(reg) t, t1 = in(reg) t.add(16), t2 = in(reg) t.add(16 * ldc), t3 = in(reg) t.add(16 * ldc + 16),
                sc = in(reg) sc,
                options(nostack, readonly),
            );
        } else {
            asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
        }
        for kc in 0..kp / 32 {
            let a0 = a.as_ptr().add(kc * a_step);
            let a1 = a0.add(16 * BLOCK);
            let b0 = panel0.add(kc * 16 * PANEL);
            let b1 = panel1.add(kc * 16 * PANEL);
            asm!(
                "tileloadd tmm4, [{a0} + {sa}*1]",
                "tileloadd tmm5, [{a1} + {sa}*1]",
                "tileloadd tmm6, [{b0} + {sb}*1]",
                "tileloadd tmm7, [{b1} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a0, a1 = in(reg) a1, b0 = in(reg) b0, b1 = in(reg) b1,
                sa = in(reg) sa, sb = in(reg) sb,
                options(nostack, readonly),
            );
        }
        asm!(
            "tilestored [{t0} + {sc}*1], tmm0",
            "tilestored [{t1} + {sc}*1], tmm1",
            "tilestored [{t2} + {sc}*1], tmm2",
            "tilestored [{t3} + {sc}*1], tmm3",
            t0 = in(reg) t, t1 = in(reg) t.add(16), t2 = in(reg) t.add(16 * ldc), t3 = in(reg) t.add(16 * ldc + 16),
            sc = in(reg) sc,
            options(nostack),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn backends() -> Vec<Bf16Backend> {
        [Bf16Backend::Amx, Bf16Backend::Avx512Bf16].into_iter().filter(|&b| bf16_backend_available(b)).collect()
    }

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect()
    }

    #[test]
    fn rounding_matches_the_definition() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: rounds up to even.
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(bf16_bits(-2.5), 0xc020);
        assert_eq!(bf16_bits(f32::MAX), 0x7f80, "overflow rounds to infinity");
        assert!(bf16_to_f32(bf16_bits(f32::NAN)).is_nan());
        assert_eq!(bf16_to_f32(bf16_bits(f32::INFINITY)), f32::INFINITY);
        assert_eq!(bf16_bits(1e-40), 0, "denormals flush to zero, as the hardware does");
        assert_eq!(bf16_bits(-1e-40), 0x8000);
    }

    #[test]
    fn vector_conversions_equal_the_scalar_definition() {
        // Ties, denormals, overflow, infinities, NaNs and ordinary values, over a length that
        // leaves a scalar tail after the 32-wide and 16-wide vector bodies.
        let mut xs = vec![
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            -1.0 - 3.0 / 256.0,
            1e-40,
            -1e-40,
            1.2e-38,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            0.0,
            -0.0,
            1.7,
            -2.5e10,
        ];
        xs.extend(random(37, 9));
        if !avx512bf16_available() {
            return;
        }
        let mut got = vec![0u16; xs.len()];
        // SAFETY: checked just above.
        unsafe { to_bf16(&xs, &mut got) };
        let want: Vec<u16> = xs.iter().map(|&x| bf16_bits(x)).collect();
        assert_eq!(got, want);
        let (lo, hi) = xs.split_at(xs.len() / 2);
        let mut pairs = vec![0u32; lo.len().min(hi.len())];
        let n = pairs.len();
        // SAFETY: as above.
        unsafe { to_bf16_pairs(&lo[..n], Some(&hi[..n]), &mut pairs) };
        for (j, &p) in pairs.iter().enumerate() {
            assert_eq!(p, bf16_pair(lo[j], hi[j]), "pair {j}");
        }
        // SAFETY: as above.
        unsafe { to_bf16_pairs(&lo[..n], None, &mut pairs) };
        for (j, &p) in pairs.iter().enumerate() {
            assert_eq!(p, bf16_bits(lo[j]) as u32, "lone {j}");
        }
    }

    #[test]
    fn every_backend_matches_the_reference_on_awkward_shapes() {
        // The last two span several k chunks (B packed in parts of ~512 KiB), with edge rows and columns.
        let shapes = [
            (1, 1, 1),
            (1, 7, 3),
            (5, 33, 17),
            (31, 32, 33),
            (33, 64, 32),
            (70, 100, 45),
            (64, 704, 256),
            (130, 3, 90),
            (45, 1000, 700),
            (33, 2100, 100),
        ];
        for backend in backends() {
            for (s, &(m, k, n)) in shapes.iter().enumerate() {
                let (ad, bd) = (random(m * k, s as u64), random(k * n, 100 + s as u64));
                let a = MatRef { data: &ad, rows: m, cols: k, rs: k, cs: 1 };
                let b = MatRef { data: &bd, rows: k, cols: n, rs: n, cs: 1 };
                let want = matmul_reference(a, b);
                let bound = abs_product(a, b);
                let mut got = vec![f32::NAN; m * n];
                matmul_into(backend, a, b, &mut got).unwrap();
                for (i, ((&g, &w), &s)) in got.iter().zip(&want).zip(&bound).enumerate() {
                    // Same bf16 inputs; only the f32 summation differs from the f64 sum, and
                    // that error is at most k·u·Σ|a·b| (u = 2^-24).
                    let tol = k as f32 * 6e-8 * s + 1e-30;
                    assert!((g - w).abs() <= tol, "{backend:?} {m}x{k}x{n} at {i}: {g} vs {w}");
                }
            }
        }
    }

    /// Σ_l |a_il·b_lj| of the bf16-rounded inputs (the scale of the summation error).
    fn abs_product(a: MatRef, b: MatRef) -> Vec<f32> {
        let abs = |m: MatRef| -> Vec<f32> { m.data.iter().map(|v| v.abs()).collect() };
        let (ad, bd) = (abs(a), abs(b));
        matmul_reference(MatRef { data: &ad, ..a }, MatRef { data: &bd, ..b })
    }

    #[test]
    fn strided_views_equal_contiguous_ones() {
        // A given transposed (column-major) and B as the transpose of a row-major [n, k] weight:
        // the layouts of the backward's operands.
        // k = 800 at n = 600 spans two k chunks.
        let (m, k, n) = (45, 800, 600);
        let at = random(k * m, 1); // [k, m]: A = atᵀ
        let w = random(n * k, 2); // [n, k]: B = wᵀ
        let a_t = MatRef { data: &at, rows: m, cols: k, rs: 1, cs: m };
        let b_t = MatRef { data: &w, rows: k, cols: n, rs: 1, cs: k };
        let a_c: Vec<f32> = (0..m * k).map(|x| a_t.at(x / k, x % k)).collect();
        let b_c: Vec<f32> = (0..k * n).map(|x| b_t.at(x / n, x % n)).collect();
        let a_c = MatRef { data: &a_c, rows: m, cols: k, rs: k, cs: 1 };
        let b_c = MatRef { data: &b_c, rows: k, cols: n, rs: n, cs: 1 };
        for backend in backends() {
            let mut strided = vec![0f32; m * n];
            let mut contiguous = vec![0f32; m * n];
            matmul_into(backend, a_t, b_t, &mut strided).unwrap();
            matmul_into(backend, a_c, b_c, &mut contiguous).unwrap();
            assert_eq!(strided, contiguous, "{backend:?}");
        }
    }

    #[test]
    fn transposed_equals_the_value_by_value_transpose() {
        // Block edges on both sides, one row or column, fewer values than a block, none.
        for (rows, cols) in [(0, 5), (5, 0), (1, 1), (1, 70), (70, 1), (31, 33), (64, 32), (100, 257)] {
            let x: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
            let want: Vec<f32> = (0..rows * cols).map(|v| x[(v % rows) * cols + v / rows]).collect();
            assert_eq!(transposed(&x, rows, cols), want, "{rows}x{cols}");
        }
    }

    #[test]
    fn transposed_packing_gives_the_row_major_packing_bits() {
        // pack_a_block on a column-contiguous A (whole 32×32 chunks by in-register transposes,
        // the rest value by value) against the same values row-major. Column strides above the
        // row count (a view into a wider matrix), partial row blocks and column chunks, and the
        // special values of the rounding (ties, denormals, NaN, infinities, overflow).
        if bf16_backend().is_none() {
            return;
        }
        let special = [1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, 1e-40, -1e-40, f32::NAN, f32::INFINITY, f32::MAX, -0.0];
        for (s, &(m, k, extra)) in [(32, 32, 0), (64, 96, 3), (45, 800, 0), (40, 33, 7), (96, 70, 1)].iter().enumerate()
        {
            let cs = m + extra;
            let mut at = random(k * cs, 50 + s as u64); // column j of A at at[j·cs ..]
            for (i, &v) in special.iter().enumerate() {
                at[(i * 37) % (k * cs)] = v;
            }
            let a_t = MatRef { data: &at, rows: m, cols: k, rs: 1, cs };
            let rm: Vec<f32> = (0..m * k).map(|x| a_t.at(x / k, x % k)).collect();
            let a_r = MatRef { data: &rm, rows: m, cols: k, rs: k, cs: 1 };
            let kp = round_up(k, BLOCK);
            for i0 in (0..m).step_by(BLOCK) {
                let (mut got, mut want) = (vec![0xffffu16; BLOCK * kp], vec![0xffffu16; BLOCK * kp]);
                // SAFETY: a backend exists, so the CPU has the packers' features.
                unsafe {
                    pack_a_block(&a_t, i0, kp, &mut got);
                    pack_a_block(&a_r, i0, kp, &mut want);
                }
                assert_eq!(got, want, "{m}x{k} (column stride {cs}), rows from {i0}");
            }
        }
    }

    #[test]
    fn both_b_packings_give_the_same_bits() {
        // pack_b on row-contiguous B (tasks over blocks of pairs, every panel) and on the same
        // values column-contiguous (a task per panel): odd k, k across several pair blocks,
        // partial and padding panels, padding pairs (kp > k).
        if bf16_backend().is_none() {
            return;
        }
        for (s, &(k, n)) in [(1, 1), (33, 17), (64, 33), (129, 100), (700, 48)].iter().enumerate() {
            let d = random(k * n, 70 + s as u64);
            let rows = MatRef { data: &d, rows: k, cols: n, rs: n, cs: 1 };
            let t: Vec<f32> = (0..n * k).map(|x| rows.at(x % k, x / k)).collect();
            let cols = MatRef { data: &t, rows: k, cols: n, rs: 1, cs: k };
            let (kp, np) = (round_up(k, BLOCK) + BLOCK, round_up(n, BLOCK) + BLOCK);
            assert_eq!(pack_b(&rows, kp, np), pack_b(&cols, kp, np), "{k}x{n}");
        }
    }

    #[test]
    fn exact_when_inputs_are_bf16_and_sums_small_integers() {
        // Small integers are exact in bf16 and their sums exact in f32: every backend is exact.
        let (m, k, n) = (40, 96, 50);
        let ad: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 9) as f32 - 4.0).collect();
        let bd: Vec<f32> = (0..k * n).map(|i| ((i * 5) % 7) as f32 - 3.0).collect();
        let a = MatRef { data: &ad, rows: m, cols: k, rs: k, cs: 1 };
        let b = MatRef { data: &bd, rows: k, cols: n, rs: n, cs: 1 };
        let want = matmul_reference(a, b);
        for backend in backends() {
            let mut got = vec![0f32; m * n];
            matmul_into(backend, a, b, &mut got).unwrap();
            assert_eq!(got, want, "{backend:?}");
        }
    }

    #[test]
    fn bf16_outpaces_f32_on_amx_and_on_amd_avx512bf16_only() {
        use Bf16Backend::{Amx, Avx512Bf16};
        for (backend, intel, forced, want) in [
            (None, false, false, false),
            (None, true, true, false),
            (Some(Amx), true, false, true),
            (Some(Avx512Bf16), false, false, true),
            (Some(Avx512Bf16), true, false, false),
            (Some(Avx512Bf16), true, true, true),
        ] {
            assert_eq!(bf16_outpaces_f32(backend, intel, forced), want, "{backend:?} intel {intel} forced {forced}");
        }
    }

    #[test]
    fn only_avx512_bf16_forces_the_kernel_and_other_values_warn() {
        assert_eq!(forced_by(None), Ok(false));
        assert_eq!(forced_by(Some("")), Ok(false));
        assert_eq!(forced_by(Some("avx512_bf16")), Ok(true));
        for typo in ["amx", "AVX512_BF16", "avx512bf16"] {
            let warning = forced_by(Some(typo)).unwrap_err();
            assert!(warning.contains(typo) && warning.contains("avx512_bf16"), "{warning}");
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let d = vec![0f32; 12];
        let a = MatRef { data: &d, rows: 3, cols: 4, rs: 4, cs: 1 };
        let b = MatRef { data: &d, rows: 3, cols: 4, rs: 4, cs: 1 };
        for backend in backends() {
            let mut c = vec![0f32; 12];
            assert!(matmul_into(backend, a, b, &mut c).unwrap_err().contains("A is 3x4"));
            let big = MatRef { data: &d, rows: 4, cols: 4, rs: 4, cs: 1 };
            assert!(matmul_into(backend, a, big, &mut c[..12]).unwrap_err().contains("reaches element"));
        }
    }
}
