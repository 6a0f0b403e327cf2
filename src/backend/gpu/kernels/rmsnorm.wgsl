// RMSNorm over the channel dimension (cpu/rmsnorm.rs). One workgroup per row for the forward
// and the input gradient; the weight gradient is a column sum over the rows, in two passes:
// partial sums of blocks of ROWS rows here, then their sums (memory.wgsl: column_sums).

struct Params {
    o0: u32, o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, // offsets of b0..b5
    n: u32,   // rows
    c: u32,   // channels (the head size HS for the head kernels)
    eps: f32, // forward: added to the mean square
    nh: u32,  // head kernels: query heads
    nkv: u32, // head kernels: key (and value) heads
    h0: u32,  // head_norm_backward_params: the first head summed
    count: u32, // head_norm_backward_params: how many heads are summed
}
var<immediate> p: Params;

// forward: out, rstd, inp, weight
// backward_input: dinp, dout, inp, weight, rstd
// backward_params: dweight partials, dout, inp, rstd

// out (N, C) = (inp * rstd) * weight, rstd (N) = 1 / sqrt(mean(inp^2) + eps) kept for backward.
@compute @workgroup_size(WG)
fn rmsnorm_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) tid: u32) {
    let row = group_id(wid, nwg);
    if (row >= p.n) {
        return;
    }
    let x0 = p.o2 + row * p.c;
    var s = 0.0;
    for (var i = tid; i < p.c; i = i + WG) {
        let v = b2_ld(x0 + i);
        s = s + v * v;
    }
    let r = 1.0 / sqrt(wg_sum(s, tid) / f32(p.c) + p.eps);
    for (var i = tid; i < p.c; i = i + WG) {
        b0_st(p.o0 + row * p.c + i, (b2_ld(x0 + i) * r) * b3_ld(p.o3 + i));
    }
    if (tid == 0u) {
        b1_st(p.o1 + row, r);
    }
}

// dinp (N, C) += rstd * w * d - inp * rstd^3 / C * sum(w * d * inp).
@compute @workgroup_size(WG)
fn rmsnorm_backward_input(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                          @builtin(local_invocation_index) tid: u32) {
    let row = group_id(wid, nwg);
    if (row >= p.n) {
        return;
    }
    let r = b4_ld(p.o4 + row);
    let d0 = p.o1 + row * p.c;
    let x0 = p.o2 + row * p.c;
    var s = 0.0;
    for (var i = tid; i < p.c; i = i + WG) {
        s = s + b3_ld(p.o3 + i) * b1_ld(d0 + i) * b2_ld(x0 + i);
    }
    let k = wg_sum(s, tid) * r * r * r / f32(p.c);
    for (var i = tid; i < p.c; i = i + WG) {
        let at = p.o0 + row * p.c + i;
        b0_st(at, b0_ld(at) + (r * b3_ld(p.o3 + i) * b1_ld(d0 + i) - b2_ld(x0 + i) * k));
    }
}

// Rows per partial sum of the weight gradient (src/backend/gpu/rmsnorm.rs: ROWS).
const ROWS: u32 = 64u;

// For block k of ROWS rows and channel c: dweight partial [k, c] = the block's sum of
// dout * (inp * rstd).
@compute @workgroup_size(WG)
fn rmsnorm_backward_params(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    let blocks = (p.n + ROWS - 1u) / ROWS;
    if (i >= blocks * p.c) {
        return;
    }
    let k = i / p.c;
    let ch = i % p.c;
    var dw = 0.0;
    for (var row = k * ROWS; row < min(p.n, (k + 1u) * ROWS); row = row + 1u) {
        dw = dw + b1_ld(p.o1 + row * p.c + ch) * (b2_ld(p.o2 + row * p.c + ch) * b3_ld(p.o3 + row));
    }
    b0_st(p.o0 + i, dw);
}

// Qwen3's RMSNorm of each query and key head (cpu/rmsnorm.rs: head_norm_forward): one workgroup
// per (row, head) of qkv (N, QKV): query heads normalized with wq, key heads with wk, value
// heads copied. out, rstd (N, NH + KV), inp, wq, wk.
@compute @workgroup_size(WG)
fn head_norm_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) tid: u32) {
    let heads = p.nh + 2u * p.nkv;
    let normed = p.nh + p.nkv;
    let g = group_id(wid, nwg);
    if (g >= p.n * heads) {
        return;
    }
    let row = g / heads;
    let h = g % heads;
    let x0 = p.o2 + row * heads * p.c + h * p.c;
    let y0 = p.o0 + row * heads * p.c + h * p.c;
    if (h >= normed) {
        for (var i = tid; i < p.c; i = i + WG) {
            b0_st(y0 + i, b2_ld(x0 + i));
        }
        return;
    }
    var s = 0.0;
    for (var i = tid; i < p.c; i = i + WG) {
        let v = b2_ld(x0 + i);
        s = s + v * v;
    }
    let r = 1.0 / sqrt(wg_sum(s, tid) / f32(p.c) + p.eps);
    if (h < p.nh) {
        for (var i = tid; i < p.c; i = i + WG) {
            b0_st(y0 + i, (b2_ld(x0 + i) * r) * b3_ld(p.o3 + i));
        }
    } else {
        for (var i = tid; i < p.c; i = i + WG) {
            b0_st(y0 + i, (b2_ld(x0 + i) * r) * b4_ld(p.o4 + i));
        }
    }
    if (tid == 0u) {
        b1_st(p.o1 + row * normed + h, r);
    }
}

// Its input gradient, one workgroup per (row, head): dinp = rstd * w * d - inp * rstd^3 / HS *
// sum(w * d * inp) for the query and key heads, dout for the value heads.
// dinp, dout, inp, wq, wk, rstd.
@compute @workgroup_size(WG)
fn head_norm_backward_input(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                            @builtin(local_invocation_index) tid: u32) {
    let heads = p.nh + 2u * p.nkv;
    let normed = p.nh + p.nkv;
    let g = group_id(wid, nwg);
    if (g >= p.n * heads) {
        return;
    }
    let row = g / heads;
    let h = g % heads;
    let at = row * heads * p.c + h * p.c;
    if (h >= normed) {
        for (var i = tid; i < p.c; i = i + WG) {
            b0_st(p.o0 + at + i, b1_ld(p.o1 + at + i));
        }
        return;
    }
    let r = b5_ld(p.o5 + row * normed + h);
    var s = 0.0;
    if (h < p.nh) {
        for (var i = tid; i < p.c; i = i + WG) {
            s = s + b3_ld(p.o3 + i) * b1_ld(p.o1 + at + i) * b2_ld(p.o2 + at + i);
        }
    } else {
        for (var i = tid; i < p.c; i = i + WG) {
            s = s + b4_ld(p.o4 + i) * b1_ld(p.o1 + at + i) * b2_ld(p.o2 + at + i);
        }
    }
    let k = wg_sum(s, tid) * r * r * r / f32(p.c);
    for (var i = tid; i < p.c; i = i + WG) {
        let w = select(b4_ld(p.o4 + i), b3_ld(p.o3 + i), h < p.nh);
        b0_st(p.o0 + at + i, r * w * b1_ld(p.o1 + at + i) - b2_ld(p.o2 + at + i) * k);
    }
}

// The weight gradient of heads h0..h0+count, in partial sums: for block k of ROWS (row, head)
// items (rows outer, heads inner) and channel c, partial [k, c] = the block's sum of
// dout * (inp * rstd). partials, dout, inp, rstd.
@compute @workgroup_size(WG)
fn head_norm_backward_params(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                             @builtin(local_invocation_index) tid: u32) {
    let heads = p.nh + 2u * p.nkv;
    let normed = p.nh + p.nkv;
    let items = p.n * p.count;
    let i = group_id(wid, nwg) * WG + tid;
    let blocks = (items + ROWS - 1u) / ROWS;
    if (i >= blocks * p.c) {
        return;
    }
    let k = i / p.c;
    let ch = i % p.c;
    var dw = 0.0;
    for (var j = k * ROWS; j < min(items, (k + 1u) * ROWS); j = j + 1u) {
        let row = j / p.count;
        let h = p.h0 + j % p.count;
        let at = row * heads * p.c + h * p.c + ch;
        dw = dw + b1_ld(p.o1 + at) * (b2_ld(p.o2 + at) * b3_ld(p.o3 + row * normed + h));
    }
    b0_st(p.o0 + i, dw);
}
