// Matmul with bias (cpu/matmul.rs) and the attention's batched GEMMs (cpu/attention.rs), as
// one register-tiled GEMM: C (M, N) [+]= A (M, K) @ B (K, N) [+ bias (N)], with A[i, k] at
// a + i*a_rs + k*a_cs, B[k, j] at b + k*b_rs + j*b_cs and C[i, j] at c + i*c_rs + j, so that
// transposes are strides, not copies. Workgroup z is one of a range of batch indices z0 + z =
// outer * inner + zi (the (batch, head) planes of attention), which move each operand by
// bo per outer index (counted from the range's first), bi per inner index and bz per z.
//
// 64x64 tiles of C per workgroup of 8x8 threads, each thread 8x8 outputs (rows ty*4.. and
// 32+ty*4.., columns tx*4.. and 32+tx*4.., so that the threads of a row read consecutive
// vectors of the tiles); K in steps of 16 through workgroup memory. Each output is one running
// sum over the k of a dispatch, in order, added to what the dispatches before wrote (a long K
// is cut into several): the same bits on every run.

struct Params {
    m: u32, n: u32, k: u32, // k: one past the last k of this dispatch
    a: u32, a_rs: u32, a_cs: u32,
    b: u32, b_rs: u32, b_cs: u32,
    c: u32, c_rs: u32,
    bias: u32,
    // 1: C += (accumulate); 2: add bias; 4: skip tiles wholly above the diagonal (j > i; the
    // causal scores, whose masked entries the softmax overwrites); 8: k < the tile's last row + 1;
    // 16: k >= the tile's first row (A is zero beyond those: causal probabilities or gradients).
    // 4, 8 and 16 take the row index i for the query position: a whole plane of scores, whose
    // rows are never cut.
    flags: u32,
    inner: u32,
    a_bo: u32, a_bi: u32, // A's offset per outer and per inner batch index
    b_bo: u32, b_bi: u32,
    c_bo: u32, c_bi: u32,
    z0: u32,
    a_bz: u32, b_bz: u32, c_bz: u32, // offset per batch index of the range
    kb: u32, // the first k of this dispatch (a long sum is cut into dispatches that accumulate)
}
var<immediate> p: Params;

// matmul: C, A, B, bias. bias_backward: dbias partials, dout. Declared before this file, each
// f32 or bf16 (src/backend/gpu/kernel.rs: Module::buffers, Entry::variants), and reached through c_ld, c_st, a_ld, b_ld
// and bias_ld, which read an element as f32 (exactly: a GEMM of bf16 operands is the f32 GEMM
// of the widened operands, bit for bit) and store one (a bf16 C rounded once, to nearest even).

const TK: u32 = 16u;
var<workgroup> As: array<vec4<f32>, 256>; // [k][64 rows as 16 vectors]
var<workgroup> Bs: array<vec4<f32>, 256>; // [k][64 columns as 16 vectors]

@compute @workgroup_size(8, 8)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
          @builtin(local_invocation_index) li: u32) {
    let base = operands_at(wid.z);
    let a0 = base.x;
    let b0 = base.y;
    let c0 = base.z;
    let row0 = wid.y * 64u;
    let col0 = wid.x * 64u;
    if ((p.flags & 4u) != 0u && col0 > row0 + 63u) {
        return;
    }
    let ks = k_range(row0);
    let k_lo = ks.x;
    let k_hi = ks.y;
    let a_kc = p.a_cs == 1u;
    let b_kc = p.b_rs == 1u;
    // 16 accumulators as separate variables: an array indexed at run time anywhere would
    // live in memory on some compilers (lavapipe), not in registers.
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    var acc4 = vec4<f32>(0.0);
    var acc5 = vec4<f32>(0.0);
    var acc6 = vec4<f32>(0.0);
    var acc7 = vec4<f32>(0.0);
    var acc8 = vec4<f32>(0.0);
    var acc9 = vec4<f32>(0.0);
    var acc10 = vec4<f32>(0.0);
    var acc11 = vec4<f32>(0.0);
    var acc12 = vec4<f32>(0.0);
    var acc13 = vec4<f32>(0.0);
    var acc14 = vec4<f32>(0.0);
    var acc15 = vec4<f32>(0.0);
    for (var k0 = k_lo; k0 < k_hi; k0 = k0 + TK) {
        // Load the tiles: each thread stores whole vectors of 4 rows (columns) at one k, as
        // writing one component of a vector may touch the whole vector (WGSL's memory model),
        // so no two threads may write parts of the same one. Consecutive threads take
        // consecutive k where k is contiguous in memory, else consecutive rows.
        for (var s = 0u; s < 4u; s = s + 1u) {
            let q = li + s * 64u;
            var kk = q / 16u;
            var rv = q % 16u;
            if (a_kc) {
                kk = q % 16u;
                rv = q / 16u;
            }
            As[kk * 16u + rv] = load_a(a0, row0 + rv * 4u, k0 + kk, k_hi);
            var kb = q / 16u;
            var cv = q % 16u;
            if (b_kc) {
                kb = q % 16u;
                cv = q / 16u;
            }
            Bs[kb * 16u + cv] = load_b(b0, col0 + cv * 4u, k0 + kb, k_hi);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk = kk + 1u) {
            let a_lo = As[kk * 16u + lid.y];
            let a_hi = As[kk * 16u + 8u + lid.y];
            let b_lo = Bs[kk * 16u + lid.x];
            let b_hi = Bs[kk * 16u + 8u + lid.x];
            acc0 = fma(vec4<f32>(a_lo.x), b_lo, acc0);
            acc1 = fma(vec4<f32>(a_lo.x), b_hi, acc1);
            acc2 = fma(vec4<f32>(a_lo.y), b_lo, acc2);
            acc3 = fma(vec4<f32>(a_lo.y), b_hi, acc3);
            acc4 = fma(vec4<f32>(a_lo.z), b_lo, acc4);
            acc5 = fma(vec4<f32>(a_lo.z), b_hi, acc5);
            acc6 = fma(vec4<f32>(a_lo.w), b_lo, acc6);
            acc7 = fma(vec4<f32>(a_lo.w), b_hi, acc7);
            acc8 = fma(vec4<f32>(a_hi.x), b_lo, acc8);
            acc9 = fma(vec4<f32>(a_hi.x), b_hi, acc9);
            acc10 = fma(vec4<f32>(a_hi.y), b_lo, acc10);
            acc11 = fma(vec4<f32>(a_hi.y), b_hi, acc11);
            acc12 = fma(vec4<f32>(a_hi.z), b_lo, acc12);
            acc13 = fma(vec4<f32>(a_hi.z), b_hi, acc13);
            acc14 = fma(vec4<f32>(a_hi.w), b_lo, acc14);
            acc15 = fma(vec4<f32>(a_hi.w), b_hi, acc15);
        }
        workgroupBarrier();
    }
    let r0 = row0 + lid.y * 4u;
    let r1 = row0 + 32u + lid.y * 4u;
    store_row(c0, r0 + 0u, col0 + lid.x * 4u, acc0, acc1);
    store_row(c0, r0 + 1u, col0 + lid.x * 4u, acc2, acc3);
    store_row(c0, r0 + 2u, col0 + lid.x * 4u, acc4, acc5);
    store_row(c0, r0 + 3u, col0 + lid.x * 4u, acc6, acc7);
    store_row(c0, r1 + 0u, col0 + lid.x * 4u, acc8, acc9);
    store_row(c0, r1 + 1u, col0 + lid.x * 4u, acc10, acc11);
    store_row(c0, r1 + 2u, col0 + lid.x * 4u, acc12, acc13);
    store_row(c0, r1 + 3u, col0 + lid.x * 4u, acc14, acc15);
}

// Where A, B and C start for workgroup z of the dispatch (batch index p.z0 + z).
fn operands_at(wz: u32) -> vec3<u32> {
    let z = p.z0 + wz;
    let zo = z / p.inner - p.z0 / p.inner;
    let zi = z % p.inner;
    return vec3<u32>(p.a + zo * p.a_bo + zi * p.a_bi + wz * p.a_bz,
                     p.b + zo * p.b_bo + zi * p.b_bi + wz * p.b_bz,
                     p.c + zo * p.c_bo + zi * p.c_bi + wz * p.c_bz);
}

// The k this dispatch sums for the 64-row tile from row0 (a multiple of 64): [kb, k), cut to
// the tile's last row + 1 (flag 8) and from its first row (flag 16).
fn k_range(row0: u32) -> vec2<u32> {
    var k_lo = p.kb;
    var k_hi = p.k;
    if ((p.flags & 8u) != 0u) {
        k_hi = min(k_hi, row0 + 64u);
    }
    if ((p.flags & 16u) != 0u) {
        k_lo = max(k_lo, row0);
    }
    return vec2<u32>(k_lo, k_hi);
}

// A[r..r+4, k] (zero past the matrix or past k_hi).
fn load_a(a0: u32, r: u32, k: u32, k_hi: u32) -> vec4<f32> {
    if (k >= k_hi) {
        return vec4<f32>(0.0);
    }
    let at = a0 + r * p.a_rs + k * p.a_cs;
    return vec4<f32>(elem_a(at, r, 0u), elem_a(at, r, 1u), elem_a(at, r, 2u), elem_a(at, r, 3u));
}

fn elem_a(at: u32, r: u32, i: u32) -> f32 {
    if (r + i < p.m) {
        return a_ld(at + i * p.a_rs);
    }
    return 0.0;
}

// B[k, j..j+4] (zero past the matrix or past k_hi).
fn load_b(b0: u32, j: u32, k: u32, k_hi: u32) -> vec4<f32> {
    if (k >= k_hi) {
        return vec4<f32>(0.0);
    }
    let at = b0 + k * p.b_rs + j * p.b_cs;
    return vec4<f32>(elem_b(at, j, 0u), elem_b(at, j, 1u), elem_b(at, j, 2u), elem_b(at, j, 3u));
}

fn elem_b(at: u32, j: u32, i: u32) -> f32 {
    if (j + i < p.n) {
        return b_ld(at + i * p.b_cs);
    }
    return 0.0;
}

// Row `row` of C's tile: columns col..col+4 and col+32..col+36, [+]= lo, hi [+ bias].
fn store_row(c0: u32, row: u32, col: u32, lo: vec4<f32>, hi: vec4<f32>) {
    if (row >= p.m) {
        return;
    }
    store4(c0 + row * p.c_rs, col, lo);
    store4(c0 + row * p.c_rs, col + 32u, hi);
}

fn store4(at_row: u32, col: u32, v: vec4<f32>) {
    for (var j = 0u; j < 4u; j = j + 1u) {
        if (col + j < p.n) {
            let at = at_row + col + j;
            var o = v[j];
            if ((p.flags & 1u) != 0u) {
                o = c_ld(at) + o;
            } else if ((p.flags & 2u) != 0u) {
                o = o + bias_ld(p.bias + col + j);
            }
            c_st(at, o);
        }
    }
}

// Rows per partial sum of the bias gradient (src/backend/gpu/matmul.rs: ROWS).
const ROWS: u32 = 64u;

// The first half of dbias (N) = the column sums of dout (M rows at a, row stride a_rs): for
// block k of ROWS rows and column j, partial [k, j] (at c) = the block's sum of dout[:, j].
// Of Params it reads m, n, a, a_rs and c.
@compute @workgroup_size(WG)
fn bias_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    let blocks = (p.m + ROWS - 1u) / ROWS;
    if (i >= blocks * p.n) {
        return;
    }
    let k = i / p.n;
    let j = i % p.n;
    var s = 0.0;
    for (var row = k * ROWS; row < min(p.m, (k + 1u) * ROWS); row = row + 1u) {
        s = s + a_ld(p.a + row * p.a_rs + j);
    }
    c_st(p.c + i, s);
}
