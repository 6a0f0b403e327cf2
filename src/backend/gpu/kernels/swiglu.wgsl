// SwiGLU (cpu/swiglu.rs): out = up * silu(gate) from rows holding up (F) then gate (F), with
// the CPU's exp. One thread per output element.

struct Params {
    o0: u32, // forward: out (N, F); backward: dinp (N, 2F)
    o1: u32, // forward: inp (N, 2F); backward: dout (N, F)
    o2: u32, // backward: inp (N, 2F)
    n: u32,  // rows
    f: u32,  // F
}
var<immediate> p: Params;


@compute @workgroup_size(WG)
fn swiglu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    if (i >= p.n * p.f) {
        return;
    }
    let x0 = p.o1 + (i / p.f) * 2u * p.f + i % p.f;
    let g = b1_ld(x0 + p.f);
    b0_st(p.o0 + i, b1_ld(x0) * (g / (1.0 + exp_(-g))));
}

// d(up) = dout * silu(gate), d(gate) = dout * up * silu'(gate), silu'(g) = s (1 + g (1 - s)).
@compute @workgroup_size(WG)
fn swiglu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    if (i >= p.n * p.f) {
        return;
    }
    let x0 = p.o2 + (i / p.f) * 2u * p.f + i % p.f;
    let u = b2_ld(x0);
    let g = b2_ld(x0 + p.f);
    let d = b1_ld(p.o1 + i);
    let s = 1.0 / (1.0 + exp_(-g));
    let o = p.o0 + (i / p.f) * 2u * p.f + i % p.f;
    b0_st(o, d * (g * s));
    b0_st(o + p.f, d * u * (s * (1.0 + g * (1.0 - s))));
}
