//! Per-method data that travels beside the advantages, as declared channels.
//!
//! An estimator declares the channels it emits ([`Estimator::emits`](super::Estimator::emits))
//! and fills them in [`RolloutAdvantage::channels`](super::RolloutAdvantage::channels); a policy
//! loss declares the channels it reads; the config checks that what the loss reads is a subset
//! of what the estimator emits. The trainer carries every channel from the estimator to the
//! loss and to the samples without knowing what any of them means (tantivy's declared needs,
//! applied to data instead of flags).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One kind of per-turn data an estimator may emit beside its advantages.
///
/// Channels are ordered as declared here, which is the order they are written in a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Channel {
    /// A2TGPO's normalised information gain `îg_{i,t}`, one per process turn (§3.5): shown in
    /// the samples.
    NormalizedInfoGain,
    /// A2TGPO's clip scale `c_{i,t} = 1 + β(2σ(îg) − 1)`, one per agent turn (1 for the final
    /// turn, §5.5): a loss that reads it scales its clip range by it, per token.
    ClipScale,
    /// GiGPO's and T2PO's anchor group of each step sample (eq. 6), one per agent turn: the
    /// group's id in the batch, numbered in first appearance over the step samples in
    /// trajectory-major order (shown in the samples and the viewer).
    StepGroup,
    /// The size, in step samples, of the anchor group of [`Channel::StepGroup`], one per agent
    /// turn.
    StepGroupSize,
}

impl Channel {
    /// Every channel, in declaration order.
    pub const ALL: [Channel; 4] = [
        Channel::NormalizedInfoGain,
        Channel::ClipScale,
        Channel::StepGroup,
        Channel::StepGroupSize,
    ];

    /// Its name: the key it is written under in samples, in the Python API and in errors.
    pub fn key(self) -> &'static str {
        match self {
            Channel::NormalizedInfoGain => "normalized_info_gain",
            Channel::ClipScale => "clip_scale",
            Channel::StepGroup => "step_group",
            Channel::StepGroupSize => "step_group_size",
        }
    }

    /// Whether it holds one value per process turn (every agent turn but the last, whose
    /// observation is not followed by another turn), rather than one per agent turn.
    pub fn per_process_turn(self) -> bool {
        matches!(self, Channel::NormalizedInfoGain)
    }

    /// The value a token takes when the channel is spread over a rollout's tokens and the
    /// token's turn has no entry (observation tokens, turns beyond the channel's, padding):
    /// the neutral value, so that a clip scale of 1 leaves the loss's own bounds; no step group
    /// (−1) of no step samples (0).
    pub fn fill(self) -> f64 {
        match self {
            Channel::NormalizedInfoGain | Channel::StepGroupSize => 0.0,
            Channel::ClipScale => 1.0,
            Channel::StepGroup => -1.0,
        }
    }
}

impl std::fmt::Display for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.key())
    }
}

/// The channel values of one rollout: per channel, one value per turn (agent turn or process
/// turn, as the channel says).
pub type Channels = BTreeMap<Channel, Vec<f64>>;

impl Channel {
    /// The channel whose [`Self::key`] is `key`.
    pub fn from_key(key: &str) -> Option<Channel> {
        Channel::ALL.into_iter().find(|c| c.key() == key)
    }
}

/// Values per channel, written inline among a record's other keys (`#[serde(flatten)]`): each
/// channel under its [`Channel::key`], in channel order. Reading keeps the keys that name a
/// channel (a `null` value reads as absent) and leaves every other key to the record's other
/// fields, so a sample line written before channels existed reads the same.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChannelValues<V>(pub BTreeMap<Channel, V>);

impl<V> std::ops::Deref for ChannelValues<V> {
    type Target = BTreeMap<Channel, V>;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl<V> std::ops::DerefMut for ChannelValues<V> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl<V: Serialize> Serialize for ChannelValues<V> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (c, v) in &self.0 {
            m.serialize_entry(c.key(), v)?;
        }
        m.end()
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for ChannelValues<V> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> serde::de::Visitor<'de> for Visit<V> {
            type Value = ChannelValues<V>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map whose channel keys hold channel values")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut out = BTreeMap::new();
                while let Some(key) = map.next_key::<String>()? {
                    match Channel::from_key(&key) {
                        Some(c) => {
                            if let Some(v) = map.next_value::<Option<V>>()? {
                                out.insert(c, v);
                            }
                        }
                        None => {
                            map.next_value::<serde::de::IgnoredAny>()?;
                        }
                    }
                }
                Ok(ChannelValues(out))
            }
        }
        d.deserialize_map(Visit(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_unique_and_the_order_is_the_declared_one() {
        let keys: Vec<&str> = Channel::ALL.iter().map(|c| c.key()).collect();
        let mut sorted = Channel::ALL.to_vec();
        sorted.sort();
        assert_eq!(sorted, Channel::ALL);
        let mut uniq = keys.clone();
        uniq.dedup();
        assert_eq!(uniq, keys);
        for c in Channel::ALL {
            assert_eq!(serde_json::to_value(c).unwrap(), c.key());
            assert_eq!(Channel::from_key(c.key()), Some(c));
        }
    }

    /// Channels written inline among other keys: in channel order, read back from among
    /// foreign keys, which they leave alone, with `null` read as absent.
    #[test]
    fn inline_channels_round_trip_among_other_keys() {
        #[derive(Debug, PartialEq, Serialize, Deserialize)]
        struct Record {
            a: u32,
            #[serde(flatten)]
            channels: ChannelValues<Vec<f64>>,
            z: Option<u32>,
        }
        let r = Record {
            a: 1,
            channels: ChannelValues(BTreeMap::from([
                (Channel::ClipScale, vec![1.1, 1.0]),
                (Channel::NormalizedInfoGain, vec![0.5]),
            ])),
            z: Some(2),
        };
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(
            json,
            r#"{"a":1,"normalized_info_gain":[0.5],"clip_scale":[1.1,1.0],"z":2}"#
        );
        assert_eq!(serde_json::from_str::<Record>(&json).unwrap(), r);
        let old: Record =
            serde_json::from_str(r#"{"a":1,"other":[3],"clip_scale":null,"z":null}"#).unwrap();
        assert!(old.channels.is_empty() && old.z.is_none());
    }
}
