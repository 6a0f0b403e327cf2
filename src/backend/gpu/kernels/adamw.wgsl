// AdamW and the global gradient norm (cpu/adamw.rs). The step's loss and squared norm are read
// on the device, which skips the update when either is not finite or above its limit (llm.c's
// outlier skipping), so a step needs no host round trip.

struct Params {
    o0: u32, // adamw: params; sum_squares: partials; reduce: out (1)
    o1: u32, // adamw: m; sum_squares: x; reduce: partials
    o2: u32, // adamw: v
    o3: u32, // adamw: grads
    o4: u32, // adamw: stats (2): [mean loss, squared global norm]
    n: u32,  // elements (reduce: partials)
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    wd: f32,
    clip: f32,   // clip the gradient norm to this (0: no clipping)
    bc1: f32,    // 1 - beta1^t
    bc2: f32,    // 1 - beta2^t
    max_loss: f32,
    max_norm_sq: f32,
    flags: u32,  // reduce: 1 = add to out
    seed: u32,   // adamw on bf16 params: the seed of their stochastic rounding
    first: u32,  // ... and the noise index of this dispatch's first element
}
var<immediate> p: Params;

// Buffers (declared before this file: src/backend/gpu/kernel.rs): adamw: params, m, v, grads, stats;
// sum_squares: partials, x; reduce_partials: out, partials.


// param -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * param), as llm.c and PyTorch.
@compute @workgroup_size(WG)
fn adamw(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    if (i >= p.n) {
        return;
    }
    let loss = b4_ld(p.o4);
    let norm_sq = b4_ld(p.o4 + 1u);
    if (!(finite(loss) && finite(norm_sq) && loss <= p.max_loss && norm_sq <= p.max_norm_sq)) {
        return; // a diverged or outlier step: the model stays as it was
    }
    let norm = sqrt(norm_sq);
    var scale = 1.0;
    if (p.clip > 0.0 && norm > p.clip) {
        scale = p.clip / norm;
    }
    let grad = b3_ld(p.o3 + i) * scale;
    let m = p.beta1 * b1_ld(p.o1 + i) + (1.0 - p.beta1) * grad;
    let v = p.beta2 * b2_ld(p.o2 + i) + (1.0 - p.beta2) * grad * grad;
    b1_st(p.o1 + i, m);
    b2_st(p.o2 + i, v);
    let m_hat = m / p.bc1;
    let v_hat = v / p.bc2;
    let w = b0_ld(p.o0 + i);
    // (Rounded stochastically where the parameters are bf16: the CPU's noise of the element's place.)
    b0_st_stochastic(p.o0 + i, w - p.lr * (m_hat / (sqrt(v_hat) + p.eps) + p.wd * w), p.seed, p.first + i);
}

// Elements per workgroup of sum_squares (src/backend/gpu/adamw.rs: SQ_CHUNK).
const CHUNK: u32 = 4096u;

// partials[g] = the sum of squares of x's elements g*CHUNK.., in a fixed order.
@compute @workgroup_size(WG)
fn sum_squares(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) tid: u32) {
    let g = group_id(wid, nwg);
    let start = g * CHUNK;
    if (start >= p.n) {
        return;
    }
    let end = min(start + CHUNK, p.n);
    var s = 0.0;
    for (var j = start + tid; j < end; j = j + WG) {
        let v = b1_ld(p.o1 + j);
        s = s + v * v;
    }
    let total = wg_sum(s, tid);
    if (tid == 0u) {
        b0_st(p.o0 + g, total);
    }
}

// out (1) [+]= the sum of n partials, in a fixed order by one workgroup.
@compute @workgroup_size(WG)
fn reduce_partials(@builtin(local_invocation_index) tid: u32) {
    var s = 0.0;
    for (var j = tid; j < p.n; j = j + WG) {
        s = s + b1_ld(p.o1 + j);
    }
    let total = wg_sum(s, tid);
    if (tid == 0u) {
        var o = total;
        if ((p.flags & 1u) != 0u) {
            o = b0_ld(p.o0) + total;
        }
        b0_st(p.o0, o);
    }
}
