// Shared by every kernel module: prepended to each file when its pipelines are built
// (src/backend/gpu/kernel.rs), so these names are defined once.
//
// Conventions of every kernel: each storage buffer is a window of one device buffer
// (src/backend/gpu/memory.rs), declared read_write so that any two windows of the same buffer may be
// bound to one dispatch; element offsets into the windows and all shapes come as immediates
// (`p`, at most 128 bytes); a thread whose index is past its work does nothing.

// Threads per workgroup of the elementwise and row kernels (src/backend/gpu/mod.rs: WG).
const WG: u32 = 256u;

// The workgroup's index in a grid of up to three dimensions (a dimension holds at most 65535
// workgroups; src/backend/gpu/mod.rs: GpuBackend::dispatch).
fn group_id(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return (wid.z * nwg.y + wid.y) * nwg.x + wid.x;
}

// Whether x is finite, from its bits: a compiler may assume that no float is NaN or infinite,
// and would fold a comparison away.
fn finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u;
}

fn is_nan(x: f32) -> bool {
    let b = bitcast<u32>(x);
    return (b & 0x7f800000u) == 0x7f800000u && (b & 0x007fffffu) != 0u;
}

// e^x as the CPU backend's (cpu/math.rs, Cephes expf: range reduction by ln 2, degree-6
// polynomial, scale by 2^n), so both backends round alike; relative error below 2e-7 on
// [-87, 88], inputs outside clamped. A NaN stays NaN, so a NaN logit or score reaches the loss.
// n is rounded with round(), not the CPU's add-and-subtract of 1.5 * 2^23 (the same number):
// shader compilers may fold (a + b) - b to a.
fn exp_(x0: f32) -> f32 {
    if (is_nan(x0)) {
        return x0;
    }
    let x = clamp(x0, -87.0, 88.0);
    let n = round(x * 1.442695);
    let r = x - n * 0.6933594 - n * -2.1219444e-4;
    var q = 1.9875691e-4;
    q = q * r + 1.3981999e-3;
    q = q * r + 8.333452e-3;
    q = q * r + 4.1665796e-2;
    q = q * r + 1.6666665e-1;
    q = q * r + 0.5;
    let y = q * r * r + r + 1.0;
    return y * bitcast<f32>(u32(i32(n) + 127) << 23u);
}

// tanh(x) = 1 - 2 / (e^(2x) + 1), saturating to +-1 (cpu/math.rs).
fn tanh_(x: f32) -> f32 {
    return 1.0 - 2.0 / (exp_(2.0 * x) + 1.0);
}

// Workgroup reductions in a fixed order (the same tree on every run and every device, so a
// result never depends on scheduling). Call from uniform control flow; every thread gets the
// result.
var<workgroup> red: array<f32, WG>;

fn wg_sum(v: f32, tid: u32) -> f32 {
    red[tid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s >> 1u) {
        if (tid < s) {
            red[tid] = red[tid] + red[tid + s];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn wg_max(v: f32, tid: u32) -> f32 {
    red[tid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s >> 1u) {
        if (tid < s) {
            red[tid] = max(red[tid], red[tid + s]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

const NEG_INF: f32 = -3.4028235e38;

// bf16 storage (src/backend/gpu/bf16.rs): element e of a bf16 buffer is half e & 1 of word e >> 1,
// element 2w in the low half.

// Element e's half of its word w, as f32 (exact: a bf16 is the top half of an f32).
fn half_at(w: u32, e: u32) -> f32 {
    return bitcast<f32>(select(w << 16u, w & 0xffff0000u, (e & 1u) == 1u));
}

// f32 to bf16 bits, rounded to nearest even; a NaN stays a quiet NaN with the top of its
// payload (cpu/bf16.rs: from_f32).
fn f32_to_bf16(v: f32) -> u32 {
    let bits = bitcast<u32>(v);
    if (is_nan(v)) {
        return (bits >> 16u) | 0x0040u;
    }
    return (bits + 0x7fffu + ((bits >> 16u) & 1u)) >> 16u;
}

// murmur3's 32-bit finalizer (cpu/bf16.rs: mix).
fn mix(h0: u32) -> u32 {
    var v = h0;
    v = v ^ (v >> 16u);
    v = v * 0x85ebca6bu;
    v = v ^ (v >> 13u);
    v = v * 0xc2b2ae35u;
    return v ^ (v >> 16u);
}

// f32 to bf16 bits rounded stochastically with the noise of (seed, index), the CPU's bits for
// an index below 2^32 (cpu/bf16.rs: from_f32_stochastic, whose key of the index's high half
// is then seed * 0x85ebca6b). An infinity or a NaN rounds to nearest.
fn f32_to_bf16_stochastic(v: f32, seed: u32, index: u32) -> u32 {
    let bits = bitcast<u32>(v);
    if (!finite(v)) {
        return f32_to_bf16(v);
    }
    let noise = mix(index ^ (seed * 0x85ebca6bu));
    return (bits + (noise & 0xffffu)) >> 16u;
}
