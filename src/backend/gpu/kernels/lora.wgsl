// LoRA's one element-wise step (src/backend/gpu/lora.rs; its GEMMs are matmul.wgsl's).

struct Params {
    x: u32,     // offset
    n: u32,     // elements
    scale: f32,
}
var<immediate> p: Params;

@group(0) @binding(0) var<storage, read_write> x: array<f32>;

// x[i] *= scale for i < n.
@compute @workgroup_size(WG)
fn lora_scale(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    if (i < p.n) {
        x[p.x + i] = x[p.x + i] * p.scale;
    }
}
