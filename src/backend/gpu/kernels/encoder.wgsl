// Token (+ position) embedding, forward and backward (cpu/encoder.rs). wte may be larger than
// one binding: each dispatch sees rows lo..hi of it (or of dwte), and handles only the
// positions whose token is among them.

struct Params {
    o0: u32, // forward: out (B*T, C); backward_wte: dwte rows lo..hi; backward_wpe: dwpe (T, C)
    o1: u32, // forward: inp (B*T); backward_wte: buckets
    o2: u32, // forward: wte rows lo..hi; backward: dout (B*T, C)
    o3: u32, // forward: wpe (T, C), when pe is 1
    n: u32,  // forward: positions B*T; backward_wte: distinct tokens U; backward_wpe: T
    t: u32,  // forward: T
    c: u32,  // C
    lo: u32, // first wte row in the window
    hi: u32, // one past the last
    b: u32,  // backward_wpe: B
    pe: u32, // forward: 1 to add wpe (GPT-2), 0 without (Llama)
}
var<immediate> p: Params;

// Buffers (declared before this file: src/backend/gpu/kernel.rs): x: out, dwte or dwpe; ids (u32):
// inp or buckets; y: wte or dout; z: wpe.


// out[n, c] = wte[inp[n], c] (+ wpe[n % T, c]), for the positions whose token is in lo..hi.
@compute @workgroup_size(WG)
fn encoder_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    if (i >= p.n * p.c) {
        return;
    }
    let pos = i / p.c;
    let ch = i % p.c;
    let tok = ids[p.o1 + pos];
    if (tok < p.lo || tok >= p.hi) {
        return;
    }
    var e = y_ld(p.o2 + (tok - p.lo) * p.c + ch);
    if (p.pe != 0u) {
        e = e + z_ld(p.o3 + (pos % p.t) * p.c + ch);
    }
    x_st(p.o0 + i, e);
}

// dwte[tok] += the rows of dout at the positions holding tok, added one after another in
// position order (the CPU's order; no float atomics, so the same bits on every run). buckets:
// the U distinct tokens, then U + 1 starts into the positions that follow, grouped by token.
@compute @workgroup_size(WG)
fn encoder_backward_wte(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    if (i >= p.n * p.c) {
        return;
    }
    let k = i / p.c;
    let ch = i % p.c;
    let tok = ids[p.o1 + k];
    if (tok < p.lo || tok >= p.hi) {
        return;
    }
    let starts = p.o1 + p.n;
    let positions = starts + p.n + 1u;
    let at = p.o0 + (tok - p.lo) * p.c + ch;
    var acc = x_ld(at);
    for (var j = ids[starts + k]; j < ids[starts + k + 1u]; j = j + 1u) {
        acc = acc + y_ld(p.o2 + ids[positions + j] * p.c + ch);
    }
    x_st(at, acc);
}

// dwpe[t, c] += the sum over b of dout[b, t, c], in batch order.
@compute @workgroup_size(WG)
fn encoder_backward_wpe(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    if (i >= p.n * p.c) {
        return;
    }
    var acc = x_ld(p.o0 + i);
    for (var bi = 0u; bi < p.b; bi = bi + 1u) {
        acc = acc + y_ld(p.o2 + bi * p.n * p.c + i);
    }
    x_st(p.o0 + i, acc);
}
