"""Shared fixtures: tiny random Hugging Face checkpoints written once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # lets tests import hf_utils


def build_checkpoint(*args, **kwargs) -> Path:
    # Imported on first use: torch + transformers cost seconds that HF-free sessions skip.
    from hf_utils import build_checkpoint as build

    return build(*args, **kwargs)


def build_deepseek_checkpoint(*args, **kwargs) -> Path:
    from hf_utils import build_deepseek_checkpoint as build

    return build(*args, **kwargs)


@pytest.fixture(scope="session")
def hf_deepseek_dir(tmp_path_factory) -> Path:
    """DeepseekV3ForCausalLM (hf_utils.DEEPSEEK_V3_KW): MLA with q-LoRA, YaRN, interleaved RoPE,
    group-limited routing with a non-zero correction bias, 1 dense + 2 MoE layers."""
    return build_deepseek_checkpoint(tmp_path_factory.mktemp("hf_deepseek"), seed=3)


@pytest.fixture(scope="session")
def hf_qwen3_dir(tmp_path_factory) -> Path:
    """Qwen3ForCausalLM: 2 layers, hidden 256, 4 q / 2 kv heads of 128, FFN 512, vocab 512."""
    return build_checkpoint(tmp_path_factory.mktemp("hf_qwen3"), seed=0)


@pytest.fixture(scope="session")
def hf_qwen3_tied_dir(tmp_path_factory) -> Path:
    """The dense model with tied input/output embeddings (no lm_head.weight in the file)."""
    return build_checkpoint(tmp_path_factory.mktemp("hf_qwen3_tied"), seed=1, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def hf_qwen3_moe_dir(tmp_path_factory) -> Path:
    """Qwen3MoeForCausalLM: 3 layers (layer 0 dense), 8 experts top-2 renormalised, Fe 256.

    Saved in small shards so the index-file path of the loader is exercised too."""
    return build_checkpoint(tmp_path_factory.mktemp("hf_qwen3_moe"), moe=True, seed=2, max_shard_size="4MB")


# JAX's persistent compilation cache, for this session only (never across tpumk or JAX versions:
# a fresh directory per run, removed at its end). It is made by the controlling process before
# pytest-xdist starts its workers, so the workers and every subprocess a test starts (the
# multi-device interpret runs, CLI commands, fresh-process artifact loads) inherit it: the
# small CPU programs each process would otherwise compile again on start are read back instead.
# Deviceless TPU executables are never written there (tpumk.compat.no_persistent_cache_write).
SESSION_CACHE_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
# XLA:CPU without LLVM's optimisation passes for every program of the session and of the
# subprocesses it starts (tests/host_flags.py keeps them when it sets a host-device count):
# the interpreted kernels get these and more from tpumk.targets.INTERPRET_COMPILER_OPTIONS, the
# rest (references, XLA steps, packing) are small programs run a few times. A 1-device kernel
# test: 35 s -> 24 s on a quiet host. Only flags libtpu knows too (it parses XLA_FLAGS and
# aborts on others); a deviceless TPU7x build's HLO is byte-identical with and without them.
FAST_CPU_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def pytest_configure(config) -> None:
    import os
    import tempfile

    if hasattr(config, "workerinput"):
        return  # a worker inherits the controller's environment
    config._tpumk_xla_flags = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = f"{FAST_CPU_FLAGS} {config._tpumk_xla_flags or ''}".strip()  # the user's win
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return  # a directory the user chose is kept
    config._tpumk_jax_cache = tempfile.mkdtemp(prefix="tpumk-tests-jax-cache-")
    os.environ.update(SESSION_CACHE_ENV, JAX_COMPILATION_CACHE_DIR=config._tpumk_jax_cache)


def pytest_unconfigure(config) -> None:
    import os
    import shutil

    if hasattr(config, "_tpumk_xla_flags"):
        if config._tpumk_xla_flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = config._tpumk_xla_flags
    d = getattr(config, "_tpumk_jax_cache", None)
    if d is not None:
        shutil.rmtree(d, ignore_errors=True)
        if os.environ.get("JAX_COMPILATION_CACHE_DIR") == d:
            for name in (*SESSION_CACHE_ENV, "JAX_COMPILATION_CACHE_DIR"):
                os.environ.pop(name, None)


# One pytest-xdist worker per core, as long as each gets GIB_PER_WORKER of memory: a worker holds
# JAX, libtpu and its files' compiled programs (about 4 GiB at its peak), and a multi-device test
# starts a subprocess of about as much beside it.
GIB_PER_WORKER = 8


@pytest.hookimpl(optionalhook=True)  # a run with -p no:xdist has no such hook
def pytest_xdist_auto_num_workers(config) -> int:
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:  # MemAvailable counts the page cache a worker can reclaim (a fresh pip install fills it)
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return cores
    return max(1, min(cores, avail // (GIB_PER_WORKER << 30)))


# Whole files go to the workers in collection order (`--no-loadscope-reorder`), so the files that
# take longest start first and the short ones fill in at the end: otherwise a long file started
# last keeps one core busy after the other has finished. Ordered by the seconds each took in the
# default run (tests/README.md, "Where the time goes") in round 8; re-sorted by round 9's times it ran
# slower (CHANGELOG, round 9); this round's linear-attention and drafter files by their serial
# times on a loaded host (tests/README.md). Files not named keep their place after them.
SLOWEST_FILES_FIRST = (
    "test_multidevice", "test_quant", "test_multidevice_mla", "test_megakernel", "test_hf_linear",
    "test_megakernel_linear", "test_rounds", "test_drafted", "test_cache_keys",
    "test_tune", "test_build", "test_tune_storage", "test_attention_stage", "test_hf_archs", "test_hf_mla_names",
    "test_kv_guard",
    "test_positions", "test_megakernel_archs", "test_megakernel_mla", "test_artifacts", "test_megakernel_mla_quant",
    "test_reference", "test_mla_tools", "test_export_devices", "test_mla", "test_speculative",
    "test_objective_calibration", "test_megakernel_verify", "test_moe_stage", "test_bench", "test_hostile_files",
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: order within a file kept
