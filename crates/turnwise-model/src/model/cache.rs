//! The key/value cache for incremental decoding, owned by the caller.

use candle_core::Tensor;

use crate::error::Result;

/// One layer's keys and values: buffers `[B, KV heads, capacity, head_dim]` whose first `len`
/// columns hold the cached positions.
///
/// With spare columns, appending a decoding step writes into the buffer in place instead of
/// concatenating (which copies the whole cache on every step). The buffers are never shared:
/// every constructor allocates them, and callers read them through [`LayerKv::k`] and
/// [`LayerKv::v`] views that do not outlive the next append.
#[derive(Debug, Clone)]
pub(crate) struct LayerKv {
    k: Tensor,
    v: Tensor,
    len: usize,
}

impl LayerKv {
    /// A full layer (no spare columns) from keys and values `[B, KV, T, D]`.
    pub(crate) fn exact(k: Tensor, v: Tensor) -> Result<Self> {
        let len = k.dims4()?.2;
        Ok(Self { k, v, len })
    }

    /// Cached keys `[B, KV, len, D]` (a view of the buffer).
    pub(crate) fn k(&self) -> Result<Tensor> {
        Ok(self.k.narrow(2, 0, self.len)?)
    }

    /// Cached values `[B, KV, len, D]` (a view of the buffer).
    pub(crate) fn v(&self) -> Result<Tensor> {
        Ok(self.v.narrow(2, 0, self.len)?)
    }

    /// The whole key and value buffers (`capacity` columns, the first `len` valid); contiguous.
    pub(crate) fn buffers(&self) -> (&Tensor, &Tensor) {
        (&self.k, &self.v)
    }

    /// Number of cached positions.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Number of columns the buffers have room for.
    fn capacity(&self) -> usize {
        self.k.dims()[2]
    }

    /// A layer over buffers `k`, `v` (`[B, KV, capacity, D]`, contiguous, held by no one
    /// else: appends write into them) whose first `len` columns are valid.
    pub(crate) fn from_buffers(k: Tensor, v: Tensor, len: usize) -> Self {
        Self { k, v, len }
    }

    /// Appends keys and values `[B, KV, T, D]`. In place when the buffers have room; otherwise
    /// the layer moves to new buffers with `reserve` spare columns beyond the new length
    /// (`reserve = 0`: exactly the new length, a plain concatenation).
    fn append(&mut self, k: &Tensor, v: &Tensor, reserve: usize) -> Result<()> {
        let t = k.dims4()?.2;
        let need = self.len + t;
        if self.capacity() >= need && reserve > 0 {
            self.k.slice_set(&k.contiguous()?, 2, self.len)?;
            self.v.slice_set(&v.contiguous()?, 2, self.len)?;
        } else if reserve == 0 {
            self.k = Tensor::cat(&[&self.k()?, k], 2)?;
            self.v = Tensor::cat(&[&self.v()?, v], 2)?;
        } else {
            let grow = |old: &Tensor, new: &Tensor| -> Result<Tensor> {
                let (b, h, _, d) = new.dims4()?;
                let buf = Tensor::zeros((b, h, need + reserve, d), new.dtype(), new.device())?;
                if self.len > 0 {
                    buf.slice_set(&old.narrow(2, 0, self.len)?.contiguous()?, 2, 0)?;
                }
                buf.slice_set(&new.contiguous()?, 2, self.len)?;
                Ok(buf)
            };
            let (nk, nv) = (grow(&self.k, k)?, grow(&self.v, v)?);
            (self.k, self.v) = (nk, nv);
        }
        self.len = need;
        Ok(())
    }
}

/// Per-layer keys and values `[B, KV heads, T_cached, head_dim]` (after RoPE, before the
/// grouped-query repeat). Create one per batch of sequences and pass it to every
/// `Transformer::forward` call of that batch.
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<Option<LayerKv>>,
    reserve: usize,
    /// Keys and values some rows see before their own columns, per group of rows (cascade
    /// attention, [`crate::model::ops::attention::attention_with_shared`]); not counted in
    /// `seq_len`.
    shared: Vec<SharedPrefixKv>,
}

/// Keys and values `[1, KV, P, D]` per layer that the rows `rows` flags see before their own
/// cached columns (a prompt prefilled once for several sequences of a batch).
#[derive(Debug, Clone)]
pub(crate) struct SharedPrefixKv {
    /// Per layer: keys and values `[1, KV, P, D]`.
    pub(crate) layers: Vec<(Tensor, Tensor)>,
    /// One flag per batch row.
    pub(crate) rows: std::sync::Arc<[bool]>,
}

impl KvCache {
    /// An empty cache for a model with `num_layers` layers; each append concatenates.
    pub fn new(num_layers: usize) -> Self {
        Self::with_reserve(num_layers, 0)
    }

    /// An empty cache that keeps `reserve` spare positions per layer: decoding steps write
    /// into them in place, and a full buffer moves to a new one with `reserve` spare positions
    /// again, so a long decode copies the cache once every `reserve` steps instead of on every
    /// step.
    pub fn with_reserve(num_layers: usize, reserve: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            reserve,
            shared: Vec::new(),
        }
    }

    /// Number of layers the cache was made for.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Number of cached positions (0 when empty).
    pub fn seq_len(&self) -> usize {
        self.layers
            .first()
            .and_then(|l| l.as_ref())
            .map_or(0, LayerKv::len)
    }

    /// Number of cached rows, if anything is cached.
    pub fn batch_size(&self) -> Option<usize> {
        self.layers
            .first()
            .and_then(|l| l.as_ref())
            .map(|l| l.k.dims()[0])
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.seq_len() == 0
    }

    /// Drops everything cached.
    pub fn reset(&mut self) {
        self.layers.iter_mut().for_each(|l| *l = None);
        self.shared.clear();
    }

    /// Keeps only the rows `rows` (a `u32` index tensor), e.g. to drop finished sequences.
    pub fn select_rows(&mut self, rows: &Tensor) -> Result<()> {
        if !self.shared.is_empty() {
            let keep = rows.to_dtype(candle_core::DType::U32)?.to_vec1::<u32>()?;
            for s in &mut self.shared {
                s.rows = keep.iter().map(|&r| s.rows[r as usize]).collect();
            }
        }
        for slot in self.layers.iter_mut().flatten() {
            let k = slot.k.index_select(rows, 0)?;
            let v = slot.v.index_select(rows, 0)?;
            *slot = LayerKv::from_buffers(k, v, slot.len);
        }
        Ok(())
    }

    /// Appends layer `layer`'s new keys and values `[B, KV, T, D]` and returns all of its
    /// cached keys and values (views valid until the next append).
    pub(crate) fn append(
        &mut self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let reserve = self.reserve;
        let slot = &mut self.layers[layer];
        match slot {
            Some(l) => l.append(k, v, reserve)?,
            None if reserve == 0 => *slot = Some(LayerKv::exact(k.clone(), v.clone())?),
            None => {
                // An empty layer with no room: the append allocates the buffers.
                let mut l = LayerKv::from_buffers(k.narrow(2, 0, 0)?, v.narrow(2, 0, 0)?, 0);
                l.append(k, v, reserve)?;
                *slot = Some(l);
            }
        }
        let l = slot.as_ref().expect("filled above");
        Ok((l.k()?, l.v()?))
    }

    /// Sets the groups of keys and values some rows see before their own columns (each row in
    /// one group at most; empty: none).
    pub(crate) fn set_shared(&mut self, shared: Vec<SharedPrefixKv>) {
        self.shared = shared;
    }

    /// Layer `layer`'s shared keys and values, one entry per group (empty: none).
    pub(crate) fn shared_keys(&self, layer: usize) -> Vec<crate::model::ops::SharedKeys> {
        self.shared
            .iter()
            .filter_map(|s| {
                let (k, v) = s.layers.get(layer)?;
                Some(crate::model::ops::SharedKeys {
                    k: k.clone(),
                    v: v.clone(),
                    rows: std::sync::Arc::clone(&s.rows),
                })
            })
            .collect()
    }

    pub(crate) fn slot_mut(&mut self, layer: usize) -> &mut Option<LayerKv> {
        &mut self.layers[layer]
    }
}
