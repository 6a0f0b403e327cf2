// Residual connection (cpu/residual.rs): out = a + b. Its backward is the identity.

struct Params {
    out: u32,
    a: u32,
    b: u32,
    n: u32,
}
var<immediate> p: Params;


@compute @workgroup_size(WG)
fn residual_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    if (i < p.n) {
        out_st(p.out + i, a_ld(p.a + i) + b_ld(p.b + i));
    }
}
