// bf16 storage (src/backend/gpu/bf16.rs, cpu/bf16.rs): conversions between f32 and bf16 (the top 16
// bits of an f32). WGSL has no 16-bit storage type, so a bf16 buffer is an array<u32> of two
// elements a word, element 2w in the low half of word w and 2w + 1 in the high half. A kernel
// that writes bf16 runs one thread per word, so no two threads write one word; a word that is
// only half inside the operand keeps its other half (it belongs to another tensor).

struct Params {
    dst: u32,         // offset of the output (elements of its window)
    src: u32,         // offset of the input
    n: u32,           // elements
    first: u32,       // stochastic rounding: the place of dst's first element in its allocation
    seed: u32,        // stochastic rounding's seed
    flags: u32,       // 1: round stochastically; 2: leave dst as it is if the step's stats skip it
    stats: u32,       // offset of the step's stats (2): [mean loss, squared global norm]
    max_loss: f32,    // with flags & 2: the limits of SkipAbove (no infinities)
    max_norm_sq: f32,
    value: f32,       // fill_bf16
}
var<immediate> p: Params;

@group(0) @binding(0) var<storage, read_write> h: array<u32>; // bf16, two a word
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> st: array<f32>;

// bf16 bits (the low 16 of b) to f32: exact.
fn bf16_to_f32(b: u32) -> f32 {
    return bitcast<f32>(b << 16u);
}

// Element e of h as f32.
fn load_bf16(e: u32) -> f32 {
    return bf16_to_f32(h[e >> 1u] >> (16u * (e & 1u)));
}

// x[src + i] = h's element dst + i as f32, for i < n.
@compute @workgroup_size(WG)
fn widen(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) tid: u32) {
    let i = group_id(wid, nwg) * WG + tid;
    if (i < p.n) {
        x[p.src + i] = load_bf16(p.dst + i);
    }
}

// The words of h that elements dst..dst+n touch: thread t writes word (dst >> 1) + t.
fn words() -> u32 {
    if (p.n == 0u) {
        return 0u;
    }
    return ((p.dst + p.n - 1u) >> 1u) - (p.dst >> 1u) + 1u;
}

// h's elements dst + i = x[src + i] rounded (to nearest even, or stochastically with flags & 1),
// for i < n; with flags & 2, nothing when the step's stats say the step is skipped (a skipped
// AdamW step leaves the working copy as it was).
@compute @workgroup_size(WG)
fn narrow(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) tid: u32) {
    let t = group_id(wid, nwg) * WG + tid;
    if (t >= words()) {
        return;
    }
    if ((p.flags & 2u) != 0u) {
        let loss = st[p.stats];
        let norm_sq = st[p.stats + 1u];
        if (!(finite(loss) && finite(norm_sq) && loss <= p.max_loss && norm_sq <= p.max_norm_sq)) {
            return;
        }
    }
    let w = (p.dst >> 1u) + t;
    var word = 0u;
    for (var half = 0u; half < 2u; half = half + 1u) {
        let e = 2u * w + half;
        var b: u32;
        if (e >= p.dst && e - p.dst < p.n) {
            let v = x[p.src + (e - p.dst)];
            if ((p.flags & 1u) != 0u) {
                b = f32_to_bf16_stochastic(v, p.seed, p.first + (e - p.dst));
            } else {
                b = f32_to_bf16(v);
            }
        } else {
            b = (h[w] >> (16u * half)) & 0xffffu; // another tensor's half: kept
        }
        word = word | ((b & 0xffffu) << (16u * half));
    }
    h[w] = word;
}

// h's elements dst + i = value (as bf16, to nearest even) for i < n.
@compute @workgroup_size(WG)
fn fill_bf16(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) tid: u32) {
    let t = group_id(wid, nwg) * WG + tid;
    if (t >= words()) {
        return;
    }
    let w = (p.dst >> 1u) + t;
    let b = f32_to_bf16(p.value);
    var word = 0u;
    for (var half = 0u; half < 2u; half = half + 1u) {
        let e = 2u * w + half;
        var v = b;
        if (!(e >= p.dst && e - p.dst < p.n)) {
            v = (h[w] >> (16u * half)) & 0xffffu;
        }
        word = word | (v << (16u * half));
    }
    h[w] = word;
}
