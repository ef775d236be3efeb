//! Reading a configuration from a caller's fields: the spec-name table of the
//! group kinds with their defaults, and the manager's options by name.
//!
//! A caller (the Python binding) hands over the fields of one group's spec
//! (pagedkv's `core_spec()` dict) through [`SpecFields`], and each option
//! through [`OptionValue`]: it converts the values the core asks for; which
//! fields a kind reads, their defaults and their ranges are decided here.

use super::{AttentionKind, GroupSpec, MambaCacheMode, ManagerConfig};
use crate::error::Error;
use crate::hash::HashAlgo;

/// One group's spec as a caller holds it, read field by field.
pub trait SpecFields {
    /// The error of a read, and of the core's refusals.
    type Error: From<Error>;
    /// The text under `key`; `None` when the key is absent (a value that is
    /// no text is the caller's error).
    ///
    /// # Errors
    /// A value that is not text.
    fn text(&self, key: &str) -> Result<Option<String>, Self::Error>;
    /// The integer under `key`; `None` when the key is absent (a null value
    /// is no integer).
    ///
    /// # Errors
    /// A value that is not an integer.
    fn int(&self, key: &str) -> Result<Option<i64>, Self::Error>;
    /// The integer under `key`; `None` when the key is absent or null.
    ///
    /// # Errors
    /// A value that is neither an integer nor null.
    fn int_or_null(&self, key: &str) -> Result<Option<i64>, Self::Error>;
    /// The truth value under `key`; `None` when the key is absent.
    ///
    /// # Errors
    /// A value that is not a bool.
    fn flag(&self, key: &str) -> Result<Option<bool>, Self::Error>;
}

/// One option's value as a caller holds it, read as the option needs it.
pub trait OptionValue {
    /// The error of a read, and of the core's refusals.
    type Error: From<Error>;
    /// A bool.
    ///
    /// # Errors
    /// Another value.
    fn flag(&self) -> Result<bool, Self::Error>;
    /// A float.
    ///
    /// # Errors
    /// Another value.
    fn float(&self) -> Result<f64, Self::Error>;
    /// An integer, `None` for a null value.
    ///
    /// # Errors
    /// Another value.
    fn int(&self) -> Result<Option<i64>, Self::Error>;
    /// Integers.
    ///
    /// # Errors
    /// Another value.
    fn ints(&self) -> Result<Vec<u32>, Self::Error>;
    /// Text.
    ///
    /// # Errors
    /// Another value.
    fn text(&self) -> Result<String, Self::Error>;
    /// A hash seed: text, `None` for a null value (an integer's decimal form
    /// is the caller's to give).
    ///
    /// # Errors
    /// Another value.
    fn seed(&self) -> Result<Option<String>, Self::Error>;
}

/// An integer setting in the type the core keeps it in; a value that does
/// not fit is a bad configuration (each setting's accepted range is checked
/// when the manager is built).
///
/// # Errors
/// [`Error::InvalidConfig`] naming the setting.
pub fn config_int<T: TryFrom<i64>>(name: &str, v: i64) -> Result<T, Error> {
    T::try_from(v).map_err(|_| {
        Error::InvalidConfig(if v < 0 {
            format!("{name} must be non-negative, got {v}")
        } else {
            format!("{name} {v} is too large")
        })
    })
}

/// An optional integer setting (`None` stays unset).
fn optional_int<T: TryFrom<i64>, V: OptionValue>(name: &str, v: &V) -> Result<Option<T>, V::Error> {
    Ok(v.int()?.map(|x| config_int(name, x)).transpose()?)
}

/// A field every spec of its kind carries.
fn required_u32<F: SpecFields>(f: &F, key: &str) -> Result<u32, F::Error> {
    let v = f
        .int(key)?
        .ok_or_else(|| Error::InvalidConfig(format!("group spec lacks {key:?}")))?;
    Ok(config_int(key, v)?)
}

impl AttentionKind {
    /// The kind named `name` in a group's spec (pagedkv's `core_spec()`
    /// `kind`), with the fields that kind reads from `f` and their defaults.
    /// [`Self::spec_name`] is the reverse.
    ///
    /// # Errors
    /// An unknown kind name, a missing field, a value out of range
    /// ([`Error::InvalidConfig`]); what `f` refuses to read.
    pub fn from_spec<F: SpecFields>(name: &str, f: &F) -> Result<Self, F::Error> {
        Ok(match name {
            "full_attention" => Self::FullAttention,
            "mla_attention" => Self::MlaAttention,
            "sliding_window" => {
                let window = required_u32(f, "sliding_window")?;
                if f.flag("bounded_replay")?.unwrap_or(false) {
                    Self::ReplayedSlidingWindow { window }
                } else {
                    Self::SlidingWindow { window }
                }
            }
            "circular_buffer" => Self::CircularBuffer,
            "engine_managed" => Self::EngineManaged,
            "hisparse_resident" => Self::HiSparseResident,
            "hisparse_hot" => Self::HiSparseHot {
                blocks_per_request: required_u32(f, "blocks_per_request")?,
            },
            "chunked_local_attention" => Self::ChunkedLocal {
                chunk: required_u32(f, "attention_chunk_size")?,
            },
            "cross_attention" => Self::CrossAttention,
            "sink_full_attention" => Self::SinkFullAttention {
                sink_len: required_u32(f, "sink_len")?,
            },
            "mamba" => {
                let mode = f.text("mamba_cache_mode")?.unwrap_or_else(|| "none".into());
                let num_speculative_blocks = match f.int("num_speculative_blocks")? {
                    Some(v) => config_int("num_speculative_blocks", v)?,
                    None => 0,
                };
                let prefill_checkpoint_alignment = f
                    .int_or_null("prefill_checkpoint_alignment")?
                    .map(|v| config_int("prefill_checkpoint_alignment", v))
                    .transpose()?;
                Self::Mamba {
                    mode: MambaCacheMode::from_name(&mode).ok_or_else(|| {
                        Error::InvalidConfig(format!(
                            "mamba_cache_mode must be none/align/all, got {mode:?}"
                        ))
                    })?,
                    num_speculative_blocks,
                    prefill_checkpoint_alignment,
                }
            }
            other => {
                return Err(Error::InvalidConfig(format!(
                    "KV-cache spec kind {other:?} is not supported"
                ))
                .into());
            }
        })
    }

    /// The kind's name in a group's spec ([`Self::from_spec`] reads it back;
    /// a bounded-replay window is a `sliding_window` with `bounded_replay`).
    #[must_use]
    pub fn spec_name(&self) -> &'static str {
        match self {
            Self::FullAttention => "full_attention",
            Self::MlaAttention => "mla_attention",
            Self::SlidingWindow { .. } | Self::ReplayedSlidingWindow { .. } => "sliding_window",
            Self::ChunkedLocal { .. } => "chunked_local_attention",
            Self::Mamba { .. } => "mamba",
            Self::CrossAttention => "cross_attention",
            Self::SinkFullAttention { .. } => "sink_full_attention",
            Self::CircularBuffer => "circular_buffer",
            Self::EngineManaged => "engine_managed",
            Self::HiSparseResident => "hisparse_resident",
            Self::HiSparseHot { .. } => "hisparse_hot",
        }
    }
}

impl GroupSpec {
    /// One group from its spec's fields: `kind` ([`AttentionKind::from_spec`]),
    /// `block_size`, and the optional `tag` (empty) and
    /// `extra_retained_tokens` (0).
    ///
    /// # Errors
    /// As [`AttentionKind::from_spec`]; a missing `kind` or `block_size`.
    pub fn from_fields<F: SpecFields>(f: &F) -> Result<Self, F::Error> {
        let kind = f
            .text("kind")?
            .ok_or_else(|| Error::InvalidConfig("group spec lacks \"kind\"".into()))?;
        let kind = AttentionKind::from_spec(&kind, f)?;
        let tag = f.text("tag")?.unwrap_or_default();
        let extra_retained_tokens = match f.int_or_null("extra_retained_tokens")? {
            Some(v) => config_int("extra_retained_tokens", v)?,
            None => 0,
        };
        Ok(Self {
            kind,
            block_size: required_u32(f, "block_size")?,
            tag,
            extra_retained_tokens,
        })
    }
}

impl ManagerConfig {
    /// Sets the option `name` from `v` over this configuration (its
    /// defaults are [`ManagerConfig::new`]'s). `false`, with nothing
    /// changed, for a name that is no option.
    ///
    /// # Errors
    /// A value out of the option's type ([`Error::InvalidConfig`]); what `v`
    /// refuses to read.
    pub fn set_option<V: OptionValue>(&mut self, name: &str, v: &V) -> Result<bool, V::Error> {
        match name {
            "enable_caching" => self.enable_caching = v.flag()?,
            "eviction" => self.eviction = super::Eviction::parse(&v.text()?)?,
            "hash_algo" => self.hash_algo = HashAlgo::parse(&v.text()?)?,
            "hash_seed" => self.hash_seed = v.seed()?,
            "hash_block_size" => self.hash_block_size = optional_int(name, v)?,
            "use_eagle" => self.use_eagle = v.flag()?,
            "eagle_groups" => self.eagle_groups = v.ints()?,
            "log_stats" => self.log_stats = v.flag()?,
            "enable_kv_cache_events" => self.enable_kv_cache_events = v.flag()?,
            "watermark" => self.watermark = v.float()?,
            "max_in_flight_tokens" => self.max_in_flight_tokens = optional_int(name, v)?,
            "prefix_cache_retention_interval" => {
                self.prefix_cache_retention_interval = optional_int(name, v)?;
            }
            "verify_cached_tokens" => self.verify_cached_tokens = v.flag()?,
            "hash_truncate_bytes" => self.hash_truncate_bytes = optional_int(name, v)?,
            "kv_cache_metrics" => self.kv_cache_metrics = v.flag()?,
            "external_block_hashes" => self.external_block_hashes = v.flag()?,
            "record_stats_at_admission" => self.record_stats_at_admission = v.flag()?,
            "num_hash_lookahead_tokens" => {
                self.num_hash_lookahead_tokens = optional_int(name, v)?.unwrap_or(0);
            }
            "num_prefill_lookahead" => {
                self.num_prefill_lookahead = optional_int(name, v)?.unwrap_or(0);
            }
            "partial_hash_hits" => self.partial_hash_hits = v.flag()?,
            "dcp_world_size" => self.dcp_world_size = optional_int(name, v)?.unwrap_or(1),
            "mamba_shared_prefix_checkpoint" => {
                self.mamba_shared_prefix_checkpoint = v.flag()?;
            }
            "zero_new_blocks" => self.zero_new_blocks = v.flag()?,
            "background_hashing" => self.background_hashing = v.flag()?,
            "hash_memo_blocks" => self.hash_memo_blocks = optional_int(name, v)?,
            "max_pending_events" => self.max_pending_events = optional_int(name, v)?,
            "max_pending_block_activity" => {
                self.max_pending_block_activity = optional_int(name, v)?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Whether request token ids are signed 32-bit values (an engine that
    /// hashes its own requests: vLLM's `-1` multimodal placeholders) rather
    /// than ids in `0..2**32`.
    #[must_use]
    pub fn signed_token_ids(&self) -> bool {
        self.external_block_hashes
    }

    /// The most token ids (or block hashes) one call may carry:
    /// `max_model_len`, which no request may pass.
    #[must_use]
    pub fn token_limit(&self) -> usize {
        token_limit(self.max_model_len)
    }
}

/// The most token ids (or block hashes) one call may carry under
/// `max_model_len`: the one rule behind [`ManagerConfig::token_limit`], the
/// engine sync's reads and a preparer's prompts.
pub(crate) fn token_limit(max_model_len: u64) -> usize {
    usize::try_from(max_model_len).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Fields of a spec written as `(key, value)` text pairs; "null" is null.
    struct Fields(HashMap<&'static str, &'static str>);

    impl SpecFields for Fields {
        type Error = Error;
        fn text(&self, key: &str) -> Result<Option<String>, Error> {
            Ok(self.0.get(key).map(|s| (*s).to_owned()))
        }
        fn int(&self, key: &str) -> Result<Option<i64>, Error> {
            self.0
                .get(key)
                .map(|s| s.parse().map_err(|_| Error::InvalidArgument(key.into())))
                .transpose()
        }
        fn int_or_null(&self, key: &str) -> Result<Option<i64>, Error> {
            match self.0.get(key) {
                Some(&"null") | None => Ok(None),
                Some(_) => self.int(key),
            }
        }
        fn flag(&self, key: &str) -> Result<Option<bool>, Error> {
            Ok(self.0.get(key).map(|s| *s == "true"))
        }
    }

    fn spec(pairs: &[(&'static str, &'static str)]) -> Result<GroupSpec, Error> {
        GroupSpec::from_fields(&Fields(pairs.iter().copied().collect()))
    }

    #[test]
    fn every_kind_reads_back_by_its_name() {
        let kinds = [
            AttentionKind::FullAttention,
            AttentionKind::MlaAttention,
            AttentionKind::SlidingWindow { window: 8 },
            AttentionKind::ReplayedSlidingWindow { window: 8 },
            AttentionKind::ChunkedLocal { chunk: 8 },
            AttentionKind::Mamba {
                mode: MambaCacheMode::None,
                num_speculative_blocks: 0,
                prefill_checkpoint_alignment: None,
            },
            AttentionKind::CrossAttention,
            AttentionKind::SinkFullAttention { sink_len: 8 },
            AttentionKind::CircularBuffer,
            AttentionKind::EngineManaged,
            AttentionKind::HiSparseResident,
            AttentionKind::HiSparseHot {
                blocks_per_request: 8,
            },
        ];
        for kind in kinds {
            let replay = if matches!(kind, AttentionKind::ReplayedSlidingWindow { .. }) {
                "true"
            } else {
                "false"
            };
            let got = spec(&[
                ("kind", kind.spec_name()),
                ("block_size", "16"),
                ("sliding_window", "8"),
                ("bounded_replay", replay),
                ("attention_chunk_size", "8"),
                ("sink_len", "8"),
                ("blocks_per_request", "8"),
            ])
            .unwrap();
            assert_eq!(got.kind, kind);
            assert_eq!((got.block_size, got.tag.as_str()), (16, ""));
        }
    }

    #[test]
    fn missing_unknown_and_out_of_range_fields_are_bad_configs() {
        let e = spec(&[("block_size", "16")]).unwrap_err();
        assert_eq!(e, Error::InvalidConfig("group spec lacks \"kind\"".into()));
        let e = spec(&[("kind", "sliding_window"), ("block_size", "16")]).unwrap_err();
        assert_eq!(
            e,
            Error::InvalidConfig("group spec lacks \"sliding_window\"".into())
        );
        let e = spec(&[("kind", "paged"), ("block_size", "16")]).unwrap_err();
        assert!(matches!(e, Error::InvalidConfig(m) if m.contains("\"paged\"")));
        let e = spec(&[("kind", "full_attention"), ("block_size", "-1")]).unwrap_err();
        assert_eq!(
            e,
            Error::InvalidConfig("block_size must be non-negative, got -1".into())
        );
        let e = spec(&[
            ("kind", "mamba"),
            ("mamba_cache_mode", "some"),
            ("block_size", "1"),
        ]);
        assert!(matches!(e, Err(Error::InvalidConfig(m)) if m.contains("none/align/all")));
    }

    #[test]
    fn mamba_and_window_defaults() {
        let g = spec(&[
            ("kind", "mamba"),
            ("block_size", "16"),
            ("prefill_checkpoint_alignment", "null"),
            ("extra_retained_tokens", "null"),
            ("tag", "t"),
        ])
        .unwrap();
        assert_eq!(
            g.kind,
            AttentionKind::Mamba {
                mode: MambaCacheMode::None,
                num_speculative_blocks: 0,
                prefill_checkpoint_alignment: None,
            }
        );
        assert_eq!((g.tag.as_str(), g.extra_retained_tokens), ("t", 0));
    }

    /// An option value given as an integer or as text (any other reading
    /// is refused).
    enum Val {
        Int(Option<i64>),
        Text(&'static str),
    }
    use Val::{Int, Text};

    impl OptionValue for Val {
        type Error = Error;
        fn flag(&self) -> Result<bool, Error> {
            Err(Error::InvalidArgument("flag".into()))
        }
        fn float(&self) -> Result<f64, Error> {
            Err(Error::InvalidArgument("float".into()))
        }
        fn int(&self) -> Result<Option<i64>, Error> {
            match *self {
                Int(v) => Ok(v),
                Text(_) => Err(Error::InvalidArgument("int".into())),
            }
        }
        fn ints(&self) -> Result<Vec<u32>, Error> {
            Err(Error::InvalidArgument("ints".into()))
        }
        fn text(&self) -> Result<String, Error> {
            match *self {
                Text(t) => Ok(t.to_owned()),
                Int(_) => Err(Error::InvalidArgument("text".into())),
            }
        }
        fn seed(&self) -> Result<Option<String>, Error> {
            Err(Error::InvalidArgument("seed".into()))
        }
    }

    #[test]
    fn options_by_name_with_their_defaults() {
        let mut cfg = ManagerConfig::full_attention(8, 16, 64);
        assert!(cfg.set_option("dcp_world_size", &Int(None)).unwrap());
        assert_eq!(cfg.dcp_world_size, 1);
        assert!(cfg.set_option("dcp_world_size", &Int(Some(2))).unwrap());
        assert_eq!(cfg.dcp_world_size, 2);
        assert!(cfg.set_option("hash_memo_blocks", &Int(None)).unwrap());
        assert_eq!(cfg.hash_memo_blocks, None);
        assert!(!cfg.set_option("no_such_option", &Int(None)).unwrap());
        assert_eq!(
            cfg.set_option("hash_truncate_bytes", &Int(Some(300))),
            Err(Error::InvalidConfig(
                "hash_truncate_bytes 300 is too large".into()
            ))
        );
    }

    #[test]
    fn eviction_option_takes_lru_arc_or_slru_and_refuses_anything_else() {
        let mut cfg = ManagerConfig::full_attention(8, 16, 64);
        assert_eq!(cfg.eviction, super::super::Eviction::Lru);
        for (name, e) in [
            ("arc", super::super::Eviction::Arc),
            ("slru", super::super::Eviction::Slru),
            ("lru", super::super::Eviction::Lru),
        ] {
            assert!(cfg.set_option("eviction", &Text(name)).unwrap());
            assert_eq!(cfg.eviction, e);
        }
        assert_eq!(
            cfg.set_option("eviction", &Text("LRU")),
            Err(Error::InvalidConfig(
                "unknown eviction \"LRU\"; expected 'lru', 'arc' or 'slru'".into()
            ))
        );
        assert_eq!(cfg.eviction, super::super::Eviction::Lru);
    }
}
