"""Depth scaling laws (docs/science.md C2): fit ``L = c_m/m^α_m + c_ℓ/ℓ^α_ℓ + c_D/D^α_D + L0``.

The runs come from a CSV of training runs, from a table that ships with lensdiv by name
(``chinchilla``, the Chinchilla study's runs; :data:`DATASETS` lists them), or are collected by
evaluating a family of models on the same tokens. The fit minimises the mean squared error of
log-loss with scipy's trust-region least squares from a grid of starts. Inside the fit each size
is divided by a fixed reference scale (the power of ten nearest its geometric mean) and positive
quantities are optimised as logs, so the problem is well conditioned; the reported coefficients
are in the data's own units. Uncertainty comes three ways: standard errors from the Jacobian
(``Cov = σ² (JᵀJ)⁻¹``), a bootstrap over runs (percentile intervals) and k-fold held-out error.

Modules: ``law`` (the terms and the law on the fit's scale), ``datasets`` (the built-in tables
of runs), ``runs`` (reading and validating runs), ``fit`` (least squares, standard errors,
bootstrap, k-fold), ``result`` (the whole fit of runs or a CSV as a Result) and ``family``
(evaluating a model family, a study of the one analyzer in ``loss``, and fitting it).
"""

from __future__ import annotations

from lensdiv.studies.crossmodel.models import FAMILIES
from lensdiv.studies.scaling.datasets import DATASETS, RunsDataset, builtin_dataset
from lensdiv.studies.scaling.family import (
    collect_family,
    expand_models,
    fit_family,
    fit_family_table,
)
from lensdiv.studies.scaling.fit import (
    ScalingFit,
    Uncertainty,
    bootstrap,
    cross_validate,
    fit_law,
    reference_scales,
)
from lensdiv.studies.scaling.law import (
    SYMBOLS,
    TERMS,
    design,
    formula,
    log_jacobian,
    log_residuals,
    parse_terms,
    reported,
)
from lensdiv.studies.scaling.result import fit_csv, fit_runs
from lensdiv.studies.scaling.runs import (
    DEFAULT_COLUMNS,
    ROLES,
    Runs,
    chinchilla_runs,
    read_runs,
    resolve_columns,
    runs_from_columns,
    varying_terms,
)

__all__ = [
    "DATASETS",
    "DEFAULT_COLUMNS",
    "FAMILIES",
    "ROLES",
    "SYMBOLS",
    "TERMS",
    "Runs",
    "RunsDataset",
    "ScalingFit",
    "Uncertainty",
    "bootstrap",
    "builtin_dataset",
    "chinchilla_runs",
    "collect_family",
    "cross_validate",
    "design",
    "expand_models",
    "fit_csv",
    "fit_family",
    "fit_family_table",
    "fit_law",
    "fit_runs",
    "formula",
    "log_jacobian",
    "log_residuals",
    "parse_terms",
    "read_runs",
    "reference_scales",
    "reported",
    "resolve_columns",
    "runs_from_columns",
    "varying_terms",
]
