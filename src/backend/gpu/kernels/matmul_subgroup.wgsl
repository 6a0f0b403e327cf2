// The GEMM of kernels/matmul.wgsl (same operands, Params, flags and results) for software
// Vulkan drivers that run compute shaders on a CPU (lavapipe), chosen at start-up for those
// only (src/backend/gpu/context.rs), appended to matmul.wgsl's module (src/backend/gpu/kernel.rs).
//
// Why: llvmpipe runs the 8 (AVX2) or 16 invocations of a subgroup as the lanes of one vector
// and turns every load whose address differs per lane into a loop of scalar loads, so the
// tiled kernel's 16 workgroup-memory loads per 64 FMAs cost several times its arithmetic.
// Here each A and B element is loaded once per subgroup and A's are shared through
// subgroupBroadcast (a lane extract and a splat, in registers): 2 vector loads per 128 FMAs.
// (Its register tile suits no real GPU, where the tiled kernel stays.)
//
// A workgroup of 8 invocations computes a 32 x 32 tile of C: invocation li the columns
// col0 + 4*li .. +4 of all 32 rows, in 32 accumulators. Lane s loads A's rows row0 + 4*s .. +4
// at k, and every lane takes row 4*s + c from lane s: so the 8 invocations must be lanes 0..7
// of one subgroup (subgroups of at least 8 lanes; of more, the workgroup is a part of one).
//
// Each output is the same running sum as the tiled kernel's: fma over k of this dispatch in
// order, from 0, then added to C or the bias. The causal flags bound k by the 64-row tile the
// tiled kernel would use, so both sum the same terms: the same bits. (The tiled kernel pads
// the last step of k with zeros, which turns a sum that underflowed to -0 into +0; here it
// stays -0.)

// C's tile per workgroup (src/backend/gpu/pipelines.rs: Kernels::gemm_tile).
const SG_ROWS: u32 = 32u;
const SG_COLS: u32 = 32u;

@compute @workgroup_size(8)
fn matmul_subgroup(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32,
                   @builtin(subgroup_invocation_id) lane: u32) {
    let base = operands_at(wid.z);
    let a0 = base.x;
    let b0 = base.y;
    let c0 = base.z;
    let row0 = wid.y * SG_ROWS;
    let col0 = wid.x * SG_COLS;
    // Every output of the tile above the diagonal (j > i): skipped, as the tiled kernel's.
    if ((p.flags & 4u) != 0u && col0 > row0 + SG_ROWS - 1u) {
        return;
    }
    // The k range of the tiled kernel's 64-row tile that holds these rows.
    let ks = k_range(row0 & ~63u);
    let k_lo = ks.x;
    let k_hi = ks.y;
    let col = col0 + li * 4u;
    let arow = row0 + lane * 4u;
    // Separate variables, not an array: an array would live in memory on lavapipe.
    var acc0 = vec4<f32>(0.0); var acc1 = vec4<f32>(0.0); var acc2 = vec4<f32>(0.0); var acc3 = vec4<f32>(0.0);
    var acc4 = vec4<f32>(0.0); var acc5 = vec4<f32>(0.0); var acc6 = vec4<f32>(0.0); var acc7 = vec4<f32>(0.0);
    var acc8 = vec4<f32>(0.0); var acc9 = vec4<f32>(0.0); var acc10 = vec4<f32>(0.0); var acc11 = vec4<f32>(0.0);
    var acc12 = vec4<f32>(0.0); var acc13 = vec4<f32>(0.0); var acc14 = vec4<f32>(0.0); var acc15 = vec4<f32>(0.0);
    var acc16 = vec4<f32>(0.0); var acc17 = vec4<f32>(0.0); var acc18 = vec4<f32>(0.0); var acc19 = vec4<f32>(0.0);
    var acc20 = vec4<f32>(0.0); var acc21 = vec4<f32>(0.0); var acc22 = vec4<f32>(0.0); var acc23 = vec4<f32>(0.0);
    var acc24 = vec4<f32>(0.0); var acc25 = vec4<f32>(0.0); var acc26 = vec4<f32>(0.0); var acc27 = vec4<f32>(0.0);
    var acc28 = vec4<f32>(0.0); var acc29 = vec4<f32>(0.0); var acc30 = vec4<f32>(0.0); var acc31 = vec4<f32>(0.0);
    for (var k = k_lo; k < k_hi; k = k + 1u) {
        let b = load_b(b0, col, k, k_hi);
        let a = load_a(a0, arow, k, k_hi);
        let x0 = subgroupBroadcast(a, 0u);
        acc0 = fma(vec4<f32>(x0.x), b, acc0); acc1 = fma(vec4<f32>(x0.y), b, acc1);
        acc2 = fma(vec4<f32>(x0.z), b, acc2); acc3 = fma(vec4<f32>(x0.w), b, acc3);
        let x1 = subgroupBroadcast(a, 1u);
        acc4 = fma(vec4<f32>(x1.x), b, acc4); acc5 = fma(vec4<f32>(x1.y), b, acc5);
        acc6 = fma(vec4<f32>(x1.z), b, acc6); acc7 = fma(vec4<f32>(x1.w), b, acc7);
        let x2 = subgroupBroadcast(a, 2u);
        acc8 = fma(vec4<f32>(x2.x), b, acc8); acc9 = fma(vec4<f32>(x2.y), b, acc9);
        acc10 = fma(vec4<f32>(x2.z), b, acc10); acc11 = fma(vec4<f32>(x2.w), b, acc11);
        let x3 = subgroupBroadcast(a, 3u);
        acc12 = fma(vec4<f32>(x3.x), b, acc12); acc13 = fma(vec4<f32>(x3.y), b, acc13);
        acc14 = fma(vec4<f32>(x3.z), b, acc14); acc15 = fma(vec4<f32>(x3.w), b, acc15);
        let x4 = subgroupBroadcast(a, 4u);
        acc16 = fma(vec4<f32>(x4.x), b, acc16); acc17 = fma(vec4<f32>(x4.y), b, acc17);
        acc18 = fma(vec4<f32>(x4.z), b, acc18); acc19 = fma(vec4<f32>(x4.w), b, acc19);
        let x5 = subgroupBroadcast(a, 5u);
        acc20 = fma(vec4<f32>(x5.x), b, acc20); acc21 = fma(vec4<f32>(x5.y), b, acc21);
        acc22 = fma(vec4<f32>(x5.z), b, acc22); acc23 = fma(vec4<f32>(x5.w), b, acc23);
        let x6 = subgroupBroadcast(a, 6u);
        acc24 = fma(vec4<f32>(x6.x), b, acc24); acc25 = fma(vec4<f32>(x6.y), b, acc25);
        acc26 = fma(vec4<f32>(x6.z), b, acc26); acc27 = fma(vec4<f32>(x6.w), b, acc27);
        let x7 = subgroupBroadcast(a, 7u);
        acc28 = fma(vec4<f32>(x7.x), b, acc28); acc29 = fma(vec4<f32>(x7.y), b, acc29);
        acc30 = fma(vec4<f32>(x7.z), b, acc30); acc31 = fma(vec4<f32>(x7.w), b, acc31);
    }
    store_sg(c0, row0 + 0u, col, acc0); store_sg(c0, row0 + 1u, col, acc1); store_sg(c0, row0 + 2u, col, acc2); store_sg(c0, row0 + 3u, col, acc3);
    store_sg(c0, row0 + 4u, col, acc4); store_sg(c0, row0 + 5u, col, acc5); store_sg(c0, row0 + 6u, col, acc6); store_sg(c0, row0 + 7u, col, acc7);
    store_sg(c0, row0 + 8u, col, acc8); store_sg(c0, row0 + 9u, col, acc9); store_sg(c0, row0 + 10u, col, acc10); store_sg(c0, row0 + 11u, col, acc11);
    store_sg(c0, row0 + 12u, col, acc12); store_sg(c0, row0 + 13u, col, acc13); store_sg(c0, row0 + 14u, col, acc14); store_sg(c0, row0 + 15u, col, acc15);
    store_sg(c0, row0 + 16u, col, acc16); store_sg(c0, row0 + 17u, col, acc17); store_sg(c0, row0 + 18u, col, acc18); store_sg(c0, row0 + 19u, col, acc19);
    store_sg(c0, row0 + 20u, col, acc20); store_sg(c0, row0 + 21u, col, acc21); store_sg(c0, row0 + 22u, col, acc22); store_sg(c0, row0 + 23u, col, acc23);
    store_sg(c0, row0 + 24u, col, acc24); store_sg(c0, row0 + 25u, col, acc25); store_sg(c0, row0 + 26u, col, acc26); store_sg(c0, row0 + 27u, col, acc27);
    store_sg(c0, row0 + 28u, col, acc28); store_sg(c0, row0 + 29u, col, acc29); store_sg(c0, row0 + 30u, col, acc30); store_sg(c0, row0 + 31u, col, acc31);
}

// Row `row` of C's tile, columns col..col+4, [+]= v [+ bias].
fn store_sg(c0: u32, row: u32, col: u32, v: vec4<f32>) {
    if (row < p.m) {
        store4(c0 + row * p.c_rs, col, v);
    }
}
