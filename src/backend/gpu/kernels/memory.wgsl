// Filling and copying buffers (src/backend/gpu/memory.rs, src/backend/gpu/mod.rs).

struct Params {
    dst: u32,   // offset of x
    n: u32,     // fill: elements; copy_rows: columns of each row
    value: f32, // fill
    rows: u32,  // copy_rows
    d_rs: u32,  // copy_rows: row stride of x
    src: u32,   // copy_rows: offset of y
    s_rs: u32,  // copy_rows: row stride of y
    flags: u32, // column_sums: 1 = add to x
}
var<immediate> p: Params;


// x[dst + i] = value for i < n.
@compute @workgroup_size(WG)
fn fill(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    if (i < p.n) {
        x_st(p.dst + i, p.value);
    }
}

// x[dst + r*d_rs + j] = y[src + r*s_rs + j] for r < rows, j < n.
@compute @workgroup_size(WG)
fn copy_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    if (i < p.rows * p.n) {
        let r = i / p.n;
        let j = i % p.n;
        x_st(p.dst + r * p.d_rs + j, y_ld(p.src + r * p.s_rs + j));
    }
}

// x[dst + j] [+]= the sum over r < rows of y[src + r*n + j], in order, for j < n: the second
// half of a column sum whose first half left one partial sum per block of rows in y.
@compute @workgroup_size(WG)
fn column_sums(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) tid: u32) {
    let j = group_id(wid, nwg) * WG + tid;
    if (j >= p.n) {
        return;
    }
    var s = 0.0;
    for (var r = 0u; r < p.rows; r = r + 1u) {
        s = s + y_ld(p.src + r * p.n + j);
    }
    if ((p.flags & 1u) != 0u) {
        s = x_ld(p.dst + j) + s;
    }
    x_st(p.dst + j, s);
}
