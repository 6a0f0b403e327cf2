// GELU, tanh approximation (cpu/gelu.rs), with the CPU's tanh.

struct Params {
    x: u32, // forward: out; backward: d (in place)
    y: u32, // inp
    n: u32,
}
var<immediate> p: Params;


const SCALE: f32 = 0.7978846; // sqrt(2 / pi)

// out = gelu(inp).
@compute @workgroup_size(WG)
fn gelu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    if (i < p.n) {
        let v = y_ld(p.y + i);
        let cube = 0.044715 * v * v * v;
        x_st(p.x + i, 0.5 * v * (1.0 + tanh_(SCALE * (v + cube))));
    }
}

// d *= gelu'(inp): d(out) becomes d(inp).
@compute @workgroup_size(WG)
fn gelu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    if (i < p.n) {
        let v = y_ld(p.y + i);
        let cube = 0.044715 * v * v * v;
        let th = tanh_(SCALE * (v + cube));
        let sech2 = 1.0 - th * th;
        let g = 0.5 * (1.0 + th) + v * 0.5 * sech2 * SCALE * (1.0 + 3.0 * 0.044715 * v * v);
        x_st(p.x + i, x_ld(p.x + i) * g);
    }
}
