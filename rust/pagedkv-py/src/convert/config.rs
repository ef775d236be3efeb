//! The manager's configuration in: each group's spec dict and each option read
//! as the core's `GroupSpec::from_fields` and `ManagerConfig::set_option` ask.

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyBool, PyDict, PyInt, PyString};

use pagedkv_core::spec::{OptionValue, SpecFields, config_int};
use pagedkv_core::{GroupSpec, ManagerConfig};

use crate::errors::{PkResult, PyPkError, invalid_config, type_error};

/// Extracts one `**options` value, naming it in the error as `PyO3` names arguments.
fn option<'py, T>(name: &str, v: &Bound<'py, PyAny>) -> PkResult<T>
where
    T: for<'a> FromPyObject<'a, 'py>,
{
    v.extract::<T>().map_err(|e| {
        let e: PyErr = e.into();
        // Python 3.11+; on 3.10 the note is simply missing.
        let _ = e
            .value(v.py())
            .call_method1("add_note", (format!("while processing '{name}'"),));
        PyPkError::Python(e)
    })
}

/// One `**options` entry, read as the core's [`ManagerConfig::set_option`]
/// asks.
struct OptionArg<'a, 'py> {
    name: &'a str,
    value: Bound<'py, PyAny>,
}

impl OptionValue for OptionArg<'_, '_> {
    type Error = PyPkError;

    fn flag(&self) -> PkResult<bool> {
        option(self.name, &self.value)
    }

    fn float(&self) -> PkResult<f64> {
        option(self.name, &self.value)
    }

    fn int(&self) -> PkResult<Option<i64>> {
        option(self.name, &self.value)
    }

    fn ints(&self) -> PkResult<Vec<u32>> {
        option(self.name, &self.value)
    }

    fn text(&self) -> PkResult<String> {
        Ok(option::<PyBackedStr>(self.name, &self.value)?.to_string())
    }

    /// A str, or an int (its decimal form, as `PYTHONHASHSEED` reads).
    fn seed(&self) -> PkResult<Option<String>> {
        let v = &self.value;
        if v.is_none() {
            return Ok(None);
        }
        if v.is_instance_of::<PyString>()
            || (v.is_instance_of::<PyInt>() && !v.is_instance_of::<PyBool>())
        {
            return Ok(Some(v.str()?.to_string()));
        }
        Err(type_error(format!(
            "hash_seed must be a str or an int, got {}",
            v.repr()?
        )))
    }
}

/// One group's spec dict (its spec's `core_spec()`, + `tag`), read as the
/// core's [`GroupSpec::from_fields`] asks.
struct SpecDict<'a, 'py>(&'a Bound<'py, PyDict>);

impl SpecFields for SpecDict<'_, '_> {
    type Error = PyPkError;

    fn text(&self, key: &str) -> PkResult<Option<String>> {
        Ok(self.0.get_item(key)?.map(|v| v.extract()).transpose()?)
    }

    fn int(&self, key: &str) -> PkResult<Option<i64>> {
        Ok(self.0.get_item(key)?.map(|v| v.extract()).transpose()?)
    }

    fn int_or_null(&self, key: &str) -> PkResult<Option<i64>> {
        match self.0.get_item(key)? {
            Some(v) if !v.is_none() => Ok(Some(v.extract()?)),
            _ => Ok(None),
        }
    }

    fn flag(&self, key: &str) -> PkResult<Option<bool>> {
        Ok(self.0.get_item(key)?.map(|v| v.extract()).transpose()?)
    }
}

/// The manager's configuration: the pool and groups, then each `**options` entry
/// over the core's defaults. The one place an option crosses the boundary.
pub fn manager_config(
    num_blocks: i64,
    groups: &[Bound<'_, PyDict>],
    max_model_len: i64,
    options: Option<&Bound<'_, PyDict>>,
) -> PkResult<ManagerConfig> {
    // Block ids leave as int32: the pool stays below 2^31 - 1 blocks.
    let num_blocks = u32::try_from(num_blocks)
        .ok()
        .filter(|&n| n < i32::MAX as u32)
        .ok_or_else(|| {
            invalid_config(format!(
                "num_blocks must be below 2**31 - 1 (block ids are int32), got {num_blocks}"
            ))
        })?;
    let groups = groups
        .iter()
        .map(|d| GroupSpec::from_fields(&SpecDict(d)))
        .collect::<PkResult<_>>()?;
    let mut cfg = ManagerConfig::new(
        num_blocks,
        groups,
        config_int("max_model_len", max_model_len)?,
    );
    for (key, value) in options.into_iter().flatten() {
        let key = key.cast_into::<PyString>()?;
        let name = key.to_str()?;
        if !cfg.set_option(name, &OptionArg { name, value })? {
            return Err(type_error(format!(
                "KVCacheManager() got an unexpected keyword argument '{name}'"
            )));
        }
    }
    Ok(cfg)
}
