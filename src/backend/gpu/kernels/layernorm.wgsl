// LayerNorm over the channel dimension, eps 1e-5 (cpu/layernorm.rs). One workgroup per row for
// the forward and the input gradient; the parameter gradients are column sums over the rows, in
// two passes for parallelism: partial sums of blocks of ROWS rows here, then their sums
// (memory.wgsl: column_sums), each in a fixed order.

struct Params {
    o0: u32, o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, // offsets of b0..b5
    n: u32,  // rows
    c: u32,  // channels
}
var<immediate> p: Params;

// forward: out, mean, rstd, inp, weight, bias
// backward_input: dinp, dout, inp, weight, mean, rstd
// backward_params: dweight partials, dbias partials, dout, inp, mean, rstd

const EPS: f32 = 1e-5;

// out (N, C) = (inp - mean) * rstd * weight + bias; mean (N), rstd (N) kept for backward.
@compute @workgroup_size(WG)
fn layernorm_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) tid: u32) {
    let row = group_id(wid, nwg);
    if (row >= p.n) {
        return;
    }
    let x0 = p.o3 + row * p.c;
    var s = 0.0;
    for (var i = tid; i < p.c; i = i + WG) {
        s = s + b3_ld(x0 + i);
    }
    let mu = wg_sum(s, tid) / f32(p.c);
    var v = 0.0;
    for (var i = tid; i < p.c; i = i + WG) {
        let d = b3_ld(x0 + i) - mu;
        v = v + d * d;
    }
    let r = 1.0 / sqrt(wg_sum(v, tid) / f32(p.c) + EPS);
    for (var i = tid; i < p.c; i = i + WG) {
        b0_st(p.o0 + row * p.c + i, (b3_ld(x0 + i) - mu) * r * b4_ld(p.o4 + i) + b5_ld(p.o5 + i));
    }
    if (tid == 0u) {
        b1_st(p.o1 + row, mu);
        b2_st(p.o2 + row, r);
    }
}

// dinp (N, C) += (w*d - mean(w*d) - norm * mean(w*d*norm)) * rstd, norm = (inp - mean) * rstd.
@compute @workgroup_size(WG)
fn layernorm_backward_input(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                            @builtin(local_invocation_index) tid: u32) {
    let row = group_id(wid, nwg);
    if (row >= p.n) {
        return;
    }
    let m = b4_ld(p.o4 + row);
    let r = b5_ld(p.o5 + row);
    let d0 = p.o1 + row * p.c;
    let x0 = p.o2 + row * p.c;
    var sd = 0.0;
    var sdn = 0.0;
    for (var i = tid; i < p.c; i = i + WG) {
        let dn = b3_ld(p.o3 + i) * b1_ld(d0 + i);
        sd = sd + dn;
        sdn = sdn + dn * ((b2_ld(x0 + i) - m) * r);
    }
    let dnorm_mean = wg_sum(sd, tid) / f32(p.c);
    let dnorm_norm_mean = wg_sum(sdn, tid) / f32(p.c);
    for (var i = tid; i < p.c; i = i + WG) {
        let norm = (b2_ld(x0 + i) - m) * r;
        let dn = b3_ld(p.o3 + i) * b1_ld(d0 + i);
        let at = p.o0 + row * p.c + i;
        b0_st(at, b0_ld(at) + (dn - dnorm_mean - norm * dnorm_norm_mean) * r);
    }
}

// Rows per partial sum of the parameter gradients (src/backend/gpu/layernorm.rs: ROWS).
const ROWS: u32 = 64u;

// For block k of ROWS rows and channel c: dweight partial [k, c] = the block's sum of
// (inp - mean) * rstd * dout, dbias partial [k, c] = its sum of dout.
@compute @workgroup_size(WG)
fn layernorm_backward_params(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                             @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    let blocks = (p.n + ROWS - 1u) / ROWS;
    if (i >= blocks * p.c) {
        return;
    }
    let k = i / p.c;
    let ch = i % p.c;
    var dw = 0.0;
    var db = 0.0;
    for (var row = k * ROWS; row < min(p.n, (k + 1u) * ROWS); row = row + 1u) {
        let d = b2_ld(p.o2 + row * p.c + ch);
        dw = dw + (b3_ld(p.o3 + row * p.c + ch) - b4_ld(p.o4 + row)) * b5_ld(p.o5 + row) * d;
        db = db + d;
    }
    b0_st(p.o0 + i, dw);
    b1_st(p.o1 + i, db);
}
