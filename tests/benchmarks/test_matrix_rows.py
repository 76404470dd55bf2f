"""The matrix's declared rows name every value of every option that selects a kernel or code
path; a new option value (or a new EngineArgs field) without a row fails here."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from jaxpaged.benchmarks.matrix import model_directory
from jaxpaged.benchmarks.matrix_rows import (
    MODELS,
    NOT_CODE_PATHS,
    ROWS,
    TOLERANCE,
    WORKLOADS,
    covered_values,
    option_domains,
)
from jaxpaged.config import EngineArgs


@pytest.fixture(scope="module")
def coverage(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("matrix-models")
    covered = collections.defaultdict(set)
    for row in ROWS:
        _, config = model_directory(row.model, str(workdir))
        for domain, values in covered_values(row, config).items():
            covered[domain] |= values
    return covered


def test_every_option_value_has_a_row(coverage):
    missing = {
        domain: sorted(set(values) - coverage[domain], key=repr)
        for domain, values in option_domains().items()
        if set(values) - coverage[domain]
    }
    assert not missing, f"option values no matrix row runs: {missing}"


def test_every_engine_argument_is_a_domain_or_declared_not_a_code_path():
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    unclassified = fields - set(option_domains()) - set(NOT_CODE_PATHS)
    assert not unclassified, (
        f"EngineArgs fields the matrix does not know: {sorted(unclassified)}; add a domain "
        "(and rows) to matrix_rows.option_domains or a reason to NOT_CODE_PATHS"
    )
    assert not set(NOT_CODE_PATHS) - fields, "NOT_CODE_PATHS names fields that no longer exist"


def test_rows_are_well_formed():
    names = [row.name for row in ROWS]
    assert len(names) == len(set(names))
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for row in ROWS:
        assert row.model in MODELS, row.name
        assert row.workload in WORKLOADS, row.name
        assert row.reference in ("reference", "golden"), row.name
        assert set(row.engine) <= fields, row.name
        assert row.engine.get("dtype", "auto") in (*TOLERANCE, "auto"), row.name
        for target in row.patches:
            module, _, attr = target.partition(":")
            assert attr, f"{row.name}: patch {target!r} is not module:NAME"


def test_a_new_domain_value_is_reported_missing(monkeypatch, coverage):
    # The check can fail: a value no row runs shows up as missing.
    import jaxpaged.benchmarks.matrix_rows as matrix_rows

    real = matrix_rows.option_domains
    monkeypatch.setattr(
        matrix_rows, "option_domains",
        lambda: {**real(), "kv_cache_dtype": (*real()["kv_cache_dtype"], "fp4")},
    )  # fmt: skip
    domains = matrix_rows.option_domains()
    assert set(domains["kv_cache_dtype"]) - coverage["kv_cache_dtype"] == {"fp4"}


def test_structured_outputs_is_a_declared_row():
    assert [row.name for row in ROWS if row.workload == "structured_outputs"]


def test_every_real_config_builds_as_two_layers(tmp_path):
    import json

    for name, spec in MODELS.items():
        path, config = model_directory(name, str(tmp_path))
        if spec.config is None:
            continue
        written = json.loads(open(f"{path}/config.json").read())
        assert written == config
        assert config.get("num_hidden_layers", config.get("n_layer")) == 2, name
