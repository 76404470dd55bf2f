"""Hugging Face Hub ids (models.hub) resolved offline from a cache this test builds itself.

The cache has huggingface_hub's layout: ``models--org--name/refs/main`` holds the commit hash,
``snapshots/<commit>/<file>`` are symlinks into ``blobs/<sha256>``. The repository is the
embedded stories260k checkpoint, so an engine on the Hub id must reproduce ``golden.json``.
``HF_HUB_OFFLINE`` / ``HF_HUB_CACHE`` are huggingface_hub's constants (the library reads the
environment once, at import), so the test sets the constants.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import subprocess
import sys

import pytest
from huggingface_hub import constants

from jaxpaged import LLM, SamplingParams
from jaxpaged.entrypoints.cli_args import add_engine_args, engine_args_from
from models.hub import resolve_model_path
from tests.conftest import SMALL_ENGINE

REPO_ID = "stories/stories260k"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
FILES = (
    "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
)  # fmt: skip


def build_cache(cache: pathlib.Path, source: str, repo_id: str, files=FILES) -> pathlib.Path:
    """Writes ``repo_id`` at revision ``main`` = :data:`COMMIT` into ``cache`` (HF layout);
    returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for name in files:
        data = pathlib.Path(source, name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch, stories_dir) -> pathlib.Path:
    """An offline huggingface_hub whose default cache holds :data:`REPO_ID`."""
    cache = tmp_path / "hub"
    build_cache(cache, stories_dir, REPO_ID)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_llm_on_hub_id_works_offline_from_the_cache(offline_cache, golden):
    llm = LLM(REPO_ID, dtype="float32", **SMALL_ENGINE)
    snapshot = offline_cache / "models--stories--stories260k" / "snapshots" / COMMIT
    assert llm.llm_engine.config.model_config.model == str(snapshot)
    case = golden["cases"][0]
    params = SamplingParams(temperature=0.0, max_tokens=golden["max_new_tokens"])
    (output,) = llm.generate([case["prompt"]], params, use_tqdm=False)
    assert list(output.outputs[0].token_ids) == case["greedy_new_ids"]


def test_revision_and_download_dir_select_the_snapshot(tmp_path, monkeypatch, stories_dir):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot = build_cache(tmp_path / "elsewhere", stories_dir, REPO_ID)
    download_dir = str(tmp_path / "elsewhere")
    for revision in (None, "main", COMMIT):
        path = resolve_model_path(REPO_ID, revision=revision, download_dir=download_dir)
        assert pathlib.Path(path) == snapshot
    with pytest.raises(ValueError) as info:
        resolve_model_path(REPO_ID, revision="v2", download_dir=download_dir)
    for tried in (REPO_ID, "revision 'v2'", download_dir, "offline (HF_HUB_OFFLINE=1)"):
        assert tried in str(info.value)


def test_missing_hub_id_error_says_what_was_tried(offline_cache):
    with pytest.raises(ValueError) as info:
        LLM("org/missing-model", **SMALL_ENGINE)
    message = str(info.value)
    for tried in ("'org/missing-model'", "revision 'main'", str(offline_cache), "offline"):
        assert tried in message, message


def test_snapshot_without_safetensors_is_refused_unless_dummy(tmp_path, monkeypatch, stories_dir):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    files = [f for f in FILES if f != "model.safetensors"]
    snapshot = build_cache(tmp_path, stories_dir, "org/config-only", files)
    with pytest.raises(ValueError, match="safetensors only"):
        resolve_model_path("org/config-only", download_dir=str(tmp_path))
    path = resolve_model_path("org/config-only", download_dir=str(tmp_path), require_weights=False)
    assert pathlib.Path(path) == snapshot


def test_path_that_is_neither_directory_nor_hub_id(tmp_path):
    with pytest.raises(ValueError, match="does not exist as a local directory.*Hub id"):
        resolve_model_path(str(tmp_path / "no" / "such" / "dir"))


def test_path_that_is_neither_directory_nor_hub_id_in_a_fresh_process(tmp_path):
    """The same error in a fresh interpreter, where nothing else has loaded huggingface_hub's
    submodules (this suite's other tests import transformers, which does)."""
    code = f"from jaxpaged import LLM\nLLM({str(tmp_path / 'no' / 'such' / 'dir')!r})"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 1
    assert "ValueError" in result.stderr and "does not exist as a local directory" in result.stderr
    assert "AttributeError" not in result.stderr


def test_cli_flags_revision_and_download_dir_reach_engine_args():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(
        parser.parse_args(["--model", REPO_ID, "--revision", "v1", "--download-dir", "/cache"])
    )
    assert (args.model, args.revision, args.download_dir) == (REPO_ID, "v1", "/cache")
