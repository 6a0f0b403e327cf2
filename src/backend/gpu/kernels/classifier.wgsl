// Fused softmax + cross-entropy over the (padded) vocabulary (cpu/classifier.rs): the forward
// keeps only each row's log-sum-exp; the backward turns the logits into their gradient in
// place. No (B, T, V) probabilities are kept.

struct Params {
    o0: u32, // forward: losses (N); backward: logits (N, Vp); accumulate_mean: acc (1)
    o1: u32, // forward: lse (N); backward: lse; accumulate_mean: x (N)
    o2: u32, // forward: logits (N, Vp)
    o3: u32, // targets (N)
    n: u32,  // rows (accumulate_mean: elements)
    v: u32,
    vp: u32,
    w: f32,  // backward: dloss; accumulate_mean: weight
}
var<immediate> p: Params;


// losses = lse - logits[target], lse = log sum exp of the first V logits of the row.
@compute @workgroup_size(WG)
fn crossentropy_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) tid: u32) {
    let row = group_id(wid, nwg);
    if (row >= p.n) {
        return;
    }
    let r0 = p.o2 + row * p.vp;
    var m = NEG_INF;
    for (var j = tid; j < p.v; j = j + WG) {
        m = max(m, z_ld(r0 + j));
    }
    let maxv = wg_max(m, tid);
    var s = 0.0;
    for (var j = tid; j < p.v; j = j + WG) {
        s = s + exp_(z_ld(r0 + j) - maxv);
    }
    let total = wg_sum(s, tid);
    if (tid == 0u) {
        let lse = log(total) + maxv;
        y_st(p.o1 + row, lse);
        x_st(p.o0 + row, lse - z_ld(r0 + targets[p.o3 + row]));
    }
}

// logits (N, Vp) become (softmax - onehot(target)) * dloss over the first V columns, 0 beyond.
@compute @workgroup_size(WG)
fn crossentropy_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    if (i >= p.n * p.vp) {
        return;
    }
    let row = i / p.vp;
    let col = i % p.vp;
    let at = p.o0 + i;
    if (col >= p.v) {
        x_st(at, 0.0);
        return;
    }
    var g = exp_(x_ld(at) - y_ld(p.o1 + row)) * p.w;
    if (col == targets[p.o3 + row]) {
        g = g - p.w;
    }
    x_st(at, g);
}

// acc += weight * mean(x (N)), summed in a fixed order by one workgroup.
@compute @workgroup_size(WG)
fn accumulate_mean(@builtin(local_invocation_index) tid: u32) {
    var s = 0.0;
    for (var j = tid; j < p.n; j = j + WG) {
        s = s + y_ld(p.o1 + j);
    }
    let total = wg_sum(s, tid);
    if (tid == 0u) {
        x_st(p.o0, x_ld(p.o0) + p.w * (total / f32(max(p.n, 1u))));
    }
}
