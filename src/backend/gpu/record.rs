//! Recording work: ops append dispatches to one compute pass of one command encoder, which is
//! submitted only when the host needs the device (an upload, a download, a synchronize), so a
//! training step is a few command buffers with no host wait inside. Bind groups are cached by
//! the windows they bind, so a step that repeats the last one creates none.

use super::context::Context;
use super::context::{IMMEDIATE_BYTES, MAX_BINDINGS};
use super::kernel::K;
use super::memory::Win;
use super::pipelines::Kernels;
use crate::core::profile::{Kind, KINDS};
use anyhow::Result;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Bind groups kept at most (a training step uses a few hundred).
const BIND_GROUP_CACHE: usize = 8192;
/// Timed passes between two reads of their timestamps.
const TIMED_PASSES: u32 = 2048;
/// Largest staging buffer for downloads.
const STAGING_BYTES: u64 = 64 << 20;

type BgKey = (usize, [(u64, u64, u64); MAX_BINDINGS]);

pub struct Recorder {
    encoder: Option<wgpu::CommandEncoder>,
    pass: Option<wgpu::ComputePass<'static>>,
    /// The layer kind whose ops are being recorded while profiling: every pass opened meanwhile
    /// is timed for it (a submit inside the region ends a pass; the next one is timed too).
    region: Option<Kind>,
    bind_groups: HashMap<BgKey, wgpu::BindGroup>,
    staging: Option<wgpu::Buffer>,
    prof: Option<Profiler>,
    /// Submissions so far, and after how many to lose the device (a test of the error path).
    submits: usize,
    lose_after: Option<usize>,
}

/// Timestamp queries around the passes of each layer kind (`llmrs bench`).
struct Profiler {
    queries: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    readback: wgpu::Buffer,
    /// The kind of each timed pass since the last read (pass i wrote queries 2i and 2i + 1).
    kinds: Vec<Kind>,
    seconds: [f64; KINDS.len()],
    /// Nanoseconds per tick.
    period: f64,
}

impl Recorder {
    pub fn new(lose_after: Option<usize>) -> Self {
        Recorder {
            encoder: None,
            pass: None,
            region: None,
            bind_groups: HashMap::new(),
            staging: None,
            prof: None,
            submits: 0,
            lose_after,
        }
    }

    fn encoder(&mut self, ctx: &Context) -> &mut wgpu::CommandEncoder {
        self.encoder.get_or_insert_with(|| ctx.device.create_command_encoder(&Default::default()))
    }

    /// The current pass, opened (and timed, inside a profiled region) if there is none.
    fn pass(&mut self, ctx: &Context) -> &mut wgpu::ComputePass<'static> {
        if self.pass.is_none() {
            let timed = match (&mut self.prof, self.region) {
                (Some(p), Some(kind)) if (p.kinds.len() as u32) < TIMED_PASSES => {
                    let i = p.kinds.len() as u32;
                    p.kinds.push(kind);
                    Some((p.queries.clone(), i))
                }
                _ => None,
            };
            let writes = timed.as_ref().map(|(q, i)| wgpu::ComputePassTimestampWrites {
                query_set: q,
                beginning_of_pass_write_index: Some(2 * i),
                end_of_pass_write_index: Some(2 * i + 1),
            });
            let desc = wgpu::ComputePassDescriptor { label: None, timestamp_writes: writes };
            let p = self.encoder(ctx).begin_compute_pass(&desc).forget_lifetime();
            self.pass = Some(p);
        }
        self.pass.as_mut().expect("just made")
    }

    /// Record kernel `k` over `groups` workgroups, binding `wins` (in binding order) and
    /// passing `imm` as its immediates.
    pub fn dispatch(&mut self, ctx: &Context, ks: &Kernels, k: K, wins: &[Win], imm: &[u32], groups: [u32; 3]) {
        let n = Kernels::bindings(k);
        assert_eq!(wins.len(), n, "{k:?} binds {n} buffers");
        assert!(imm.len() * 4 <= IMMEDIATE_BYTES as usize, "{k:?}: too many immediates");
        if groups.contains(&0) {
            return;
        }
        let mut key = (n, [(0u64, 0u64, 0u64); MAX_BINDINGS]);
        for (i, w) in wins.iter().enumerate() {
            key.1[i] = (w.chunk, w.byte_off, w.byte_len);
        }
        if !self.bind_groups.contains_key(&key) {
            if self.bind_groups.len() >= BIND_GROUP_CACHE {
                self.bind_groups.clear();
            }
            let entries: Vec<_> = wins
                .iter()
                .enumerate()
                .map(|(i, w)| wgpu::BindGroupEntry {
                    binding: i as u32,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: &w.buf,
                        offset: w.byte_off,
                        size: wgpu::BufferSize::new(w.byte_len),
                    }),
                })
                .collect();
            let bg = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &ks.layouts[n],
                entries: &entries,
            });
            self.bind_groups.insert(key, bg);
        }
        let bg = self.bind_groups[&key].clone();
        let mut words = [0u32; IMMEDIATE_BYTES as usize / 4];
        words[..imm.len()].copy_from_slice(imm);
        let pass = self.pass(ctx);
        pass.set_pipeline(ks.pipeline(k));
        pass.set_bind_group(0, &bg, &[]);
        pass.set_immediates(0, bytemuck::cast_slice(&words));
        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
    }

    /// Forget the bind groups (their buffers were freed).
    pub fn forget_bind_groups(&mut self) {
        self.bind_groups.clear();
    }

    /// Submit what was recorded (no wait).
    pub fn submit(&mut self, ctx: &Context) {
        self.pass = None;
        if let Some(enc) = self.encoder.take() {
            ctx.queue.submit([enc.finish()]);
            self.submits += 1;
            if self.lose_after == Some(self.submits) {
                ctx.destroy();
            }
        }
    }

    /// Copy `len` bytes from each (buffer, offset, len) span into `dst`, in order: through a
    /// staging buffer, a piece at a time, waiting for each.
    pub fn read(&mut self, ctx: &Context, spans: &[(wgpu::Buffer, u64, u64)], dst: &mut [u8]) -> Result<()> {
        self.submit(ctx);
        let mut filled = 0usize;
        for (buf, off, len) in spans {
            let mut done = 0u64;
            while done < *len {
                let n = (len - done).min(STAGING_BYTES);
                let staging = self.staging_buffer(ctx, n);
                let mut enc = ctx.device.create_command_encoder(&Default::default());
                enc.copy_buffer_to_buffer(buf, off + done, &staging, 0, n);
                ctx.queue.submit([enc.finish()]);
                map_read(ctx, &staging, n, &mut dst[filled..filled + n as usize])?;
                filled += n as usize;
                done += n;
            }
        }
        Ok(())
    }

    fn staging_buffer(&mut self, ctx: &Context, n: u64) -> wgpu::Buffer {
        if self.staging.as_ref().is_none_or(|s| s.size() < n) {
            let size = n.next_power_of_two().clamp(1 << 16, STAGING_BYTES);
            self.staging = Some(ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("staging"),
                size,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }));
        }
        self.staging.clone().expect("just made")
    }

    // ---- profiling ---------------------------------------------------------------------------

    /// Turn timing by layer kind on (clearing it) or off. Without timestamp queries on the
    /// adapter nothing is timed.
    pub fn set_profiling(&mut self, ctx: &Context, on: bool) {
        self.pass = None;
        self.region = None;
        self.prof = None;
        if !(on && ctx.timestamps) {
            return;
        }
        let queries = ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("profile"),
            ty: wgpu::QueryType::Timestamp,
            count: 2 * TIMED_PASSES,
        });
        let bytes = 2 * TIMED_PASSES as u64 * 8;
        let buffer = |usage| {
            ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size: bytes,
                usage,
                mapped_at_creation: false,
            })
        };
        self.prof = Some(Profiler {
            queries,
            resolve: buffer(wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC),
            readback: buffer(wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST),
            kinds: vec![],
            seconds: [0.0; KINDS.len()],
            period: ctx.queue.get_timestamp_period() as f64,
        });
    }

    /// The ops from now until [`Recorder::profile_end`] run in passes timed for `kind`.
    pub fn profile_begin(&mut self, ctx: &Context, kind: Kind) -> Result<()> {
        let Some(p) = &self.prof else { return Ok(()) };
        if p.kinds.len() as u32 + 1 >= TIMED_PASSES {
            self.read_timestamps(ctx)?;
        }
        self.pass = None;
        self.region = Some(kind);
        Ok(())
    }

    pub fn profile_end(&mut self) {
        if self.region.take().is_some() {
            self.pass = None;
        }
    }

    /// Add the timed passes so far to the totals (waits for the device). The passes' record is
    /// cleared whatever happens, so the query set never overflows.
    pub fn read_timestamps(&mut self, ctx: &Context) -> Result<()> {
        let Some(p) = &mut self.prof else { return Ok(()) };
        let kinds = std::mem::take(&mut p.kinds);
        if kinds.is_empty() {
            return Ok(());
        }
        let (queries, resolve, readback) = (p.queries.clone(), p.resolve.clone(), p.readback.clone());
        let bytes = 2 * kinds.len() as u64 * 8;
        self.pass = None;
        let enc = self.encoder(ctx);
        enc.resolve_query_set(&queries, 0..2 * kinds.len() as u32, &resolve, 0);
        enc.copy_buffer_to_buffer(&resolve, 0, &readback, 0, bytes);
        self.submit(ctx);
        let mut raw = vec![0u8; bytes as usize];
        map_read(ctx, &readback, bytes, &mut raw)?;
        let ticks: &[u64] = bytemuck::cast_slice(&raw);
        let p = self.prof.as_mut().expect("checked");
        for (i, kind) in kinds.into_iter().enumerate() {
            p.seconds[kind as usize] += ticks[2 * i + 1].saturating_sub(ticks[2 * i]) as f64 * p.period * 1e-9;
        }
        Ok(())
    }

    /// Seconds per kind so far (empty when the adapter cannot time passes).
    pub fn profile_totals(&mut self, ctx: &Context) -> Result<Vec<(Kind, f64)>> {
        self.read_timestamps(ctx)?;
        Ok(match &self.prof {
            Some(p) => KINDS.iter().map(|&k| (k, p.seconds[k as usize])).collect(),
            None => vec![],
        })
    }
}

/// The first `n` bytes of a MAP_READ buffer, after everything submitted has run, into `dst`.
/// The buffer is left unmapped on every path (a map still pending is aborted), so a failed read
/// leaves it usable.
fn map_read(ctx: &Context, buf: &wgpu::Buffer, n: u64, dst: &mut [u8]) -> Result<()> {
    let slot = Arc::new(Mutex::new(None));
    let s = slot.clone();
    buf.slice(..n).map_async(wgpu::MapMode::Read, move |r| {
        *s.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
    });
    let waited = ctx.wait();
    let mapped = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
    let fail = |what: String| anyhow::anyhow!("reading from the GPU {}: {what}", ctx.name());
    let result = match (&waited, &mapped) {
        (Err(_), _) => waited,
        (Ok(()), Some(Ok(()))) => match buf.slice(..n).get_mapped_range() {
            Ok(view) => {
                dst.copy_from_slice(&view);
                Ok(())
            }
            Err(e) => Err(fail(e.to_string())),
        },
        (Ok(()), Some(Err(e))) => ctx.check().and(Err(fail(e.to_string()))),
        (Ok(()), None) => ctx.check().and(Err(fail("the copy never completed".into()))),
    };
    // A map that failed left the buffer unmapped; one that succeeded or is pending must end.
    if !matches!(mapped, Some(Err(_))) {
        buf.unmap();
    }
    result
}
