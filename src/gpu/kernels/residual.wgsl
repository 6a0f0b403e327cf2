// Residual connection (cpu/residual.rs): out = a + b. Its backward is the identity.

struct Params {
    out: u32,
    a: u32,
    b: u32,
    n: u32,
}
var<immediate> p: Params;

@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;

@compute @workgroup_size(WG)
fn residual_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    if (i < p.n) {
        out[p.out + i] = a[p.a + i] + b[p.b + i];
    }
}
