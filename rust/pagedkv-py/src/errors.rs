//! Error mapping, polars-style: a core [`Error`] becomes a [`PyPkError`] by `?`,
//! and a [`PyPkError`] the matching `pagedkv.errors` exception. Errors Python
//! raises while arguments are converted (`TypeError`, `OverflowError`) pass
//! through unchanged.

use pyo3::PyClass;
use pyo3::prelude::*;

use pagedkv_core::Error;

pyo3::import_exception!(pagedkv.errors, UnknownRequestError);
pyo3::import_exception!(pagedkv.errors, DuplicateRequestError);
pyo3::import_exception!(pagedkv.errors, InvalidArgumentError);
pyo3::import_exception!(pagedkv.errors, StaleComputedBlocksError);
pyo3::import_exception!(pagedkv.errors, CannotFitError);
pyo3::import_exception!(pagedkv.errors, InvalidConfigError);
pyo3::import_exception!(pagedkv.errors, InvariantViolationError);

/// An error on its way to Python: the core's, or one Python already raised.
#[derive(Debug)]
pub enum PyPkError {
    /// Misuse the core (or an argument conversion) refused.
    Core(Error),
    /// An exception raised by Python code, kept as it is.
    Python(PyErr),
}

/// What every binding function returns: `?` works on core and `PyO3` results alike.
pub type PkResult<T> = Result<T, PyPkError>;

impl From<Error> for PyPkError {
    fn from(e: Error) -> Self {
        Self::Core(e)
    }
}

impl From<PyErr> for PyPkError {
    fn from(e: PyErr) -> Self {
        Self::Python(e)
    }
}

/// `PyO3`'s conversion errors, raised as Python raises them.
macro_rules! from_pyo3 {
    ($($ty:ty),*) => {$(
        impl From<$ty> for PyPkError {
            fn from(e: $ty) -> Self {
                Self::Python(e.into())
            }
        }
    )*};
}

from_pyo3!(
    pyo3::CastError<'_, '_>,
    pyo3::CastIntoError<'_>,
    numpy::AsSliceError
);

impl From<PyPkError> for PyErr {
    fn from(e: PyPkError) -> Self {
        let e = match e {
            PyPkError::Python(e) => return e,
            PyPkError::Core(e) => e,
        };
        let msg = e.to_string();
        match e {
            Error::UnknownRequest(_) => UnknownRequestError::new_err(msg),
            Error::DuplicateRequest(_) => DuplicateRequestError::new_err(msg),
            Error::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
            Error::StaleComputedBlocks(_) => StaleComputedBlocksError::new_err(msg),
            Error::CannotFit(_) => CannotFitError::new_err(msg),
            Error::InvalidConfig(_) => InvalidConfigError::new_err(msg),
            Error::InvariantViolation(_) => InvariantViolationError::new_err(msg),
        }
    }
}

/// An argument out of range (`InvalidArgumentError`).
pub fn invalid_arg(msg: impl Into<String>) -> PyPkError {
    Error::InvalidArgument(msg.into()).into()
}

/// A configuration value out of range (`InvalidConfigError`).
pub fn invalid_config(msg: impl Into<String>) -> PyPkError {
    Error::InvalidConfig(msg.into()).into()
}

/// A `TypeError`.
pub fn type_error(msg: impl Into<String>) -> PyPkError {
    PyPkError::Python(pyo3::exceptions::PyTypeError::new_err(msg.into()))
}

/// A pyclass borrowed mutably for a call whose arguments are all converted: only
/// a call made from inside a core call could find it borrowed, and none is.
pub fn borrow_mut<'py, T: PyClass<Frozen = pyo3::pyclass::boolean_struct::False>>(
    slf: &Bound<'py, T>,
) -> PyResult<PyRefMut<'py, T>> {
    slf.try_borrow_mut()
        .map_err(|_| in_use(<T as PyClass>::NAME))
}

/// A pyclass borrowed for reading, after the arguments were converted.
pub fn borrow<'py, T: PyClass>(slf: &Bound<'py, T>) -> PyResult<PyRef<'py, T>> {
    slf.try_borrow().map_err(|_| in_use(<T as PyClass>::NAME))
}

fn in_use(name: &str) -> PyErr {
    pyo3::exceptions::PyRuntimeError::new_err(format!(
        "the {name} is in use by another call (called back from inside a call)"
    ))
}
