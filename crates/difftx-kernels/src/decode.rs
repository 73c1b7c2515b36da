//! Kernels of one decode step: plain f32 slices, one new token per sequence, no autograd.
//!
//! Decoding a token costs a few matrix-vector products and one attention row per head; through
//! tensor ops each of those is a separate allocation, dispatch and (for candle's gemm) a thread
//! hand-off, which at batch 1 costs more than the arithmetic. These functions are what a fused
//! decode step is built from (`difftx_core::Decoder`, crates/difftx-core/src/model/decode.rs):
//!
//! * [`matmul_packed`]: `y = x·Wᵀ` for a few rows `x`, the Linear weight packed once
//!   ([`PackedWeight`]) into panels of 64 output columns read front to back in chunks that stay
//!   in L1, the sums kept in registers; panels are split across `team`'s threads when the
//!   product is large enough to pay.
//! * [`softmax_scores`]: one query's attention weights over its cached keys.
//! * [`weighted_values`]: `out += Σ_s p_s·v_s` over cached values.
//! * [`swiglu_rows`] computes `silu(gate)·up`.
//! * [`rms_norm_rows`] and [`rope_heads`]: the training kernels' forwards on slices.
//!
//! Each is compiled three times (baseline x86-64, AVX2+FMA, AVX-512F) and picked at run time, as in
//! `flash.rs`; `*_at(isa, ..)` variants let the tests check every level against the reference.

/// Multiply-accumulates per task below which `matmul_packed` stays on one thread. The split runs
/// on `team`'s helpers, which spin between a decode step's products, so a split costs a store and
/// a few hundred nanoseconds of waiting rather than waking a sleeping thread (as through rayon,
/// where 64K was the best from a pool thread and 512K from outside it; docs/design.md §7.7).
/// Measured on the 2-core Xeon (§7.13): 16K, which also splits the 256 × 256 products (o_proj,
/// the byte-vocabulary head), decoded 3-7% faster at batch 1 than 64K.
const MIN_MACS_PER_TASK: usize = 16 * 1024;

/// `$kernel::<R, ..>(at, y)` for the number of rows left in `at` (1 to 3, else 4): the row-group
/// dispatch of the pair kernels.
macro_rules! by_rows {
    ($at:expr, $y:expr, $kernel:ident $(, $extra:ident)?) => {
        match $at.rows() {
            1 => $kernel::<1 $(, $extra)?>($at, $y),
            2 => $kernel::<2 $(, $extra)?>($at, $y),
            3 => $kernel::<3 $(, $extra)?>($at, $y),
            _ => $kernel::<4 $(, $extra)?>($at, $y),
        }
    };
}

/// The generic bodies; `#[inline(always)]` so each ISA wrapper compiles its own copy.
mod body {
    use super::{Element, HeadCache, OutColumns, PanelElement, KV_CHUNK};
    use crate::float::{fast_exp_f32, max_slice, sum_slice};

    /// `y[r, col0 + k] = Σ_i x[r, i]·W[i, k]` for one packed panel of w <= 64 columns (laid out as
    /// [`super::PackedWeight`] says) and every row of x, into columns of y. The panel is taken
    /// in chunks of `CHUNK` inputs (16 KiB of f32) that stay in L1 while every row and column
    /// pass uses them, so it is read from memory once per call; with several rows the first row
    /// group's passes also ask for the next chunk, so that memory is read while this one is
    /// multiplied (a single row is bound by memory either way). Rows go `RG` at a time so each
    /// weight load serves several rows, with `RG × CB` sums in registers (no horizontal
    /// reductions), the rest as one last group; a single row keeps all 64, two rows `CB2`. `CB`
    /// (the columns summed per pass) fits the register file: 64 with AVX-512's 32 wide registers,
    /// 16 with AVX2's 16, where 4 × 64 sums (and 3 × 32) spilled to the stack. AVX2 takes six rows
    /// a group (12 registers of sums, two of weights, one broadcast): on a Zen 3, 15-30% more
    /// multiply-adds per second than four from five rows up, the same below (design.md §7.41).
    /// The sums carry over chunks through y, in input order, so the result depends on neither
    /// `CB` nor `CHUNK`. `FMA` picks fused
    /// multiply-adds (only where the CPU has them).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub fn panel<
        E: PanelElement,
        const FMA: bool,
        const WIDE: u8,
        const RG: usize,
        const CB: usize,
        const CB2: usize,
    >(
        x: &[f32],
        in_dim: usize,
        panel: &[E],
        w: usize,
        y: &mut OutColumns<'_>,
        col0: usize,
    ) {
        let rows = x.len() / in_dim;
        if w < super::PANEL {
            return narrow::<E, FMA>(x, in_dim, panel, w, y, col0);
        }
        for i0 in (0..in_dim).step_by(super::CHUNK) {
            let inputs = i0..(i0 + super::CHUNK).min(in_dim);
            let mut r0 = 0;
            while r0 < rows {
                let at = Chunk { x, in_dim, panel, inputs: inputs.clone(), r0, col0 };
                r0 += match (rows - r0).min(RG) {
                    group if group == RG => chunk::<E, RG, CB, FMA, WIDE>(at, y),
                    1 => chunk::<E, 1, { super::PANEL }, FMA, WIDE>(at, y),
                    2 => chunk::<E, 2, CB2, FMA, WIDE>(at, y),
                    3 => chunk::<E, 3, CB, FMA, WIDE>(at, y),
                    4 => chunk::<E, 4, CB, FMA, WIDE>(at, y),
                    _ => chunk::<E, 5, CB, FMA, WIDE>(at, y),
                };
            }
        }
    }

    /// Asks for the cache line at `p` to be brought into L1 (a hint: any address is allowed).
    #[inline(always)]
    fn prefetch<E>(p: *const E) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch never faults and does not change memory.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
        };
    }

    /// Asks for the lines holding `n` elements from `p` (a hint, as [`prefetch`]).
    #[inline(always)]
    fn prefetch_run<E>(p: *const E, n: usize) {
        for e in (0..n).step_by(64 / std::mem::size_of::<E>()) {
            prefetch(p.wrapping_add(e));
        }
    }

    /// Where a head's chunk c + 1 starts, or past its last chunk (of `len` positions) the next
    /// head's first chunk, `head_chunk` elements after this head's: what the attention kernels
    /// ask for while they work on chunk c.
    #[inline(always)]
    fn next_chunk<E>(elems: &[E], c: usize, len: usize, chunk_stride: usize, head_chunk: usize) -> *const E {
        let at = if (c + 1) * KV_CHUNK < len { (c + 1) * chunk_stride } else { head_chunk };
        elems.as_ptr().wrapping_add(at)
    }

    #[inline(always)]
    fn madd<const FMA: bool>(acc: f32, a: f32, b: f32) -> f32 {
        if FMA {
            a.mul_add(b, acc)
        } else {
            acc + a * b
        }
    }

    /// Where one call of [`chunk`] works: rows r0.. of `x` (`[rows, in_dim]`) over the panel's
    /// `inputs`, into the panel's 64 columns from `col0` of `y`.
    struct Chunk<'a, E> {
        x: &'a [f32],
        in_dim: usize,
        panel: &'a [E],
        inputs: std::ops::Range<usize>,
        r0: usize,
        col0: usize,
    }

    impl<'a, E: PanelElement> Chunk<'a, E> {
        /// Rows r0..r0 + R of x cut to the inputs, the inputs' blocks of the panel (b columns
        /// each, `[len, b]`) and their number `len`.
        #[inline(always)]
        fn rows_and_blocks<const R: usize>(&self) -> ([&'a [f32]; R], &'a [E], usize) {
            let (x, in_dim, r0, inputs) = (self.x, self.in_dim, self.r0, &self.inputs);
            let xs = std::array::from_fn(|r| &x[(r0 + r) * in_dim + inputs.start..(r0 + r) * in_dim + inputs.end]);
            (xs, &self.panel[inputs.start * super::PANEL..inputs.end * super::PANEL], inputs.len())
        }
    }

    /// The weights of the G columns from `col` in a chunk's blocks (b columns each, `[len, b]`):
    /// input i's are `run[i * b..][..G]`, within their block.
    #[inline(always)]
    fn group_run<E: PanelElement>(blocks: &[E], len: usize, col: usize) -> &[E] {
        let b = E::BLOCK;
        &blocks[col / b * len * b + col % b..(col / b + 1) * len * b]
    }

    /// Rows r0..r0 + R of a full panel over `inputs`, `CB` columns per pass; returns R. The plain
    /// code runs in the baseline variant; the AVX2 and AVX-512 variants go to their intrinsics.
    #[inline(always)]
    fn chunk<E: PanelElement, const R: usize, const CB: usize, const FMA: bool, const WIDE: u8>(
        at: Chunk<'_, E>,
        y: &mut OutColumns<'_>,
    ) -> usize {
        #[cfg(target_arch = "x86_64")]
        match WIDE {
            // SAFETY: WIDE is 2 only in the variant compiled for (and picked on) CPUs with AVX-512F.
            2 => return unsafe { avx512_chunk::<E, R>(at, y) },
            // SAFETY: WIDE is 1 only in the variant compiled for (and picked on) CPUs with AVX2+FMA.
            1 => return unsafe { avx2_chunk::<E, R, CB>(at, y) },
            _ => {}
        }
        const C: usize = super::PANEL;
        const G: usize = super::WIDEN;
        let b = E::BLOCK;
        let (xs, blocks, len) = at.rows_and_blocks::<R>();
        let (r0, first) = (at.r0, at.inputs.start == 0);
        let mut rows = y.rows_mut::<R>(r0, at.col0, C);
        for c in (0..C).step_by(CB) {
            let mut acc = [[0f32; CB]; R];
            if !first {
                for (a, row) in acc.iter_mut().zip(&rows) {
                    a.copy_from_slice(&row[c..c + CB]);
                }
            }
            // The CB / G groups of G columns this pass reads (of the chunk's C / G).
            let runs: [&[E]; C / G] =
                std::array::from_fn(|j| if j < CB / G { group_run(blocks, len, c + j * G) } else { &[] });
            for i in 0..len {
                let mut wf = [0f32; CB];
                for (run, dst) in runs.iter().zip(wf.chunks_exact_mut(G)) {
                    if R > 1 && r0 == 0 {
                        // The same place in the next chunk (of the same length but the last).
                        // bf16 and int8 lines hold several groups, so a line may be asked for
                        // more than once; asking once per line measured no faster.
                        prefetch(run.as_ptr().wrapping_add(len * C + i * b));
                    }
                    for (d, v) in dst.iter_mut().zip(&run[i * b..i * b + G]) {
                        *d = v.to_f32();
                    }
                }
                for r in 0..R {
                    let xv = xs[r][i];
                    for k in 0..CB {
                        acc[r][k] = madd::<FMA>(acc[r][k], xv, wf[k]);
                    }
                }
            }
            for (a, row) in acc.iter().zip(rows.iter_mut()) {
                row[c..c + CB].copy_from_slice(a);
            }
        }
        R
    }

    /// [`chunk`] for AVX-512 with its sums in registers, written out: the plain code widened the
    /// 64 columns into a stack array and read them back (a store and a reload per 16 columns, and
    /// two 32-byte stores read back as one 64-byte load stall), and its compiled form came and
    /// went with unrelated edits (design.md §7.12). The same fused multiply-adds in the same
    /// order as [`avx2_chunk`]: the same bits (tested).
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn avx512_chunk<E: PanelElement, const R: usize>(at: Chunk<'_, E>, y: &mut OutColumns<'_>) -> usize {
        use std::arch::x86_64::*;
        const C: usize = super::PANEL;
        const G: usize = super::WIDEN;
        const GROUPS: usize = C / G;
        let b = E::BLOCK;
        let (xs, blocks, len) = at.rows_and_blocks::<R>();
        let (r0, first) = (at.r0, at.inputs.start == 0);
        // Group j: columns 16j..16j + 16.
        let runs: [&[E]; GROUPS] = std::array::from_fn(|j| group_run(blocks, len, j * G));
        let rows = y.rows_mut::<R>(r0, at.col0, C);
        // SAFETY (every intrinsic below): AVX-512F is present (the caller's contract); loads and
        // stores stay inside `rows` (64 floats each) and `runs` (slices checked by indexing).
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); GROUPS]; R];
            if !first {
                for (a, row) in acc.iter_mut().zip(&rows) {
                    for (j, v) in a.iter_mut().enumerate() {
                        *v = _mm512_loadu_ps(row[j * G..].as_ptr());
                    }
                }
            }
            for i in 0..len {
                let xv: [__m512; R] = std::array::from_fn(|r| _mm512_set1_ps(xs[r][i]));
                for (j, run) in runs.iter().enumerate() {
                    if R > 1 && r0 == 0 {
                        // The same place in the next chunk, as in `chunk`.
                        prefetch(run.as_ptr().wrapping_add(len * C + i * b));
                    }
                    let w = E::load_avx512(run[i * b..i * b + G].try_into().unwrap());
                    for (a, &xr) in acc.iter_mut().zip(&xv) {
                        a[j] = _mm512_fmadd_ps(xr, w, a[j]);
                    }
                }
            }
            for (a, row) in acc.iter().zip(rows) {
                for (j, v) in a.iter().enumerate() {
                    _mm512_storeu_ps(row[j * G..j * G + G].as_mut_ptr(), *v);
                }
            }
        }
        R
    }

    /// [`chunk`] for AVX2 with its sums in registers, as [`avx512_chunk`] is for AVX-512: the plain
    /// code widened each 16 columns into a stack array and read them back. `CB` columns per pass
    /// (`CB / 8` registers of sums per row; 64, 32 or 16 as in `panel`), the same fused
    /// multiply-adds in the same order as the AVX-512 variant: the same bits (tested).
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn avx2_chunk<E: PanelElement, const R: usize, const CB: usize>(
        at: Chunk<'_, E>,
        y: &mut OutColumns<'_>,
    ) -> usize {
        use std::arch::x86_64::*;
        const C: usize = super::PANEL;
        const G: usize = super::WIDEN;
        let b = E::BLOCK;
        let (xs, blocks, len) = at.rows_and_blocks::<R>();
        let (r0, first) = (at.r0, at.inputs.start == 0);
        let mut rows = y.rows_mut::<R>(r0, at.col0, C);
        for c in (0..C).step_by(CB) {
            // The CB / G groups of G columns this pass reads, as in `chunk`.
            let runs: [&[E]; C / G] =
                std::array::from_fn(|j| if j < CB / G { group_run(blocks, len, c + j * G) } else { &[] });
            // SAFETY (every intrinsic below): AVX2 and FMA are present (the caller's contract);
            // loads and stores go through slices of CB floats of y and G weights of a run.
            unsafe {
                // Register 2g + h of a row: columns c + 16g + 8h.. + 8; only the first CB / 8 used.
                let mut acc = [[_mm256_setzero_ps(); C / 8]; R];
                if !first {
                    for (a, row) in acc.iter_mut().zip(&rows) {
                        let row = &row[c..c + CB];
                        for (k, v) in a.iter_mut().take(CB / 8).enumerate() {
                            *v = _mm256_loadu_ps(row[8 * k..].as_ptr());
                        }
                    }
                }
                for i in 0..len {
                    // With several groups (one or two rows) each row's broadcast serves them all,
                    // made once; with one (three rows or more) each is made just before its two
                    // multiply-adds, one live at a time: made first, LLVM kept all six of a
                    // six-row group in registers and spilled sums to the stack instead.
                    let xv: [__m256; R] = if CB > G {
                        std::array::from_fn(|r| _mm256_set1_ps(xs[r][i]))
                    } else {
                        [_mm256_setzero_ps(); R]
                    };
                    for (g, run) in runs.iter().take(CB / G).enumerate() {
                        if R > 1 && r0 == 0 {
                            // The same place in the next chunk, as in `chunk`.
                            prefetch(run.as_ptr().wrapping_add(len * C + i * b));
                        }
                        let w = E::load_avx2(run[i * b..i * b + G].try_into().unwrap());
                        for (r, a) in acc.iter_mut().enumerate() {
                            let xr = if CB > G { xv[r] } else { _mm256_set1_ps(xs[r][i]) };
                            a[2 * g] = _mm256_fmadd_ps(xr, w[0], a[2 * g]);
                            a[2 * g + 1] = _mm256_fmadd_ps(xr, w[1], a[2 * g + 1]);
                        }
                    }
                }
                for (a, row) in acc.iter().zip(rows.iter_mut()) {
                    let row = &mut row[c..c + CB];
                    for (k, v) in a.iter().take(CB / 8).enumerate() {
                        _mm256_storeu_ps(row[8 * k..8 * k + 8].as_mut_ptr(), *v);
                    }
                }
            }
        }
        R
    }

    /// The last panel, narrower than 64 columns: one row at a time.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn narrow<E: PanelElement, const FMA: bool>(
        x: &[f32],
        in_dim: usize,
        panel: &[E],
        w: usize,
        y: &mut OutColumns<'_>,
        col0: usize,
    ) {
        for (r, xr) in x.chunks_exact(in_dim).enumerate() {
            let yr = &mut y.row(r)[col0..col0 + w];
            yr.fill(0.0);
            for (wi, &xv) in panel.chunks_exact(w).zip(xr) {
                for (yv, &wv) in yr.iter_mut().zip(wi) {
                    *yv = madd::<FMA>(*yv, xv, wv.to_f32());
                }
            }
        }
    }

    /// Scores of the `KV_CHUNK` positions of one chunk of keys (`[d, KV_CHUNK]`): the sums run
    /// over the d key features with every position's partial sum in registers.
    #[inline(always)]
    fn score_chunk<E: Element, const FMA: bool>(q: &[f32], chunk: &[E], next: *const E) -> [f32; KV_CHUNK] {
        let mut acc = [0f32; KV_CHUNK];
        for (i, (&qi, k)) in q.iter().zip(chunk.chunks_exact(KV_CHUNK)).enumerate() {
            prefetch_run(next.wrapping_add(i * KV_CHUNK), KV_CHUNK);
            let k: &[E; KV_CHUNK] = k.try_into().unwrap();
            for j in 0..KV_CHUNK {
                acc[j] = madd::<FMA>(acc[j], qi, k[j].to_f32());
            }
        }
        acc
    }

    #[inline(always)]
    pub fn softmax_scores<E: Element, const FMA: bool>(q: &[f32], keys: HeadCache<'_, E>, scale: f32, p: &mut [f32]) {
        let HeadCache { elems: keys, chunk_stride, scales: key_scales } = keys;
        // A partly filled last chunk is scored whole (its unused positions hold zeros or stale
        // keys, finite either way) and only its filled positions kept: by the latency count no
        // slower than a quarter of it in 16-wide blocks, whose two or four sums per feature wait
        // on the multiply-add latency, and without the one-position-at-a-time tail there was.
        let (chunk_len, len) = (q.len() * KV_CHUNK, p.len());
        for (c, pc) in p.chunks_mut(KV_CHUNK).enumerate() {
            let next = next_chunk(keys, c, len, chunk_stride, chunk_len);
            let acc = score_chunk::<E, FMA>(q, &keys[c * chunk_stride..c * chunk_stride + chunk_len], next);
            match key_scales {
                None => pc.iter_mut().zip(acc).for_each(|(p, a)| *p = a * scale),
                Some(s) => pc.iter_mut().zip(acc).zip(s.chunk(c)).for_each(|((p, a), k)| *p = a * k * scale),
            }
        }
        let max = max_slice(p, f32::NEG_INFINITY);
        p.iter_mut().for_each(|v| *v = fast_exp_f32(*v - max));
        let inv = 1.0 / sum_slice(p);
        p.iter_mut().for_each(|v| *v *= inv);
    }

    /// Output features whose sums `weighted_values` keeps in registers at a time.
    const VALUE_COLS: usize = 32;

    /// `acc[..v.len()] += w·v` (a function, not a closure: a closure would not inherit the
    /// caller's target features).
    #[inline(always)]
    fn add_row<E: Element, const FMA: bool>(acc: &mut [f32; VALUE_COLS], w: f32, v: &[E]) {
        for (a, &x) in acc.iter_mut().zip(v) {
            *a = madd::<FMA>(*a, w, x.to_f32());
        }
    }

    /// `Σ_s p_s·v_s[off..off + width]` (`width` is `VALUE_COLS` where `FULL`, which lets the
    /// compiler unroll it), the values `dv` wide in chunks of `KV_CHUNK` rows. Even and odd
    /// positions are summed apart and added at the end: one set of sums would wait on the
    /// multiply-add latency at every row (four registers of sums for 32 features on AVX2).
    #[inline(always)]
    fn sum_rows<E: Element, const FULL: bool, const FMA: bool>(
        p: &[f32],
        values: HeadCache<'_, E>,
        dv: usize,
        (off, width): (usize, usize),
    ) -> [f32; VALUE_COLS] {
        let width = if FULL { VALUE_COLS } else { width };
        let HeadCache { elems: values, chunk_stride, scales: value_scales } = values;
        let (mut even, mut odd) = ([0f32; VALUE_COLS], [0f32; VALUE_COLS]);
        for (c, pc) in p.chunks(KV_CHUNK).enumerate() {
            // Scaled values (int8 codes): each position's weight takes its value's scale.
            let scaled: [f32; KV_CHUNK];
            let pc = match value_scales {
                None => pc,
                Some(s) => {
                    let k = s.chunk(c);
                    scaled = std::array::from_fn(|j| if j < pc.len() { pc[j] * k[j] } else { 0.0 });
                    &scaled[..pc.len()]
                }
            };
            let rows = &values[c * chunk_stride..c * chunk_stride + pc.len() * dv];
            // Asked for by the first block of columns only.
            let next = next_chunk(values, c, p.len(), chunk_stride, KV_CHUNK * dv);
            for (k, (w, two)) in pc.chunks_exact(2).zip(rows.chunks_exact(2 * dv)).enumerate() {
                if off == 0 {
                    prefetch_run(next.wrapping_add(2 * k * dv), 2 * dv);
                }
                add_row::<E, FMA>(&mut even, w[0], &two[off..off + width]);
                add_row::<E, FMA>(&mut odd, w[1], &two[dv + off..dv + off + width]);
            }
            if pc.len() % 2 == 1 {
                let last = (pc.len() - 1) * dv + off;
                add_row::<E, FMA>(&mut even, pc[pc.len() - 1], &rows[last..last + width]);
            }
        }
        std::array::from_fn(|k| even[k] + odd[k])
    }

    /// `out += Σ_s p_s·v_s`, `VALUE_COLS` output features at a time.
    #[inline(always)]
    pub fn weighted_values<E: Element, const FMA: bool>(p: &[f32], values: HeadCache<'_, E>, out: &mut [f32]) {
        let dv = out.len();
        for (oc, off) in out.chunks_mut(VALUE_COLS).zip((0..).step_by(VALUE_COLS)) {
            let acc = if oc.len() == VALUE_COLS {
                sum_rows::<E, true, FMA>(p, values, dv, (off, VALUE_COLS))
            } else {
                sum_rows::<E, false, FMA>(p, values, dv, (off, oc.len()))
            };
            oc.iter_mut().zip(acc).for_each(|(o, a)| *o += a);
        }
    }

    /// bf16 weights as pairs along the inputs ([`super::PackedWeight`]'s bf16 panel, `[pairs, 64]`
    /// u32) times the rows of `xp` (`[rows, pairs]`, each row's inputs rounded to bf16 pairs):
    /// `y[r, col0 + c] = Σ_p hi(x)·hi(w) + lo(x)·lo(w)`, each pair's high product added first, as
    /// `vdpbf16ps` adds them (the products of two bf16 values are exact in f32). The arithmetic of
    /// [`super::pairs_native`] where the CPU lacks it. Chunks of `CHUNK_PAIRS` pairs stay in L1
    /// while every group of up to 4 rows uses them; the sums carry over chunks through y.
    #[inline(always)]
    pub fn panel_pairs<const FMA: bool>(xp: &[u32], pairs: usize, panel: &[u32], y: &mut OutColumns<'_>, col0: usize) {
        pair_chunks(xp, pairs, panel, y, col0, |at, y| by_rows!(at, y, pair_rows, FMA))
    }

    /// The loop every pair kernel runs: chunk by chunk, the rows in groups handed to `group`
    /// (which takes up to four, [`PairRows::rows`], and returns how many it took).
    #[inline(always)]
    pub(super) fn pair_chunks(
        xp: &[u32],
        pairs: usize,
        panel: &[u32],
        y: &mut OutColumns<'_>,
        col0: usize,
        mut group: impl FnMut(PairRows<'_>, &mut OutColumns<'_>) -> usize,
    ) {
        let rows = xp.len() / pairs;
        for p0 in (0..pairs).step_by(super::CHUNK_PAIRS) {
            let chunk = p0..(p0 + super::CHUNK_PAIRS).min(pairs);
            let mut r0 = 0;
            while r0 < rows {
                r0 += group(PairRows { xp, pairs, panel, chunk: chunk.clone(), r0, col0 }, y);
            }
        }
    }

    /// Where one call of [`pair_rows`] works: rows r0.. of `xp` over the pairs `chunk` of
    /// `panel`, into the panel's 64 columns from `col0` of `y`.
    pub(super) struct PairRows<'a> {
        pub(super) xp: &'a [u32],
        pub(super) pairs: usize,
        pub(super) panel: &'a [u32],
        pub(super) chunk: std::ops::Range<usize>,
        pub(super) r0: usize,
        pub(super) col0: usize,
    }

    impl PairRows<'_> {
        /// Rows left from r0.
        pub(super) fn rows(&self) -> usize {
            self.xp.len() / self.pairs - self.r0
        }

        /// Rows r0..r0 + R of y cut to the panel's 64 columns, after checking that the chunk
        /// lies in the panel and in xp (the SIMD kernels read them through unchecked pointers).
        pub(super) fn checked_rows<'y, const R: usize>(&self, y: &'y mut OutColumns<'_>) -> [&'y mut [f32]; R] {
            assert!(self.chunk.end * super::PANEL <= self.panel.len() && (self.r0 + R) * self.pairs <= self.xp.len());
            y.rows_mut::<R>(self.r0, self.col0, super::PANEL)
        }
    }

    /// The f32 values of a pair's low (even input) and high (odd input) halves.
    #[inline(always)]
    pub(super) fn halves(pair: u32) -> (f32, f32) {
        (f32::from_bits(pair << 16), f32::from_bits(pair & 0xffff_0000))
    }

    /// Rows r0..r0 + R of [`panel_pairs`] over one chunk; returns R.
    #[inline(always)]
    fn pair_rows<const R: usize, const FMA: bool>(at: PairRows<'_>, y: &mut OutColumns<'_>) -> usize {
        const C: usize = super::PANEL;
        let rows = at.checked_rows::<R>(y);
        let PairRows { xp, pairs, panel, chunk, r0, .. } = at;
        let mut acc = [[0f32; C]; R];
        if chunk.start > 0 {
            for (a, row) in acc.iter_mut().zip(&rows) {
                a.copy_from_slice(row);
            }
        }
        for p in chunk {
            let w = &panel[p * C..(p + 1) * C];
            let (mut lo, mut hi) = ([0f32; C], [0f32; C]);
            for ((l, h), &pair) in lo.iter_mut().zip(hi.iter_mut()).zip(w) {
                (*l, *h) = halves(pair);
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let (xl, xh) = halves(xp[(r0 + r) * pairs + p]);
                for k in 0..C {
                    a[k] = madd::<FMA>(madd::<FMA>(a[k], xh, hi[k]), xl, lo[k]);
                }
            }
        }
        for (a, row) in acc.iter().zip(rows) {
            row.copy_from_slice(a);
        }
        R
    }

    #[inline(always)]
    pub fn swiglu_rows(gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + fast_exp_f32(-g)) * u;
        }
    }
}

/// One module of entry points per instruction-set level: the bodies compiled with `$feat` enabled
/// (none for `base`), fused multiply-adds where `$fma`, the packed product's inner loop written
/// out in AVX2 (`$wide` 1) or AVX-512 (2) intrinsics.
macro_rules! isa_variants {
    ($m:ident, $fma:literal, $wide:literal, $rg:literal, $cb:literal, $cb2:literal $(, $feat:literal)?) => {
        mod $m {
            use super::{body, Element, HeadCache, OutColumns};
            $(#[target_feature(enable = $feat)])?
            pub unsafe fn panel(x: &[f32], in_dim: usize, p: &[f32], w: usize, y: &mut OutColumns<'_>, col0: usize) {
                body::panel::<f32, $fma, $wide, $rg, $cb, $cb2>(x, in_dim, p, w, y, col0)
            }
            $(#[target_feature(enable = $feat)])?
            pub unsafe fn panel_i8(x: &[f32], in_dim: usize, p: &[i8], w: usize, y: &mut OutColumns<'_>, col0: usize) {
                body::panel::<i8, $fma, $wide, $rg, $cb, $cb2>(x, in_dim, p, w, y, col0)
            }
            $(#[target_feature(enable = $feat)])?
            pub unsafe fn softmax_scores<E: Element>(q: &[f32], keys: HeadCache<'_, E>, scale: f32, p: &mut [f32]) {
                body::softmax_scores::<E, $fma>(q, keys, scale, p)
            }
            $(#[target_feature(enable = $feat)])?
            pub unsafe fn weighted_values<E: Element>(p: &[f32], values: HeadCache<'_, E>, out: &mut [f32]) {
                body::weighted_values::<E, $fma>(p, values, out)
            }
            $(#[target_feature(enable = $feat)])?
            pub unsafe fn swiglu_rows(gate: &[f32], up: &[f32], out: &mut [f32]) {
                body::swiglu_rows(gate, up, out)
            }
        }
    };
}
#[cfg(target_arch = "x86_64")]
isa_variants!(avx512, true, 2, 4, 64, 64, "avx512f,avx2,fma");
#[cfg(target_arch = "x86_64")]
isa_variants!(avx2, true, 1, 6, 16, 32, "avx2,fma");
// Baseline x86-64 (or another architecture): no FMA, whose software fallback would be slow.
isa_variants!(base, false, 0, 4, 16, 16);

/// Calls `$f` of the best variant at level `$isa`.
macro_rules! dispatch {
    ($isa:expr, $f:ident($($a:expr),*)) => {{
        match crate::cpu::isa_level($isa) {
            // SAFETY: `isa_level` returned 2 / 1 only after checking the CPU has those features.
            #[cfg(target_arch = "x86_64")]
            2 => unsafe { avx512::$f($($a),*) },
            #[cfg(target_arch = "x86_64")]
            1 => unsafe { avx2::$f($($a),*) },
            // SAFETY: the baseline variant needs no CPU feature.
            _ => unsafe { base::$f($($a),*) },
        }
    }};
}

/// `vdpbf16ps` on the pairs of [`body::panel_pairs`]: the same sums, 32 multiply-adds per
/// instruction (16 pairs), about twice the rate of widening bf16 weights to f32 for FMA on the
/// Zen 4 (design.md §7.23). Only where the CPU has AVX512_BF16.
#[cfg(target_arch = "x86_64")]
mod pairs_native {
    use super::body::{pair_chunks, PairRows};
    use super::OutColumns;
    use std::arch::x86_64::*;

    /// [`body::panel_pairs`](super::body::panel_pairs) by `vdpbf16ps`.
    ///
    /// # Safety
    /// The CPU must have AVX512F and AVX512_BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn panel_pairs(xp: &[u32], pairs: usize, panel: &[u32], y: &mut OutColumns<'_>, col0: usize) {
        // SAFETY: the caller's contract.
        pair_chunks(xp, pairs, panel, y, col0, |at, y| unsafe { by_rows!(at, y, rows_dp) })
    }

    /// How far ahead (in pairs of inputs, 256 bytes each) [`rows_dp`] asks for the panel: with
    /// the hardware prefetcher alone a row streamed bf16 weights at ~40 GB/s where f32's
    /// four-block panels reach ~47 on the Xeon model 207; 16 ahead measured 4–11% faster there
    /// (docs/design.md §7.27; not measured on AMD).
    const PREFETCH_PAIRS: usize = 16;

    /// Rows r0..r0 + R over one chunk, the 64 columns' sums of each row in four registers.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn rows_dp<const R: usize>(at: PairRows<'_>, y: &mut OutColumns<'_>) -> usize {
        const C: usize = super::PANEL;
        let mut rows = at.checked_rows::<R>(y);
        let PairRows { xp, pairs, panel, chunk, r0, .. } = at;
        // SAFETY (every intrinsic below): the features are the caller's contract; y's rows hold 64
        // floats, the panel 64 pairs per pair index, xp `pairs` per row (checked).
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); 4]; R];
            if chunk.start > 0 {
                for (a, row) in acc.iter_mut().zip(&rows) {
                    for (g, v) in a.iter_mut().enumerate() {
                        *v = _mm512_loadu_ps(row[16 * g..16 * g + 16].as_ptr());
                    }
                }
            }
            for p in chunk {
                if r0 == 0 {
                    // The four lines of the pair PREFETCH_PAIRS ahead (past the chunk too), which
                    // the first group of rows asks for.
                    for g in 0..4 {
                        let ahead = panel.as_ptr().wrapping_add((p + PREFETCH_PAIRS) * C + 16 * g);
                        _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                    }
                }
                let w: [__m512bh; 4] = std::array::from_fn(|g| {
                    std::mem::transmute(_mm512_loadu_si512(panel.as_ptr().add(p * C + 16 * g) as *const __m512i))
                });
                for (r, a) in acc.iter_mut().enumerate() {
                    let x: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(*xp.get_unchecked((r0 + r) * pairs + p) as i32));
                    for (v, &wg) in a.iter_mut().zip(&w) {
                        *v = _mm512_dpbf16_ps(*v, x, wg);
                    }
                }
            }
            for (a, row) in acc.iter().zip(rows.iter_mut()) {
                for (g, v) in a.iter().enumerate() {
                    _mm512_storeu_ps(row[16 * g..16 * g + 16].as_mut_ptr(), *v);
                }
            }
        }
        R
    }
}

/// [`body::panel_pairs`] in AVX2 intrinsics (the plain code's widening into arrays does not stay
/// in registers): 16 columns per pass, so that four rows' sums, the pair row's two halves and the
/// broadcasts fit AVX2's 16 registers. The same fused multiply-adds in the same order as the
/// plain code with FMA: the same bits. Runs at AVX-512 too where the CPU lacks AVX512_BF16.
#[cfg(target_arch = "x86_64")]
mod pairs_avx2 {
    use super::body::{halves, pair_chunks, PairRows};
    use super::OutColumns;
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn panel_pairs(xp: &[u32], pairs: usize, panel: &[u32], y: &mut OutColumns<'_>, col0: usize) {
        // SAFETY: the caller's contract.
        pair_chunks(xp, pairs, panel, y, col0, |at, y| unsafe { by_rows!(at, y, rows_fma) })
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_fma<const R: usize>(at: PairRows<'_>, y: &mut OutColumns<'_>) -> usize {
        const C: usize = super::PANEL;
        let mut rows = at.checked_rows::<R>(y);
        let PairRows { xp, pairs, panel, chunk, r0, .. } = at;
        // Each row's pairs of the chunk split into their f32 halves once, [low, high] per pair,
        // so that the passes below broadcast them from memory (a load) rather than from a
        // register (a vector instruction beside the multiply-adds, two per row and pair).
        let mut split = [[0f32; 2 * super::CHUNK_PAIRS]; R];
        for (r, h) in split.iter_mut().enumerate() {
            for (p, pair) in chunk.clone().enumerate() {
                // SAFETY: checked_rows checked that xp holds rows r0..r0 + R of every pair.
                (h[2 * p], h[2 * p + 1]) = halves(unsafe { *xp.get_unchecked((r0 + r) * pairs + pair) });
            }
        }
        // SAFETY (every intrinsic below): the features are the caller's contract; the bounds as
        // in pairs_native (checked).
        unsafe {
            let high = _mm256_set1_epi32(0xffff_0000u32 as i32);
            for c in (0..C).step_by(16) {
                let mut acc = [[_mm256_setzero_ps(); 2]; R];
                if chunk.start > 0 {
                    for (a, row) in acc.iter_mut().zip(&rows) {
                        for (h, v) in a.iter_mut().enumerate() {
                            *v = _mm256_loadu_ps(row[c + 8 * h..c + 8 * h + 8].as_ptr());
                        }
                    }
                }
                for (q, p) in chunk.clone().enumerate() {
                    let w: [__m256i; 2] = std::array::from_fn(|h| {
                        _mm256_loadu_si256(panel.as_ptr().add(p * C + c + 8 * h) as *const __m256i)
                    });
                    let lo = w.map(|v| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v)));
                    let hi = w.map(|v| _mm256_castsi256_ps(_mm256_and_si256(v, high)));
                    for (a, h) in acc.iter_mut().zip(&split) {
                        let (xl, xh) = (_mm256_broadcast_ss(&h[2 * q]), _mm256_broadcast_ss(&h[2 * q + 1]));
                        for (h, v) in a.iter_mut().enumerate() {
                            *v = _mm256_fmadd_ps(xl, lo[h], _mm256_fmadd_ps(xh, hi[h], *v));
                        }
                    }
                }
                for (a, row) in acc.iter().zip(rows.iter_mut()) {
                    for (h, v) in a.iter().enumerate() {
                        _mm256_storeu_ps(row[c + 8 * h..c + 8 * h + 8].as_mut_ptr(), *v);
                    }
                }
            }
        }
        R
    }
}

/// Pairs of inputs per chunk of a bf16 panel: 32 pairs × 64 columns of u32 (8 KiB), kept in L1
/// while every row group of a call uses them.
const CHUNK_PAIRS: usize = 32;

/// Output columns per packed panel.
const PANEL: usize = 64;
/// Inputs per chunk of a full panel (64 × 64 f32: 16 KiB, kept in L1 while every row uses it).
const CHUNK: usize = 64;
/// Bytes of one input's weights in a block of columns within a chunk: one cache line, so that a
/// pass over any of a block's columns brings in whole lines, and consecutive inputs' lines follow
/// one another (16 columns of f32, 64 of int8: the whole panel).
const BLOCK_BYTES: usize = 64;
/// Columns widened to f32 at a time: AVX2's 16 sums per row, the narrowest pass.
const WIDEN: usize = 16;

/// A value the kernels read and widen to f32: an f32, a bf16 (a KV cache's keys and values) or an
/// int8 code (packed weights).
pub trait Element: Copy + Send + Sync {
    fn to_f32(self) -> f32;
}

/// An element of the weights [`matmul_packed`]'s f32 panels read (f32, int8 codes; bf16 weights
/// have panels of pairs of their own, `PackedData::Bf16`).
pub trait PanelElement: Element {
    /// Columns per block within a chunk of a packed panel (`BLOCK_BYTES` per input).
    const BLOCK: usize = BLOCK_BYTES / std::mem::size_of::<Self>();

    /// `WIDEN` (16) weights widened to f32 in two AVX2 registers (columns 0..8, 8..16), written
    /// out rather than left to the compiler: its vectorisation of the plain loop came and went
    /// with unrelated changes elsewhere in this file (once making int8 batch-1 decode 7× slower).
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load_avx2(src: &[Self; WIDEN]) -> [std::arch::x86_64::__m256; 2];

    /// `WIDEN` (16) weights widened to f32 in one AVX-512 register.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load_avx512(src: &[Self; WIDEN]) -> std::arch::x86_64::__m512;
}

// The AVX2 widenings below take 16 weights as two halves of 8.
const _: () = assert!(WIDEN == 16);

impl Element for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl PanelElement for f32 {
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load_avx2(src: &[f32; WIDEN]) -> [std::arch::x86_64::__m256; 2] {
        // SAFETY: src is 16 floats.
        unsafe { std::array::from_fn(|h| std::arch::x86_64::_mm256_loadu_ps(src.as_ptr().add(8 * h))) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_avx512(src: &[f32; WIDEN]) -> std::arch::x86_64::__m512 {
        // SAFETY: src is 16 floats.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(src.as_ptr()) }
    }
}

/// A bfloat16: the top 16 bits of an f32 (8 exponent bits, 7 mantissa bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Bf16(pub u16);

impl Bf16 {
    /// Rounds to the nearest bf16, ties to even (the one definition:
    /// [`crate::bf16_matmul::bf16_bits`]).
    pub fn from_f32(x: f32) -> Self {
        Bf16(crate::bf16_matmul::bf16_bits(x))
    }
}

impl Element for Bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

/// An element of a cache of keys and values ([`softmax_scores`], [`weighted_values`]): f32; bf16
/// rounded to nearest even when written and widened to f32 when read; or an int8 code, each
/// position of a head (its `d` keys, or its `d` values) stored as codes times a scale of its own
/// ([`PositionScales`]).
pub trait KvElement: Element + Default {
    /// Whether a head's position is stored as codes times a scale (see [`KvElement::scale_for`]).
    const SCALED: bool = false;

    /// The element that holds `x`, a value divided by its position's scale where `SCALED`.
    fn from_f32(x: f32) -> Self;

    /// The scale of a head's position whose largest magnitude is `absmax` (1 where not `SCALED`).
    fn scale_for(_absmax: f32) -> f32 {
        1.0
    }
}

impl KvElement for f32 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl KvElement for Bf16 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        Bf16::from_f32(x)
    }
}

/// Symmetric int8: a position's codes are x / scale rounded to nearest (ties to even) with
/// scale = max|x| / 127, so each value is held to half a step, 1/254 of the largest.
impl KvElement for i8 {
    const SCALED: bool = true;

    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        // Adding and taking away 1.5·2^23 rounds to an integer (ties to even) for |x| < 2^22
        // without libm's `roundf`, a call per value here (2.5% of a 32-sequence step's samples).
        const ROUND: f32 = 12_582_912.0;
        ((x.clamp(-127.0, 127.0) + ROUND) - ROUND) as i8
    }

    fn scale_for(absmax: f32) -> f32 {
        absmax / 127.0
    }
}

/// The codes of `x` at `E`'s precision, written by `put(i, code)`, and their scale (1 where `E` is
/// not scaled): the one encoding of a cached position (the decoder's writes and the tests').
pub fn encode_position<E: KvElement>(x: &[f32], mut put: impl FnMut(usize, E)) -> f32 {
    if !E::SCALED {
        x.iter().enumerate().for_each(|(i, &v)| put(i, E::from_f32(v)));
        return 1.0;
    }
    let scale = E::scale_for(x.iter().fold(0f32, |m, v| m.max(v.abs())));
    // All zeros: codes 0, scale 0.
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    x.iter().enumerate().for_each(|(i, &v)| put(i, E::from_f32(v * inv)));
    scale
}

/// One kv head's cached keys (or values) as [`softmax_scores`] and [`weighted_values`] read them:
/// `elems` from the head's part of the first chunk on, chunk c starting `c · chunk_stride` later
/// ([`KV_CHUNK`]), and for scaled elements (int8) each position's scale.
#[derive(Debug)]
pub struct HeadCache<'a, E> {
    pub elems: &'a [E],
    pub chunk_stride: usize,
    pub scales: Option<PositionScales<'a>>,
}

// By hand: derived, they would ask `E: Copy`.
impl<E> Clone for HeadCache<'_, E> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<E> Copy for HeadCache<'_, E> {}

impl<'a, E> HeadCache<'a, E> {
    /// A head's elements as they are (f32, bf16): no scales.
    pub fn unscaled(elems: &'a [E], chunk_stride: usize) -> Self {
        HeadCache { elems, chunk_stride, scales: None }
    }
}

/// One scale per cached position of a head, for caches of scaled elements (int8): position s's
/// is `scales[s / KV_CHUNK * chunk_stride + s % KV_CHUNK]`, chunked as its keys and values are
/// ([`KV_CHUNK`]), so the heads of a layer can share chunks (`[chunks, heads, KV_CHUNK]`).
#[derive(Debug, Clone, Copy)]
pub struct PositionScales<'a> {
    pub scales: &'a [f32],
    pub chunk_stride: usize,
}

impl<'a> PositionScales<'a> {
    /// The scales of chunk `c`'s positions (those held; at most `KV_CHUNK`).
    #[inline(always)]
    fn chunk(&self, c: usize) -> &'a [f32] {
        let from = c * self.chunk_stride;
        &self.scales[from..self.scales.len().min(from + KV_CHUNK)]
    }

    /// Panics unless the scales cover `len` positions and their chunks do not overlap.
    fn check(&self, len: usize, kernel: &str) {
        if let Some(last) = len.checked_sub(1) {
            assert!(last < KV_CHUNK || self.chunk_stride >= KV_CHUNK, "{kernel}: scale chunks overlap");
            assert!(
                self.scales.len() > last / KV_CHUNK * self.chunk_stride + last % KV_CHUNK,
                "{kernel}: scales too short"
            );
        }
    }
}

/// How a decoder's cache stores keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvPrecision {
    #[default]
    F32,
    /// bf16: half the bytes read per cached position, the products and sums still f32. Several
    /// sequences decoded together read their caches from memory (docs/design.md §7.22).
    Bf16,
    /// int8, one f32 scale per position of a head (`encode_position`): a quarter of f32's bytes
    /// plus the scales (9/32 of f32 at d = 32), the products and sums still f32.
    Int8,
}

impl std::str::FromStr for KvPrecision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(KvPrecision::F32),
            "bf16" => Ok(KvPrecision::Bf16),
            "int8" => Ok(KvPrecision::Int8),
            _ => Err(format!("unknown KV cache precision '{s}' (expected f32, bf16 or int8)")),
        }
    }
}

impl Element for i8 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
}

impl PanelElement for i8 {
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load_avx2(src: &[i8; WIDEN]) -> [std::arch::x86_64::__m256; 2] {
        use std::arch::x86_64::*;
        // SAFETY: src is 16 bytes.
        unsafe {
            let codes = _mm_loadu_si128(src.as_ptr() as *const __m128i);
            let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
            let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(codes)));
            [lo, hi]
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_avx512(src: &[i8; WIDEN]) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: src is 16 bytes.
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src.as_ptr() as *const __m128i))) }
    }
}

/// The symmetric int8 code of `w` at `scale` (the weight is `code · scale`).
pub fn int8_code(w: f32, scale: f32) -> i8 {
    (w / scale).round().clamp(-127.0, 127.0) as i8
}

/// The scale of one output channel's weights for int8: `max |w| / 127` (1 for an all-zero channel).
pub fn int8_scale(row: &[f32]) -> f32 {
    let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
    if max > 0.0 {
        max / 127.0
    } else {
        1.0
    }
}

/// How a packed weight stores its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightPrecision {
    F32,
    /// bf16 storage (half the bytes to stream per token) and bf16 products: each product's
    /// inputs rounded to bf16 as well, the sums f32 (the arithmetic of training's `--precision
    /// bf16` linear layers), by `vdpbf16ps` where the CPU has AVX512_BF16; everything between
    /// the products stays f32.
    Bf16,
    /// Symmetric int8 per output channel (`w ≈ code · scale_o`, a quarter of the bytes); the
    /// codes are widened to f32 and each output scaled once, activations stay f32.
    Int8,
}

impl std::str::FromStr for WeightPrecision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(WeightPrecision::F32),
            "bf16" => Ok(WeightPrecision::Bf16),
            "int8" => Ok(WeightPrecision::Int8),
            _ => Err(format!("unknown precision '{s}' (expected f32, bf16 or int8)")),
        }
    }
}

#[derive(Debug, Clone)]
enum PackedData {
    F32(Vec<f32>),
    /// Pairs of inputs' bf16 values (low half: the even input), every panel `[pairs, 64]`
    /// (columns past `out` and an odd last input's high half zero): one pair row of 16 columns
    /// is what `vdpbf16ps` multiplies.
    Bf16(Vec<u32>),
    /// Codes, and one scale per output column.
    Int8(Vec<i8>, Vec<f32>),
}

/// A Linear layer's weight (`[out, in]`, PyTorch's layout) re-laid out for [`matmul_packed`]:
/// panels of 64 output columns stored one after the other. In f32 and int8 a full panel is a run
/// of chunks of 64 inputs (the last one shorter), each chunk blocks of one cache line's columns
/// (`PanelElement::BLOCK`: four blocks of 16 in f32, one of 64 in int8), each block `[inputs, columns]`;
/// the last panel, when narrower, is `[in, width]`. A pass over some of a chunk's columns then
/// reads whole lines, one input after another. (With plain `[in, 64]` f32 panels AVX2's 16-column
/// passes over several rows read 64 of every 256 bytes, and ran at half the speed of the same
/// product from cache; docs/design.md §7.7 has the measurements.) In bf16 every panel is pairs
/// of inputs (see `PackedData::Bf16`), a pair row of 64 columns being four cache lines.
#[derive(Debug, Clone)]
pub struct PackedWeight {
    data: PackedData,
    in_dim: usize,
    out: usize,
}

impl PackedWeight {
    /// Packs `w` (`[out, in]`, row-major) in f32.
    pub fn from_rows(w: &[f32], in_dim: usize) -> Self {
        Self::from_rows_as(w, in_dim, WeightPrecision::F32)
    }

    /// Packs `w` (`[out, in]`, row-major), stored at `precision`.
    pub fn from_rows_as(w: &[f32], in_dim: usize, precision: WeightPrecision) -> Self {
        assert!(
            in_dim > 0 && w.len().is_multiple_of(in_dim),
            "PackedWeight: {} values are not rows of {in_dim}",
            w.len()
        );
        let out = w.len() / in_dim;
        let at = |(o, i): (usize, usize)| w[o * in_dim + i];
        let data = match precision {
            WeightPrecision::F32 => PackedData::F32(packed_order(out, in_dim, f32::BLOCK).map(at).collect()),
            WeightPrecision::Bf16 => PackedData::Bf16(bf16_pairs(w, in_dim)),
            WeightPrecision::Int8 => {
                let scales: Vec<f32> = w.chunks_exact(in_dim).map(int8_scale).collect();
                let order = packed_order(out, in_dim, i8::BLOCK);
                let codes = order.map(|oi| int8_code(at(oi), scales[oi.0])).collect();
                PackedData::Int8(codes, scales)
            }
        };
        PackedWeight { data, in_dim, out }
    }

    pub fn in_dim(&self) -> usize {
        self.in_dim
    }

    pub fn out_dim(&self) -> usize {
        self.out
    }

    /// Where panel p lies in the stored values, and its width in columns.
    fn panel_range(&self, p: usize) -> (std::ops::Range<usize>, usize) {
        let c0 = p * PANEL;
        let width = PANEL.min(self.out - c0);
        match self.data {
            // Every bf16 panel is padded to 64 columns of pairs.
            PackedData::Bf16(_) => {
                let len = self.in_dim.div_ceil(2) * PANEL;
                (p * len..(p + 1) * len, width)
            }
            _ => (c0 * self.in_dim..(c0 + width) * self.in_dim, width),
        }
    }
}

/// `w` (`[out, in]`) laid out as `PackedData::Bf16`.
fn bf16_pairs(w: &[f32], in_dim: usize) -> Vec<u32> {
    let (out, pairs) = (w.len() / in_dim, in_dim.div_ceil(2));
    let mut packed = vec![0u32; out.div_ceil(PANEL) * pairs * PANEL];
    for (o, row) in w.chunks_exact(in_dim).enumerate() {
        let panel = &mut packed[o / PANEL * pairs * PANEL..];
        for (i, &v) in row.iter().enumerate() {
            panel[i / 2 * PANEL + o % PANEL] |= (crate::bf16_matmul::bf16_bits(v) as u32) << (16 * (i % 2));
        }
    }
    packed
}

/// The rows of `x` (`[rows, in]`) rounded to bf16 as pairs along the inputs, `[rows, pairs]` (an
/// odd last input's high half zero); by AVX512_BF16's conversion where `native`, the same bits.
fn bf16_rows(x: &[f32], in_dim: usize, native: bool) -> Vec<u32> {
    let pairs = in_dim.div_ceil(2);
    let mut xp = vec![0u32; x.len() / in_dim * pairs];
    for (row, out) in x.chunks_exact(in_dim).zip(xp.chunks_exact_mut(pairs)) {
        if native {
            #[cfg(target_arch = "x86_64")]
            {
                // Consecutive inputs are a pair's low and high halves (x86 is little-endian), so
                // the row's bf16 values in order are its pairs.
                // SAFETY: the pairs' memory viewed as twice as many u16 (u32 is aligned for u16);
                // native implies AVX512_BF16 (matmul_packed_at checked it).
                unsafe {
                    let halves = std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u16, 2 * pairs);
                    crate::bf16_matmul::to_bf16(row, &mut halves[..in_dim]);
                }
                continue;
            }
        }
        for (p, o) in out.iter_mut().enumerate() {
            let hi = row.get(2 * p + 1).copied().unwrap_or(0.0);
            *o = crate::bf16_matmul::bf16_pair(row[2 * p], hi);
        }
    }
    xp
}

/// One bf16 panel (64 columns, `PackedData::Bf16`) times the rounded rows `xp` into y's columns
/// `col0..col0 + 64`: by `vdpbf16ps` where `native`, else the same sums by AVX2 FMA (from level
/// 1 up) or plain code.
#[allow(clippy::too_many_arguments)]
fn pairs_panel(isa: u8, native: bool, xp: &[u32], pairs: usize, panel: &[u32], y: &mut OutColumns<'_>, col0: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if native {
            // SAFETY: native implies AVX512F and AVX512_BF16 (matmul_packed_at checked them).
            return unsafe { pairs_native::panel_pairs(xp, pairs, panel, y, col0) };
        }
        if crate::cpu::isa_level(isa) >= 1 {
            // SAFETY: isa_level returned 1 or 2 only after checking the CPU has AVX2 and FMA.
            return unsafe { pairs_avx2::panel_pairs(xp, pairs, panel, y, col0) };
        }
    }
    // Baseline x86-64 (or another architecture): no FMA, as the other baseline kernels.
    body::panel_pairs::<false>(xp, pairs, panel, y, col0)
}

/// (output column, input) of each position of a [`PackedWeight`] in turn, its chunks in blocks of
/// `block` columns (`PanelElement::BLOCK` of the stored type).
fn packed_order(out: usize, in_dim: usize, block: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..out).step_by(PANEL).flat_map(move |c0| -> Box<dyn Iterator<Item = (usize, usize)>> {
        if out - c0 < PANEL {
            return Box::new((0..in_dim).flat_map(move |i| (c0..out).map(move |o| (o, i))));
        }
        Box::new((0..in_dim).step_by(CHUNK).flat_map(move |i0| {
            let inputs = i0..(i0 + CHUNK).min(in_dim);
            (c0..c0 + PANEL)
                .step_by(block)
                .flat_map(move |b0| inputs.clone().flat_map(move |i| (b0..b0 + block).map(move |o| (o, i))))
        }))
    })
}

/// Has every thread of `team` read each of `weights` at the same time: each thread multiplies
/// four zero rows by the whole weight (the kernels' row group, read as a batched step reads it),
/// all threads starting each weight together.
///
/// Why: on the 2-core Xeon model 207 a batch-1 decode step, in which each thread reads only its
/// own panels, ran at two speeds, ~2,200 or ~2,800 tokens/s for bench-s f32, and stayed at the
/// second only after both threads had read the weights at the same time (a prefill split by rows
/// did it; one thread reading them all, or each its own half, did not; docs/design.md §7.29).
/// The cause is not identified; the cost is one batch-of-eight step when a decoder is built.
pub fn read_on_every_thread(weights: &[&PackedWeight]) {
    const ROWS: usize = 4;
    let mut threads = vec![(); crate::team::participants()];
    for w in weights {
        crate::team::for_each_mut(&mut threads, |_, _| {
            let x = vec![0f32; ROWS * w.in_dim];
            let mut y = vec![0f32; ROWS * w.out];
            // Called from a team job, the product runs on this thread alone.
            matmul_packed(&x, w, &mut y);
        });
    }
}

/// `y = x·Wᵀ` for a Linear weight W: x `[rows, in]`, y `[rows, out]`.
pub fn matmul_packed(x: &[f32], w: &PackedWeight, y: &mut [f32]) {
    matmul_packed_at(crate::cpu::BEST_ISA, x, w, y)
}

/// `matmul_packed` with the instruction-set level capped at `isa`.
pub fn matmul_packed_at(isa: u8, x: &[f32], w: &PackedWeight, y: &mut [f32]) {
    let (in_dim, out) = (w.in_dim, w.out);
    assert!(x.len().is_multiple_of(in_dim), "matmul_packed: x is not rows of {in_dim}");
    let rows = x.len() / in_dim;
    assert_eq!(y.len(), rows * out, "matmul_packed: y must be [rows, out]");
    if rows == 0 || out == 0 {
        return;
    }
    // Tasks of at least MIN_MACS_PER_TASK multiply-adds, no more than threads, panels shared
    // out evenly (a 12-panel product on two threads is 6 + 6, not 8 + 4).
    let panels = out.div_ceil(PANEL);
    let threads = crate::team::participants();
    let tasks = (rows * in_dim * out / MIN_MACS_PER_TASK).clamp(1, threads.min(panels));
    let per_task = panels.div_ceil(tasks);
    // bf16 weights multiply the rows rounded to bf16 pairs (once per call, shared by the tasks).
    let native =
        crate::cpu::isa_level(isa) == 2 && crate::bf16_matmul::bf16_backend_available(crate::Bf16Backend::Avx512Bf16);
    let rounded = if let PackedData::Bf16(_) = w.data { bf16_rows(x, in_dim, native) } else { Vec::new() };
    // Panel p into `y`'s columns from `col0`.
    let run = |p: usize, y: &mut OutColumns<'_>, col0: usize| {
        let (range, width) = w.panel_range(p);
        match &w.data {
            PackedData::F32(d) => dispatch!(isa, panel(x, in_dim, &d[range], width, y, col0)),
            PackedData::Bf16(d) => {
                let (panel, pairs) = (&d[range], in_dim.div_ceil(2));
                if width == PANEL {
                    pairs_panel(isa, native, &rounded, pairs, panel, y, col0);
                } else {
                    // The last panel, padded to 64 columns: computed aside, its columns copied.
                    let mut full = vec![0f32; rows * PANEL];
                    pairs_panel(isa, native, &rounded, pairs, panel, &mut OutColumns::whole(&mut full, rows), 0);
                    for (r, f) in full.chunks_exact(PANEL).enumerate() {
                        y.row(r)[col0..col0 + width].copy_from_slice(&f[..width]);
                    }
                }
            }
            PackedData::Int8(d, scales) => {
                dispatch!(isa, panel_i8(x, in_dim, &d[range], width, y, col0));
                let scales = &scales[p * PANEL..p * PANEL + width];
                for r in 0..rows {
                    y.row(r)[col0..col0 + width].iter_mut().zip(scales).for_each(|(v, s)| *v *= s);
                }
            }
        }
    };
    // Each task writes its run of panels' columns of every row of y in place (no blocks of its
    // own to zero and copy back: those were ~6% of a 32-sequence step, design.md §7.31).
    let mut parts = OutColumns::split(y, rows, per_task * PANEL);
    crate::team::for_each_mut(&mut parts, |t, part| {
        for p in t * per_task..((t + 1) * per_task).min(panels) {
            run(p, part, (p - t * per_task) * PANEL);
        }
    });
}

/// Columns `first..first + cols` of every row of a row-major `[rows, ld]` output: what one task
/// of a split product writes. The views [`OutColumns::split`] makes of one output cover
/// disjoint columns, so each hands out `&mut` rows of its own columns while the others exist.
pub(crate) struct OutColumns<'a> {
    /// Row 0's first column.
    ptr: *mut f32,
    rows: usize,
    ld: usize,
    cols: usize,
    _out: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: a view is the only way to its columns (they are disjoint from any other view's of the
// same output, and the output stays borrowed for 'a), so it can move to another thread as a
// `&mut [f32]` can.
unsafe impl Send for OutColumns<'_> {}

impl<'a> OutColumns<'a> {
    /// All of `y` (`rows` rows, at least one).
    pub(crate) fn whole(y: &'a mut [f32], rows: usize) -> Self {
        let ld = y.len() / rows;
        assert_eq!(ld * rows, y.len(), "OutColumns: {} values are not {rows} rows", y.len());
        OutColumns { ptr: y.as_mut_ptr(), rows, ld, cols: ld, _out: std::marker::PhantomData }
    }

    /// `y` (`rows` rows, at least one) cut into runs of `width` columns (the last what is left).
    pub(crate) fn split(y: &'a mut [f32], rows: usize, width: usize) -> Vec<Self> {
        let whole = Self::whole(y, rows);
        let ld = whole.ld;
        (0..ld)
            .step_by(width.max(1))
            .map(|c0| OutColumns {
                // SAFETY: c0 < ld, so the pointer stays inside y.
                ptr: unsafe { whole.ptr.add(c0) },
                cols: width.min(ld - c0),
                ..whole
            })
            .collect()
    }

    /// Row r's columns of this view.
    pub(crate) fn row(&mut self, r: usize) -> &mut [f32] {
        assert!(r < self.rows, "OutColumns: row {r} of {}", self.rows);
        // SAFETY: row r's `cols` values from `ptr + r·ld` lie inside the output (cols <= ld -
        // the view's first column) and belong to this view alone; `&mut self` keeps them unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r * self.ld), self.cols) }
    }

    /// Rows r0..r0 + R, each cut to columns `c0..c0 + n` of this view.
    pub(crate) fn rows_mut<const R: usize>(&mut self, r0: usize, c0: usize, n: usize) -> [&mut [f32]; R] {
        assert!(r0 + R <= self.rows && c0 + n <= self.cols, "OutColumns: rows {r0}+{R}, columns {c0}+{n}");
        // SAFETY: as in `row`; distinct rows are disjoint (n <= cols <= ld).
        std::array::from_fn(|r| unsafe { std::slice::from_raw_parts_mut(self.ptr.add((r0 + r) * self.ld + c0), n) })
    }
}

/// RMSNorm of every row of `x` (rows of `gain.len()`) times `gain`: the training kernel's forward
/// (`rms_norm.rs`) on slices, on the calling thread (the decoder splits a pass's rows over its
/// team itself; the training forward's rayon split would have a team thread wait on the pool).
pub fn rms_norm_rows(x: &[f32], gain: &[f32], eps: f64, y: &mut [f32]) {
    crate::rms_norm::rms_norm_fwd(x, Some(gain), y, gain.len(), eps)
}

/// RoPE of one position's heads `x` (`[heads, d]`) into `y`, given that position's rows of the
/// cos / sin tables (`[d/2]`): the training kernel's forward (`rope.rs`) on slices.
pub fn rope_heads(x: &[f32], y: &mut [f32], cos: &[f32], sin: &[f32], d: usize, interleaved: bool) {
    crate::rope::rope_kernel(x, y, cos, sin, (1, 1, x.len() / d.max(1), d), interleaved, false)
}

/// Positions per chunk of a cache of keys and values. A head's keys are stored chunk by chunk,
/// each chunk feature-major (`[d, KV_CHUNK]`: the scores of a chunk's positions are summed side
/// by side), and its values chunk by chunk, each position-major (`[KV_CHUNK, dv]`); chunk c starts
/// `c · chunk_stride` after chunk 0, so the heads of a layer can share chunks
/// (`difftx_core::Decoder`'s cache: `[chunks, heads, ..]`) and a cache grows by appending chunks.
/// A head's chunk is then one contiguous run of memory, which the hardware prefetcher follows:
/// keys stored `[d, capacity]` were read as d separate streams of 256 bytes (docs/design.md §7.7).
pub const KV_CHUNK: usize = 64;

/// Where feature `i` of key `s` lies in a head's keys (see [`KV_CHUNK`]).
pub fn key_offset(s: usize, i: usize, chunk_stride: usize) -> usize {
    s / KV_CHUNK * chunk_stride + i * KV_CHUNK + s % KV_CHUNK
}

/// Where value `s` (`dv` features) starts in a head's values (see [`KV_CHUNK`]).
pub fn value_offset(s: usize, dv: usize, chunk_stride: usize) -> usize {
    s / KV_CHUNK * chunk_stride + s % KV_CHUNK * dv
}

/// One query's attention weights over `p.len()` cached keys: `p_s = softmax_s(q·k_s·scale)`, the
/// keys ([`KvElement`]: f32, bf16, or int8 codes times their scales) chunked as [`KV_CHUNK`] says,
/// each chunk `[q.len(), KV_CHUNK]`. The last chunk must be whole (positions past `p.len()` are
/// read, holding anything finite, and ignored).
pub fn softmax_scores<E: Element>(q: &[f32], keys: HeadCache<'_, E>, scale: f32, p: &mut [f32]) {
    softmax_scores_at(crate::cpu::BEST_ISA, q, keys, scale, p)
}

/// `softmax_scores` with the instruction-set level capped at `isa`.
pub fn softmax_scores_at<E: Element>(isa: u8, q: &[f32], keys: HeadCache<'_, E>, scale: f32, p: &mut [f32]) {
    if !p.is_empty() {
        let (chunks, stride) = (p.len().div_ceil(KV_CHUNK), keys.chunk_stride);
        assert!(chunks == 1 || stride >= q.len() * KV_CHUNK, "softmax_scores: chunks overlap");
        assert!(keys.elems.len() >= (chunks - 1) * stride + q.len() * KV_CHUNK, "softmax_scores: keys too short");
        if let Some(s) = keys.scales {
            s.check(p.len(), "softmax_scores");
        }
        dispatch!(isa, softmax_scores(q, keys, scale, p))
    }
}

/// `out += Σ_s p_s·v_s`, value `s` being `dv = out.len()` features (f32, bf16, or int8 codes times
/// their scales) chunked as [`KV_CHUNK`] says, each chunk `[KV_CHUNK, dv]`. The weights may be
/// signed (diff-v1's and diff-v2's `p1 − λ·p2`).
pub fn weighted_values<E: Element>(p: &[f32], values: HeadCache<'_, E>, out: &mut [f32]) {
    weighted_values_at(crate::cpu::BEST_ISA, p, values, out)
}

/// `weighted_values` with the instruction-set level capped at `isa`.
pub fn weighted_values_at<E: Element>(isa: u8, p: &[f32], values: HeadCache<'_, E>, out: &mut [f32]) {
    if let Some(last) = p.len().checked_sub(1) {
        let (dv, stride) = (out.len(), values.chunk_stride);
        assert!(last < KV_CHUNK || stride >= KV_CHUNK * dv, "weighted_values: chunks overlap");
        assert!(values.elems.len() >= value_offset(last, dv, stride) + dv, "weighted_values: values too short");
        if let Some(s) = values.scales {
            s.check(p.len(), "weighted_values");
        }
        dispatch!(isa, weighted_values(p, values, out))
    }
}

/// `out = silu(gate)·up` element-wise (fast exp, relative error ~2e-7).
pub fn swiglu_rows(gate: &[f32], up: &[f32], out: &mut [f32]) {
    swiglu_rows_at(crate::cpu::BEST_ISA, gate, up, out)
}

/// `swiglu_rows` with the instruction-set level capped at `isa`.
pub fn swiglu_rows_at(isa: u8, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == out.len() && up.len() == out.len(), "swiglu_rows: lengths differ");
    dispatch!(isa, swiglu_rows(gate, up, out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, rng: &mut rand::rngs::StdRng) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    #[test]
    fn matmul_packed_matches_f64_on_awkward_shapes_at_every_level() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        // (rows, in, out): odd widths, one row, widths below and above the 32-lane block, and
        // products large enough to be split across threads, each task writing its own columns of
        // every row of y: one row (704; 257, whose last task ends in a one-column panel) and
        // several.
        for &(rows, in_dim, out) in &[
            (1, 1, 1),
            (1, 37, 13),
            (3, 31, 5),
            (2, 33, 70),
            (1, 256, 704),
            (1, 300, 257),
            (5, 300, 257),
            (9, 64, 130),
            (7, 129, 128),
            (16, 256, 768),
        ] {
            let x = random(rows * in_dim, &mut rng);
            let w = random(out * in_dim, &mut rng);
            // x·Wᵀ in f64 for weights as stored (f32 as is, bf16 rounded, int8 dequantised) and
            // inputs as multiplied (bf16 weights multiply inputs rounded to bf16).
            let product = |x: &[f32], w: &[f32]| -> Vec<f64> {
                (0..rows * out)
                    .map(|i| {
                        let (r, o) = (i / out, i % out);
                        (0..in_dim).map(|k| x[r * in_dim + k] as f64 * w[o * in_dim + k] as f64).sum()
                    })
                    .collect()
            };
            let bf16 = |v: &[f32]| -> Vec<f32> { v.iter().map(|&v| Bf16::from_f32(v).to_f32()).collect() };
            let w_int8: Vec<f32> = w
                .chunks_exact(in_dim)
                .flat_map(|row| {
                    let s = int8_scale(row);
                    row.iter().map(move |&v| int8_code(v, s) as f32 * s)
                })
                .collect();
            let cases = [
                (WeightPrecision::F32, product(&x, &w)),
                (WeightPrecision::Bf16, product(&bf16(&x), &bf16(&w))),
                (WeightPrecision::Int8, product(&x, &w_int8)),
            ];
            let tol = 1e-5 * (1.0 + in_dim as f64).sqrt();
            for (precision, want) in &cases {
                let packed = PackedWeight::from_rows_as(&w, in_dim, *precision);
                let at = |isa: u8| {
                    let mut y = vec![f32::NAN; rows * out];
                    matmul_packed_at(isa, &x, &packed, &mut y);
                    y
                };
                for isa in 0..=crate::cpu::BEST_ISA {
                    for (g, e) in at(isa).iter().zip(want) {
                        assert!(
                            (*g as f64 - e).abs() < tol,
                            "{precision:?} isa {isa} {rows}x{in_dim}x{out}: {g} vs {e}"
                        );
                    }
                }
                // The AVX-512 and AVX2 kernels take the same fused multiply-adds in the same
                // order: the same bits (where the CPU has both; elsewhere both calls run one
                // level). bf16 at the top level may run `vdpbf16ps`, whose rounding of a pair's
                // two additions is the CPU's (the Zen 4 gives the same bits): compared to f64 above.
                let bits = |y: Vec<f32>| y.into_iter().map(f32::to_bits).collect::<Vec<_>>();
                if *precision != WeightPrecision::Bf16 {
                    assert_eq!(bits(at(1)), bits(at(2)), "{precision:?} {rows}x{in_dim}x{out}");
                }
            }
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(Bf16::from_f32(1.0).to_f32(), 1.0);
        // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to the even one (1).
        assert_eq!(Bf16::from_f32(1.0 + 2f32.powi(-8)).to_f32(), 1.0);
        assert_eq!(Bf16::from_f32(1.0 + 3.0 * 2f32.powi(-8)).to_f32(), 1.0 + 2f32.powi(-6));
        assert_eq!(Bf16::from_f32(-2.5).to_f32(), -2.5);
        for v in [0.1f32, -3.7, 1e-20, 6e4] {
            assert!(((Bf16::from_f32(v).to_f32() - v) / v).abs() <= 2f32.powi(-9), "{v}");
        }
    }

    #[test]
    fn attention_row_matches_f64() {
        attention_row_matches_f64_with::<f32>();
    }

    #[test]
    fn attention_row_over_a_bf16_cache_matches_f64_of_the_rounded_keys_and_values() {
        attention_row_matches_f64_with::<Bf16>();
    }

    #[test]
    fn attention_row_over_an_int8_cache_matches_f64_of_the_codes_times_their_scales() {
        attention_row_matches_f64_with::<i8>();
    }

    #[test]
    fn int8_positions_hold_their_largest_value_and_a_step_of_it() {
        let x = [0.5f32, -2.54, 1.0, 0.0, 2.0];
        let mut codes = [0i8; 5];
        let scale = encode_position::<i8>(&x, |i, c| codes[i] = c);
        assert_eq!(scale, 2.54 / 127.0);
        assert_eq!(codes, [25, -127, 50, 0, 100]);
        for (c, v) in codes.iter().zip(x) {
            assert!((*c as f32 * scale - v).abs() <= scale / 2.0 * 1.0001, "{c} {v}");
        }
        // Nearest, ties to even; clamped to ±127.
        let code = <i8 as KvElement>::from_f32;
        assert_eq!([code(2.5), code(-3.5), code(0.49), code(-126.6), code(200.0)], [2, -4, 0, -127, 127]);
        // All zeros: codes and scale 0, nothing divided by zero.
        assert_eq!(encode_position::<i8>(&[0.0; 3], |_, c| assert_eq!(c, 0)), 0.0);
        // Unscaled elements are written as they are.
        assert_eq!(encode_position::<f32>(&x, |i, v| assert_eq!(v, x[i])), 1.0);
    }

    /// The kernels over a cache of `E` against f64 sums of the values the cache holds (f32 keys
    /// and values rounded to `E` when written; int8 codes times their position's scale).
    fn attention_row_matches_f64_with<E: KvElement>() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        // (positions, dk, dv, chunk stride beyond one head's chunk): one position, a partly filled
        // first chunk, whole chunks, whole chunks and a partial one, a head not multiple of 32.
        for &(len, dk, dv, gap) in &[(1, 4, 4, 0), (7, 33, 5, 3), (130, 32, 64, 96), (64, 8, 32, 0), (200, 16, 48, 5)] {
            let q = random(dk, &mut rng);
            // Keys and values position-major, [s, ..], as the cache holds them, and each
            // position's scale (1 where E is not scaled), spread over two decades.
            let held = |width: usize, rng: &mut rand::rngs::StdRng| -> (Vec<E>, Vec<f32>) {
                let (mut codes, mut scales) = (vec![E::default(); len * width], Vec::new());
                for s in 0..len {
                    let size = 10f32.powf(rng.random_range(-1.0..1.0));
                    let x: Vec<f32> = random(width, rng).iter().map(|v| v * size).collect();
                    scales.push(encode_position::<E>(&x, |i, c| codes[s * width + i] = c));
                }
                (codes, scales)
            };
            let ((key, key_scale), (value, value_scale)) = (held(dk, &mut rng), held(dv, &mut rng));
            // Chunked as the kernels read them; unused places (the last chunk's tail, gaps
            // between chunks) hold values that would show if read.
            let (key_stride, value_stride) = (dk * KV_CHUNK + gap, dv * KV_CHUNK + gap);
            let chunks = len.div_ceil(KV_CHUNK);
            let mut keys = vec![E::from_f32(1e3); chunks * key_stride];
            let mut values = vec![E::from_f32(f32::NAN); (chunks - 1) * value_stride + KV_CHUNK * dv];
            // The scales chunked as well ([chunks, KV_CHUNK + gap]), NaN where unused.
            let scale_stride = KV_CHUNK + gap;
            let (mut key_scales, mut value_scales) =
                (vec![f32::NAN; chunks * scale_stride], vec![f32::NAN; chunks * scale_stride]);
            for s in 0..len {
                for i in 0..dk {
                    keys[key_offset(s, i, key_stride)] = key[s * dk + i];
                }
                let at = value_offset(s, dv, value_stride);
                values[at..at + dv].copy_from_slice(&value[s * dv..(s + 1) * dv]);
                key_scales[s / KV_CHUNK * scale_stride + s % KV_CHUNK] = key_scale[s];
                value_scales[s / KV_CHUNK * scale_stride + s % KV_CHUNK] = value_scale[s];
            }
            let head = |elems, chunk_stride, scales| HeadCache {
                elems,
                chunk_stride,
                scales: E::SCALED.then_some(PositionScales { scales, chunk_stride: scale_stride }),
            };
            let (keys, values) =
                (head(&keys[..], key_stride, &key_scales[..]), head(&values[..], value_stride, &value_scales[..]));
            let f = |e: E| e.to_f32() as f64;
            let scale = 1.0 / (dk as f64).sqrt();
            let logits: Vec<f64> = (0..len)
                .map(|s| (0..dk).map(|k| q[k] as f64 * f(key[s * dk + k])).sum::<f64>() * key_scale[s] as f64 * scale)
                .collect();
            let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
            let z: f64 = e.iter().sum();
            let want_p: Vec<f64> = e.iter().map(|v| v / z).collect();
            let want_o: Vec<f64> = (0..dv)
                .map(|c| (0..len).map(|s| want_p[s] * f(value[s * dv + c]) * value_scale[s] as f64).sum::<f64>() + 0.5)
                .collect();
            for isa in 0..=crate::cpu::BEST_ISA {
                let mut p = vec![0f32; len];
                softmax_scores_at(isa, &q, keys, scale as f32, &mut p);
                for (g, e) in p.iter().zip(&want_p) {
                    assert!((*g as f64 - e).abs() < 1e-6, "isa {isa} len {len}: p {g} vs {e}");
                }
                let mut out = vec![0.5f32; dv]; // accumulates onto what is there
                weighted_values_at(isa, &p, values, &mut out);
                for (g, e) in out.iter().zip(&want_o) {
                    assert!((*g as f64 - e).abs() < 1e-5 * (1.0 + e.abs()), "isa {isa} len {len}: out {g} vs {e}");
                }
            }
        }
    }

    #[test]
    fn swiglu_rows_matches_f64() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let gate: Vec<f32> = random(77, &mut rng).iter().map(|g| g * 12.0).collect();
        let up = random(77, &mut rng);
        for isa in 0..=crate::cpu::BEST_ISA {
            let mut out = vec![0f32; 77];
            swiglu_rows_at(isa, &gate, &up, &mut out);
            for i in 0..77 {
                let g = gate[i] as f64;
                let want = g / (1.0 + (-g).exp()) * up[i] as f64;
                assert!((out[i] as f64 - want).abs() < 1e-5 * (1.0 + want.abs()), "isa {isa}: {} vs {want}", out[i]);
            }
        }
    }
}
