// The causal softmax of attention, its rebuild from row statistics, and its backward
// (cpu/attention.rs). The attention's products (Q K^T, P V and their gradients) are GEMMs of
// matmul.wgsl. One workgroup per row of scores; the rows are `rows` per plane, plane q's row i
// at o + q*ps + i*rs; row g = q*rows + i's statistics (max(scale * x), 1/sum) at o1 + 2g.

struct Params {
    o0: u32,    // forward and probs: the scores, softmaxed in place; backward: dP, turned into dS
    o1: u32,    // forward and probs: the row statistics; backward: the probabilities P
    planes: u32,
    rows: u32,
    rs: u32,    // row stride
    ps: u32,    // plane stride
    pos: u32,   // row i sees keys 0..pos+i (pos: positions already in a KV cache)
    len: u32,   // entries of a row to write: the live ones, then zeros up to len
    scale: f32, // 1/sqrt(HS)
    stats: u32, // softmax_forward: 1 to write the row statistics to y
}
var<immediate> p: Params;

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;

// Row g's first element, from o0 (or o1).
fn row_off(g: u32) -> u32 {
    return (g / p.rows) * p.ps + (g % p.rows) * p.rs;
}

// How many of row g's entries are live: its row i sees keys 0..=pos+i.
fn row_live(g: u32) -> u32 {
    return min(p.pos + g % p.rows + 1u, p.len);
}

// The first pos+i+1 entries of row i become softmax(scale * x), the rest up to len zero.
@compute @workgroup_size(WG)
fn softmax_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) tid: u32) {
    let g = group_id(wid, nwg);
    if (g >= p.planes * p.rows) {
        return;
    }
    let r0 = p.o0 + row_off(g);
    let live = row_live(g);
    var m = NEG_INF;
    for (var j = tid; j < live; j = j + WG) {
        m = max(m, x[r0 + j]);
    }
    // max(x) * scale is max(x * scale): scale > 0 and rounding is monotonic (as on the CPU).
    let maxv = wg_max(m, tid) * p.scale;
    var s = 0.0;
    for (var j = tid; j < live; j = j + WG) {
        let e = exp_(x[r0 + j] * p.scale - maxv);
        x[r0 + j] = e;
        s = s + e;
    }
    let inv = 1.0 / wg_sum(s, tid);
    if (p.stats != 0u && tid == 0u) {
        y[p.o1 + 2u * g] = maxv;
        y[p.o1 + 2u * g + 1u] = inv;
    }
    for (var j = tid; j < p.len; j = j + WG) {
        if (j < live) {
            x[r0 + j] = x[r0 + j] * inv;
        } else {
            x[r0 + j] = 0.0;
        }
    }
}

// The scores of row i become softmax_forward's probabilities again, from its statistics: the
// same two roundings per entry, with no reduction.
@compute @workgroup_size(WG)
fn softmax_probs(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) tid: u32) {
    let g = group_id(wid, nwg);
    if (g >= p.planes * p.rows) {
        return;
    }
    let r0 = p.o0 + row_off(g);
    let live = row_live(g);
    let maxv = y[p.o1 + 2u * g];
    let inv = y[p.o1 + 2u * g + 1u];
    for (var j = tid; j < p.len; j = j + WG) {
        if (j < live) {
            x[r0 + j] = exp_(x[r0 + j] * p.scale - maxv) * inv;
        } else {
            x[r0 + j] = 0.0;
        }
    }
}

// dP (row i, first i+1 entries) becomes dS = P * (dP - <P, dP>) * scale; zero up to len.
@compute @workgroup_size(WG)
fn softmax_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) tid: u32) {
    let g = group_id(wid, nwg);
    if (g >= p.planes * p.rows) {
        return;
    }
    let d0 = p.o0 + row_off(g);
    let p0 = p.o1 + row_off(g);
    let live = row_live(g);
    var s = 0.0;
    for (var j = tid; j < live; j = j + WG) {
        s = s + y[p0 + j] * x[d0 + j];
    }
    let dot = wg_sum(s, tid);
    for (var j = tid; j < p.len; j = j + WG) {
        if (j < live) {
            x[d0 + j] = y[p0 + j] * (x[d0 + j] - dot) * p.scale;
        } else {
            x[d0 + j] = 0.0;
        }
    }
}
