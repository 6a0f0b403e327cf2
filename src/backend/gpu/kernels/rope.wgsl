// The rotary position embedding (cpu/rope.rs), in place on the q and k heads of qkv (N, QKV):
// within each head, elements i and i + HS/2 rotate by the angle of pair i at the row's
// position. One thread per (row, head, pair).

struct Params {
    x: u32,     // qkv rows r0..r0+n
    tab: u32,   // the table's rows pos..pos+T: HS/2 cosines then HS/2 sines each
    n: u32,     // rows in this dispatch
    r0: u32,    // the first row's index in the pass (row r sits at position pos + r % T)
    t: u32,     // T
    heads: u32, // NH + KV: the rotated heads of a row
    qkv: u32,   // QKV: a row's width
    hs: u32,    // HS
    sign: f32,  // 1 forward, -1 backward (the rotation's transpose)
}
var<immediate> p: Params;


@compute @workgroup_size(WG)
fn rope(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
    let half = p.hs / 2u;
    let i = group_id(wid, nwg) * WG + tid;
    if (i >= p.n * p.heads * half) {
        return;
    }
    let row = i / (p.heads * half);
    let h = (i / half) % p.heads;
    let j = i % half;
    let t0 = p.tab + ((p.r0 + row) % p.t) * p.hs;
    let cs = tab_ld(t0 + j);
    let sn = p.sign * tab_ld(t0 + half + j);
    let at = p.x + row * p.qkv + h * p.hs + j;
    let a = x_ld(at);
    let b = x_ld(at + half);
    x_st(at, a * cs - b * sn);
    x_st(at + half, b * cs + a * sn);
}
