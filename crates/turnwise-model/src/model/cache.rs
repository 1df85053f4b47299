//! The key/value cache for incremental decoding, owned by the caller.

use candle_core::Tensor;

use crate::error::Result;

/// Per-layer keys and values `[B, KV heads, T_cached, head_dim]` (after RoPE, before the
/// grouped-query repeat). Create one per batch of sequences and pass it to every
/// `Transformer::forward` call of that batch.
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
}

impl KvCache {
    /// An empty cache for a model with `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
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
            .map_or(0, |(k, _)| k.dims()[2])
    }

    /// Number of cached rows, if anything is cached.
    pub fn batch_size(&self) -> Option<usize> {
        self.layers
            .first()
            .and_then(|l| l.as_ref())
            .map(|(k, _)| k.dims()[0])
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.seq_len() == 0
    }

    /// Drops everything cached.
    pub fn reset(&mut self) {
        self.layers.iter_mut().for_each(|l| *l = None);
    }

    /// Keeps only the rows `rows` (a `u32` index tensor), e.g. to drop finished sequences.
    pub fn select_rows(&mut self, rows: &Tensor) -> Result<()> {
        for slot in self.layers.iter_mut().flatten() {
            let k = slot.0.index_select(rows, 0)?;
            let v = slot.1.index_select(rows, 0)?;
            *slot = (k, v);
        }
        Ok(())
    }

    pub(crate) fn slot_mut(&mut self, layer: usize) -> &mut Option<(Tensor, Tensor)> {
        &mut self.layers[layer]
    }
}
