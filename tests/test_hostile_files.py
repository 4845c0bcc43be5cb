"""Hostile and careless files: what a path names, what a file holds, what tpumk stores and deletes.

The same contract as tests/test_hostile_corpus.py (README, "Every error is one line on stderr"):
the README's exit code, stderr exactly one `tpumk: error: ...` line, no traceback, nothing written
(or removed) outside the directories a case names, and every case under a time limit. Here the
input is the file system itself:
- what a path option names is not a regular file: a FIFO (the read would block forever), a
  character device (`/dev/zero`: it reads until memory runs out), a directory, a file far larger
  than any config; for every option that reads a file, and the files a checkpoint directory holds;
- a path the OS refuses as too long (a component over 255 bytes, a path over 4095), for every
  path option;
- a signing key that is not UTF-8 text;
- a file or path name holding terminal escape sequences (a hostile manifest, a file name);
- storage a crash or a full disk damaged: a torn tuning journal (repaired, every complete trial
  kept), a damaged SQLite file or an in-memory one (refused in one line saying how to recover),
  a journal that is a FIFO or a device (refused saying what it is);
- what `tpumk export` deletes: only the temporaries it marked as its own, never a user's
  `.tmp-*` directory; and the mode of what it publishes (the umask's, not 0700).

FIFO cases run in-process: a watchdog opens the FIFO for writing once the limit has passed (which
unblocks a reader stuck in open(), so a hang is reported, not waited out). Device cases run in a
subprocess with an address-space limit (a read of /dev/zero must not take the machine's memory).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tpumk.cli import main

from cli_output import error_lines
from file_trees import Fifo, Sparse, Symlink, snapshot, stray, write_tree

REPO = Path(__file__).resolve().parents[1]
TINY_SPACE = str(REPO / "tuning_spaces" / "tiny.toml")
SIGNING_VARS = ("TPUMK_SIGNING_KEY", "TPUMK_SIGNING_KEY_FILE", "TPUMK_REQUIRE_SIGNED")
USAGE, INPUT = 2, 1
LIMIT = 30.0  # seconds: every case is refused before any compile
PROC_LIMIT = 90.0  # a fresh process imports jax first
MEMORY_CAP = 6 << 30  # bytes of address space a subprocess case may take

HF_TINY = dict(model_type="qwen3", _name_or_path="tiny-ckpt", hidden_size=128, num_attention_heads=2,
               num_key_value_heads=1, head_dim=128, num_hidden_layers=1, intermediate_size=256, vocab_size=256,
               rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, torch_dtype="float32",
               hidden_act="silu")
MODEL_TOML = ('name = "hostile"\nnum_layers = 1\nhidden_size = 128\nnum_q_heads = 2\nnum_kv_heads = 1\n'
              'head_dim = 128\nffn_size = 256\nvocab_size = 256\ndtype = "float32"\n')
KEY = "k" * 64
LONG = "n" * 300  # one path component over NAME_MAX (255 bytes)
# magic, version 3, no tensors, one key/value: key 'a', an ARRAY (9) of UINT8 (0) with 2**62 items
GGUF_BOMB = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 0, 1 << 62)
DEEP = "/".join(["d" * 100] * 45)  # short components, the whole over PATH_MAX (4095 bytes)


BUILD = ["build", "--target", "cpu"]
KEY_ARGS = ["cache-key", "--model", "tiny-dense", "--target", "cpu"]
GEN = ["generate", "--model", "tiny-dense", "--prompt-ids", "1", "--steps", "1"]
DRAFT = [*GEN, "--spec", "draft", "--draft-model"]
CKPT_BUILD = ["build", "--checkpoint", "ckpt", "--target", "cpu"]
CKPT_GEN = ["generate", "--checkpoint", "ckpt", "--prompt-ids", "1", "--steps", "1"]
# tiny-dense: these tests are about the study's files, and its compile is the quickest
TUNE = ["tune", "--model", "tiny-dense", "--target", "cpu", "--objective", "model", "--trials", "1",
        "--cache-dir", "cache", "--out", "best/t.toml"]
TUNE_DIRS = ("st", "cache", "best")
EXPORT = ["export", "--model", "tiny-dense", "--target", "cpu", "--out", "out"]  # reads the key before compiling


def _tune(space: str = TINY_SPACE, storage: str = "sqlite:///st/s.db", *more: str) -> list[str]:
    return [*TUNE, "--space", space, "--storage", storage, *more]


def ckpt(config: Any = None, tensors: Any = None) -> dict[str, Any]:
    files: dict[str, Any] = {"ckpt/": None, "ckpt/config.json": json.dumps(HF_TINY) if config is None else config}
    if tensors is not None:
        files["ckpt/model.safetensors"] = tensors
    return files


@dataclass
class Case:
    id: str
    args: list[str]
    files: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    code: int = INPUT
    says: tuple[str, ...] = ()  # substrings the error line must hold (what makes it the right refusal)
    allow: tuple[str, ...] = ()
    subprocess: bool = False


CASES: list[Case] = [
    # ---- FIFOs: every option that reads a file, and the files a checkpoint holds
    Case("fifo-model-toml", [*BUILD, "--model", "m.toml"], {"m.toml": Fifo()}, says=("m.toml", "FIFO")),
    Case("fifo-model-config-json", [*BUILD, "--model", "config.json"], {"config.json": Fifo()}, says=("FIFO",)),
    Case("fifo-model-via-symlink", ["cache-key", "--model", "link.toml", "--target", "cpu"],
         {"p": Fifo(), "link.toml": Symlink("p")}, says=("FIFO",)),
    Case("fifo-tuning", [*KEY_ARGS, "--tuning", "t.toml"], {"t.toml": Fifo()}, says=("t.toml", "FIFO")),
    Case("fifo-tuning-build", ["build", "--model", "tiny-dense", "--target", "cpu", "--tuning", "t.toml"],
         {"t.toml": Fifo()}, says=("FIFO",)),
    Case("fifo-space", _tune("s.toml"), {"s.toml": Fifo()}, says=("s.toml", "FIFO"), allow=TUNE_DIRS),
    Case("fifo-draft-model-toml", [*DRAFT, "d.toml"], {"d.toml": Fifo()}, says=("FIFO",)),
    Case("fifo-draft-model-json", [*DRAFT, "d.json"], {"d.json": Fifo()}, says=("FIFO",)),
    Case("fifo-checkpoint-config-json", CKPT_BUILD, ckpt(config=Fifo()), says=("config.json", "FIFO")),
    Case("fifo-checkpoint-safetensors", CKPT_GEN, ckpt(tensors=Fifo()), says=("model.safetensors", "FIFO")),
    Case("fifo-checkpoint-dir-as-model", [*BUILD, "--model", "ckpt"], ckpt(config=Fifo()), says=("FIFO",)),
    Case("fifo-signing-key-file", EXPORT, {"key": Fifo()}, env={"TPUMK_SIGNING_KEY_FILE": "key"},
         says=("TPUMK_SIGNING_KEY_FILE", "FIFO"), allow=("out",)),
    # ---- directories where a file is expected
    Case("dir-space", _tune("s.toml"), {"s.toml/": None}, says=("s.toml", "directory"), allow=TUNE_DIRS),
    Case("dir-tuning", [*KEY_ARGS, "--tuning", "t.toml"], {"t.toml/": None}, says=("directory",)),
    Case("dir-checkpoint-config-json", CKPT_BUILD, {"ckpt/config.json/": None}, says=("config.json", "directory")),
    Case("dir-checkpoint-safetensors", CKPT_GEN, ckpt(tensors=None) | {"ckpt/model.safetensors/": None},
         says=("model.safetensors", "directory")),
    Case("dir-signing-key-file", EXPORT, {"key/": None}, env={"TPUMK_SIGNING_KEY_FILE": "key"},
         says=("TPUMK_SIGNING_KEY_FILE", "directory"), allow=("out",)),
    # ---- files far larger than any config or key
    Case("oversized-model-toml", [*BUILD, "--model", "m.toml"], {"m.toml": Sparse(64 << 20, b"# ")},
         says=("m.toml", "larger than")),
    Case("oversized-config-json", [*BUILD, "--model", "config.json"], {"config.json": Sparse(64 << 20, b" ")},
         says=("larger than",)),
    Case("oversized-space", _tune("s.toml"), {"s.toml": Sparse(64 << 20, b"# ")}, says=("larger than",),
         allow=TUNE_DIRS),
    Case("oversized-signing-key-file", EXPORT, {"key": "k" * (1 << 20)}, env={"TPUMK_SIGNING_KEY_FILE": "key"},
         says=("TPUMK_SIGNING_KEY_FILE", "larger than"), allow=("out",)),
    Case("safetensors-header-past-its-end", CKPT_GEN, ckpt(tensors=(1 << 40).to_bytes(8, "little") + b"{}"),
         says=("model.safetensors",)),
    # ---- devices (a fresh process with an address-space cap: the old read never ended)
    Case("dev-zero-model-toml", [*BUILD, "--model", "z.toml"], {"z.toml": Symlink("/dev/zero")},
         says=("character device",), subprocess=True),
    Case("dev-zero-tuning", [*KEY_ARGS, "--tuning", "/dev/zero"], says=("/dev/zero", "character device"),
         subprocess=True),
    Case("dev-zero-checkpoint-config", CKPT_BUILD, ckpt(config=Symlink("/dev/zero")), says=("character device",),
         subprocess=True),
    Case("dev-zero-signing-key-file", EXPORT, env={"TPUMK_SIGNING_KEY_FILE": "/dev/zero"},
         says=("TPUMK_SIGNING_KEY_FILE", "character device"), subprocess=True, allow=("out",)),
    Case("dev-zero-safetensors", CKPT_GEN, ckpt(tensors=Symlink("/dev/zero")), says=("character device",),
         subprocess=True),
    # ---- a 49-byte GGUF declaring an array of 2**62 items: the reader walked it item by item,
    # memory growing ~100 MB/s, and never returned (a fresh process with the address-space cap)
    Case("gguf-array-of-2-62-items", ["generate", "--checkpoint", "bomb.gguf", "--prompt-ids", "1", "--steps", "1"],
         {"bomb.gguf": GGUF_BOMB}, says=("bomb.gguf", "metadata array 'a'", "the file ends at byte 49"),
         subprocess=True),
    # ---- names the OS refuses as too long, for every path option
    Case("long-model", [*BUILD, "--model", LONG + ".toml"], says=("--model", "255")),
    Case("long-model-preset-like", [*BUILD, "--model", LONG], says=("--model", "255")),
    Case("long-model-json-in-subdir", [*BUILD, "--model", f"x/{LONG}/config.json"], says=("--model", "255")),
    Case("long-checkpoint", ["build", "--checkpoint", LONG, "--target", "cpu"], says=("--checkpoint", "255")),
    Case("long-tuning", [*KEY_ARGS, "--tuning", LONG + ".toml"], says=("--tuning", "255")),
    Case("long-space", _tune(LONG + ".toml"), says=("--space", "255")),
    Case("long-storage-journal", _tune(TINY_SPACE, LONG + ".journal"), says=("--storage", "255")),
    Case("long-storage-sqlite", _tune(TINY_SPACE, f"sqlite:///{LONG}.db"), says=("--storage", "255")),
    Case("long-tune-out", [*TUNE[:-2], "--out", f"{LONG}.toml", "--space", TINY_SPACE, "--storage", "sqlite:///st/s.db"],
         says=("--out", "255")),
    Case("long-cache-dir", [*_tune(), "--cache-dir", LONG], says=("--cache-dir", "255")),
    Case("long-report-dir", [*_tune(), "--report", LONG], says=("--report", "255")),
    Case("long-export-out", ["export", "--model", "tiny-dense", "--target", "cpu", "--out", f"{LONG}/x"],
         says=("--out", "255")),
    Case("long-cache-key-out", [*KEY_ARGS, "--out", LONG], says=("--out", "255")),
    Case("long-report-out", ["report", "--out", LONG, "--storage", "st/x.journal"], says=("--out", "255")),
    Case("long-inspect-path", ["inspect", LONG], says=("PATH", "255")),
    Case("long-draft-model", [*DRAFT, LONG], says=("--draft-model", "255")),
    Case("long-generate-checkpoint", ["generate", "--checkpoint", LONG, "--prompt-ids", "1"],
         says=("--checkpoint", "255")),
    Case("long-shard-name-in-index", CKPT_GEN, ckpt(tensors=b"unused") | {
        "ckpt/model.safetensors.index.json": json.dumps({"weight_map": {"model.norm.weight": LONG + ".safetensors"}})},
         says=("model.safetensors.index.json", "255")),
    # ---- an index naming a shard outside the checkpoint directory (was joined to it and read)
    Case("index-shard-outside-dir", CKPT_GEN, ckpt(tensors=b"unused") | {"outside.safetensors": b"unused",
        "ckpt/model.safetensors.index.json": json.dumps({"weight_map": {"model.norm.weight": "../outside.safetensors"}})},
         says=("model.safetensors.index.json", "'../outside.safetensors'", "expected a file name inside")),
    Case("index-shard-absolute", CKPT_GEN, ckpt(tensors=b"unused") | {
        "ckpt/model.safetensors.index.json": json.dumps({"weight_map": {"model.norm.weight": "/etc/passwd"}})},
         says=("model.safetensors.index.json", "expected a file name inside")),
    Case("long-whole-path", [*KEY_ARGS, "--tuning", DEEP + ".toml"], says=("--tuning", "4095")),
    Case("long-signing-key-file", EXPORT, env={"TPUMK_SIGNING_KEY_FILE": LONG},
         says=("TPUMK_SIGNING_KEY_FILE", "255"), allow=("out",)),
    # ---- a signing key that is not UTF-8 text
    Case("key-env-not-utf8", EXPORT, env={"TPUMK_SIGNING_KEY": "k" * 20 + "\udcff\udcfe"},
         says=("TPUMK_SIGNING_KEY", "not UTF-8"), allow=("out",)),
    Case("key-file-not-utf8", EXPORT, {"key": b"k" * 20 + b"\xff\xfe\x80"}, env={"TPUMK_SIGNING_KEY_FILE": "key"},
         says=("TPUMK_SIGNING_KEY_FILE", "not UTF-8"), allow=("out",)),
    # ---- names that would drive the terminal: stay one visible line
    Case("escape-in-model-path", [*BUILD, "--model", "\x1b]0;pwned\x07\x1b[2J.toml"], says=("\\x1b",)),
    Case("newline-in-model-path", [*BUILD, "--model", "a\nb\r.toml"], says=("a\\nb\\r.toml",)),
    Case("bidi-in-tuning-path", [*KEY_ARGS, "--tuning", "x\u202egnp.toml"], says=("\\u202e",)),
    # ---- storage: in-memory SQLite keeps nothing
    Case("sqlite-memory", _tune(TINY_SPACE, "sqlite:///:memory:"), says=("in-memory",), allow=TUNE_DIRS),
    Case("sqlite-empty-path", _tune(TINY_SPACE, "sqlite://"), says=("in-memory",), allow=TUNE_DIRS),
    # a URI filename SQLite opens in memory (was: Optuna's "exceeding max length")
    Case("sqlite-uri-memory", _tune(TINY_SPACE, "sqlite:///file::memory:?uri=true"), says=("in-memory",),
         allow=TUNE_DIRS),
    Case("sqlite-uri-mode-memory", _tune(TINY_SPACE, "sqlite:///file:s.db?mode=memory&uri=true"),
         says=("in-memory",), allow=TUNE_DIRS),
    Case("report-sqlite-uri-memory", ["report", "--storage", "sqlite:///file::memory:?uri=true", "--out", "plots"],
         says=("in-memory",), allow=("plots",)),
    # ---- storage: a journal that is not a regular file says what it is (was: "no such file")
    Case("fifo-storage-journal", _tune(TINY_SPACE, "f.journal"), {"f.journal": Fifo()}, says=("f.journal", "FIFO"),
         allow=TUNE_DIRS),
    Case("fifo-report-journal", ["report", "--storage", "f.journal", "--out", "plots"], {"f.journal": Fifo()},
         says=("f.journal", "FIFO"), allow=("plots",)),
    Case("dev-zero-storage-journal", _tune(TINY_SPACE, "journal:/dev/zero"), says=("/dev/zero", "character device"),
         allow=TUNE_DIRS),
    Case("dev-zero-report-journal", ["report", "--storage", "journal:/dev/zero", "--out", "plots"],
         says=("/dev/zero", "character device"), allow=("plots",)),
    Case("dev-zero-report-sqlite", ["report", "--storage", "sqlite:////dev/zero", "--out", "plots"],
         says=("/dev/zero", "character device"), allow=("plots",)),
]

_ids = [c.id for c in CASES]
assert len(_ids) == len(set(_ids))


# ---------------------------------------------------------------------- the harness


def _unblock_after(fifos: list[Path], seconds: float, fired: list[bool]) -> threading.Event:
    """After `seconds`, open each FIFO for writing and close it: a reader blocked in open() gets
    EOF, so a hang shows up as a failure instead of stalling the suite."""
    done = threading.Event()

    def run():
        if done.wait(seconds):
            return
        fired.append(True)
        while not done.is_set():  # until the command returns: it may open the FIFO again
            for p in fifos:
                try:
                    os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass  # ENXIO: no reader (yet)
            time.sleep(0.2)

    threading.Thread(target=run, daemon=True).start()
    return done


# `python -m tpumk.cli ARGS` with its address space capped first (set in the child itself: no
# preexec_fn, which forks a multithreaded JAX process)
CAPPED_CLI = (f"import resource, runpy; resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_CAP}, {MEMORY_CAP})); "
              "runpy.run_module('tpumk.cli', run_name='__main__', alter_sys=True)")


@pytest.fixture(scope="module")
def warm():
    runner = CliRunner()
    runner.invoke(main, ["cache-key", "--model", "tiny-dense", "--target", "cpu"])
    import optuna  # noqa: F401
    import safetensors  # noqa: F401


def check_one_line(code, stdout, stderr, exc, expect_code=INPUT, says=()) -> list[str]:
    problems = []
    if exc is not None and not isinstance(exc, SystemExit):
        problems.append(f"uncaught {type(exc).__name__}: {' '.join(str(exc).split())[:200]}")
    if code != expect_code:
        problems.append(f"exit code {code}, expected {expect_code}")
    if "Traceback" in stdout or "Traceback" in stderr:
        problems.append("'Traceback' in the output")
    lines = error_lines(stderr)  # after any progress lines of the phases that started
    if len(lines) != 1 or not lines[0].startswith("tpumk: error:"):
        problems.append(f"stderr is not one 'tpumk: error: ...' line ({len(lines)} lines)")
    if any(ord(c) < 32 and c not in "\n" or c == "\u202e" for c in stdout + stderr):
        problems.append("a control character reached the terminal")
    for s in says:
        if s not in stderr:
            problems.append(f"the error does not say {s!r}")
    return problems


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_hostile_file(case: Case, tmp_path: Path, monkeypatch, warm):
    parent = tmp_path / "sentinel-parent"
    cwd = parent / "cwd"
    cwd.mkdir(parents=True)
    (parent / "SENTINEL").write_text("nothing may change here\n")
    fifos = write_tree(cwd, case.files)
    before = snapshot(parent)
    monkeypatch.chdir(cwd)
    for k in SIGNING_VARS:
        monkeypatch.delenv(k, raising=False)

    t0 = time.perf_counter()
    fired: list[bool] = []
    if case.subprocess:
        env = {k: v for k, v in os.environ.items() if k not in SIGNING_VARS} | case.env
        try:
            p = subprocess.run([sys.executable, "-c", CAPPED_CLI, *case.args], cwd=cwd, env=env,
                               capture_output=True, text=True, timeout=PROC_LIMIT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{case.id}: still running after {PROC_LIMIT:.0f} s", pytrace=False)
        code, stdout, stderr, exc = p.returncode, p.stdout, p.stderr, None
        limit = PROC_LIMIT
    else:
        for k, v in case.env.items():
            monkeypatch.setenv(k, v)
        done = _unblock_after(fifos, LIMIT, fired)
        try:
            r = CliRunner().invoke(main, case.args, catch_exceptions=True)
        finally:
            done.set()
        code, stdout, stderr, exc = r.exit_code, r.stdout, r.stderr, r.exception
        limit = LIMIT
    seconds = time.perf_counter() - t0
    after = snapshot(parent)

    problems = check_one_line(code, stdout, stderr, exc, case.code, case.says)
    if fired:
        problems.insert(0, f"blocked on a FIFO for {LIMIT:.0f} s (a hang: unblocked by the test)")
    outside = stray(before, after, [str(Path("cwd") / a) for a in case.allow])
    if outside:
        problems.append(f"wrote or removed outside {list(case.allow) or 'nothing allowed'}: {outside[:5]}")
    if seconds > limit:
        problems.append(f"took {seconds:.1f} s (limit {limit:.0f} s)")
    if problems:
        pytest.fail(f"{case.id}: " + "; ".join(problems) + f"\n  stderr: {stderr[:300]!r}", pytrace=False)


def test_checkpoint_paths_the_os_cannot_open_are_one_line(tmp_path):
    """The library's checkpoint readers, called with a path the OS would refuse (a component over
    255 bytes), or a directory that exists but whose files' paths pass 4095 bytes: one line
    naming the path, never an OSError from is_file() / exists()."""
    from tpumk.errors import CheckpointError, ConfigError
    from tpumk.model.checkpoint import checkpoint_config, load_checkpoint
    from tpumk.model.tokenizer import load_tokenizer

    deep = tmp_path
    while len(os.fsencode(deep)) < 4090:  # room for the directory, none for its config.json / tokenizer.json
        deep = deep / ("d" * min(200, 4090 - 1 - len(os.fsencode(deep))))
    assert len(os.fsencode(deep)) == 4090
    deep.mkdir(parents=True)
    for fn, path, words in ((load_checkpoint, tmp_path / LONG, "255"), (load_checkpoint, deep, "4095"),
                            (load_tokenizer, tmp_path / LONG, "255"), (load_tokenizer, deep, "4095"),
                            (checkpoint_config, tmp_path / (LONG + ".gguf"), "255"),
                            (checkpoint_config, deep, "4095")):
        with pytest.raises(Exception) as e:
            fn(path)
        assert isinstance(e.value, (CheckpointError, ConfigError)), (fn.__name__, path, repr(e.value)[:200])
        assert words in str(e.value) and "\n" not in str(e.value), (fn.__name__, str(e.value)[:200])


# ---------------------------------------------------------------------- the tuning journal
def _journal_study(path: Path, trials: int):
    import optuna

    from tpumk.tune.storage import open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=open_storage(f"journal:{path}"), study_name="s", load_if_exists=True)
    study.optimize(lambda t: t.suggest_float("a", 0, 1), n_trials=trials)
    return study


def _reopen(path: Path):
    import optuna

    from tpumk.tune.storage import open_storage

    return optuna.load_study(storage=open_storage(f"journal:{path}"), study_name="s")


def test_torn_journal_is_repaired_and_keeps_every_completed_trial(tmp_path, capfd):
    """What a crash or a full disk leaves mid-append: the last record cut short. The next open
    drops it (one line on stderr), keeps the complete trials, and the study goes on: more trials
    append and every later open reads them. (Before: the next append landed on the partial line
    and every later open refused the file.)"""
    j = tmp_path / "s.journal"
    _journal_study(j, 3)
    values = [t.value for t in _reopen(j).trials]
    data = j.read_bytes()
    j.write_bytes(data + data.splitlines(keepends=True)[-1][:25])  # a record cut short
    capfd.readouterr()
    study = _reopen(j)
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and "repaired" in err[0] and str(j) in err[0], err
    assert [t.value for t in study.trials] == values
    study.optimize(lambda t: t.suggest_float("a", 0, 1), n_trials=2)
    again = _reopen(j)
    assert [t.value for t in again.trials][:3] == values and len(again.trials) == 5
    assert all(t.state.name == "COMPLETE" for t in again.trials)
    assert capfd.readouterr().err == ""  # a whole journal: nothing to say


def test_journal_an_older_tpumk_appended_onto_a_torn_line_is_salvaged(tmp_path, capfd):
    """The damage already done: a partial record with a complete one appended to it on one line.
    The complete record is recovered, every other trial kept."""
    j = tmp_path / "s.journal"
    _journal_study(j, 2)
    lines = j.read_bytes().splitlines(keepends=True)
    last = lines[-1]
    j.write_bytes(b"".join(lines[:-1]) + last[:30] + last)  # torn, then the next append onto it
    with j.open("ab") as f:
        f.write(lines[-1])  # and a later record, so Optuna's reader meets the bad line mid-file
    capfd.readouterr()
    study = _reopen(j)
    assert len(study.trials) == 2 and all(t.state.name == "COMPLETE" for t in study.trials)
    assert "repaired" in capfd.readouterr().err


def test_journal_that_is_no_journal_is_still_refused(tmp_path):
    from tpumk.errors import ConfigError
    from tpumk.tune.storage import open_storage

    for i, text in enumerate([b"this is not a journal\nnor this",  # looks torn: no final newline
                              b'{"a": 1}\n{"b": 2}\n{"c":',  # JSON lines, but not Optuna's records
                              b'{"op_code": 0}\nnot json\n{"op_code"']):
        j = tmp_path / f"s{i}.journal"
        j.write_bytes(text)
        with pytest.raises(ConfigError, match="not a readable Optuna journal"):
            open_storage(f"journal:{j}")
        assert j.read_bytes() == text  # nothing rewritten, nothing truncated


def test_tune_resumes_a_torn_journal(tmp_path, monkeypatch, warm):
    """Through the command line, as the issue saw it: a run's journal torn, the next `tpumk tune`
    says it repaired it and finishes, keeping the first run's trial."""
    monkeypatch.chdir(tmp_path)
    args = _tune(TINY_SPACE, "st/s.journal", "--study", "torn", "--json")
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, (r.stderr, r.exception)
    j = tmp_path / "st" / "s.journal"
    data = j.read_bytes()
    j.write_bytes(data + data.splitlines(keepends=True)[-1][:40])
    t0 = time.perf_counter()
    more = list(args)
    more[more.index("--trials") + 1] = "2"
    r = CliRunner().invoke(main, more)
    assert time.perf_counter() - t0 < 120
    assert r.exit_code == 0, (r.stderr[-500:], r.exception)
    assert "Traceback" not in r.stderr
    assert sum("repaired the tuning journal" in ln for ln in r.stderr.splitlines()) == 1
    summary = json.loads(r.stdout)
    assert summary["counts"].get("COMPLETE", 0) >= 2, summary["counts"]


# ---------------------------------------------------------------------- damaged SQLite
def _damaged_db(path: Path) -> None:
    import optuna

    from tpumk.tune.storage import open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=open_storage(f"sqlite:///{path}"), study_name="s")
    study.optimize(lambda t: t.suggest_float("a", 0, 1), n_trials=3)
    del study
    data = bytearray(path.read_bytes())
    page = 4096
    data[3 * page:6 * page] = b"\x55" * (3 * page)  # pages a crash or a bad copy scrambled
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["scrambled-pages", "truncated", "not-sqlite"])
def test_damaged_sqlite_storage_is_one_line_saying_how_to_recover(tmp_path, monkeypatch, warm, damage):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "st" / "s.db"
    db.parent.mkdir()
    if damage == "not-sqlite":
        db.write_bytes(os.urandom(8192))
    else:
        _damaged_db(db)
        if damage == "truncated":
            db.write_bytes(db.read_bytes()[: 5 * 4096])
    before = db.read_bytes()
    r = CliRunner().invoke(main, _tune(TINY_SPACE, "sqlite:///st/s.db"))
    problems = check_one_line(r.exit_code, r.stdout, r.stderr, r.exception, INPUT, ("st/s.db", "move it aside"))
    assert not problems, (problems, r.stderr)
    assert db.read_bytes() == before  # refused, not touched


# ---------------------------------------------------------------------- what export deletes, and modes
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One cpu export into an --out where a user keeps `.tmp-*` directories of their own (old,
    and one named like a dead export's temporary), with umask 0o002."""
    from tpumk.export import paths

    out = tmp_path_factory.mktemp("out")
    parent = out / "tiny-dense" / "cpu"
    parent.mkdir(parents=True)
    mine = {"old": parent / ".tmp-my-notes", "pidlike": parent / f".tmp-0123456789abcdef.{2 ** 22 + 17}."
                                                                   f"{paths._host_tag()}.abc"}
    for d in mine.values():
        d.mkdir()
        (d / "precious.txt").write_text("a user's file\n")
        old = time.time() - 3 * paths.STALE_SECONDS
        os.utime(d, (old, old))
    saved = {v: os.environ.pop(v, None) for v in SIGNING_VARS}
    mask = os.umask(0o002)
    try:
        t0 = time.perf_counter()
        r = CliRunner().invoke(main, ["export", "--model", "tiny-dense", "--target", "cpu", "--out", str(out),
                                      "--json"])
        seconds = time.perf_counter() - t0
    finally:
        os.umask(mask)
        for v, val in saved.items():
            if val is not None:
                os.environ[v] = val
    assert r.exit_code == 0, (r.stderr, r.exception)
    return {"out": out, "parent": parent, "mine": mine, "path": Path(json.loads(r.stdout)["path"]),
            "seconds": seconds}


def test_export_never_deletes_a_users_tmp_directory(exported):
    for d in exported["mine"].values():
        assert (d / "precious.txt").read_text() == "a user's file\n", d


def test_published_artifact_gets_the_umask_mode(exported):
    from tpumk.export import paths

    mode = stat.S_IMODE(exported["path"].stat().st_mode)
    assert mode == 0o775, oct(mode)  # 0o777 & ~0o002, not mkdtemp's 0o700
    assert not (exported["path"] / paths.TMP_MARKER).exists()
    assert sorted(p.name for p in exported["parent"].iterdir() if p.name.startswith(".tmp-")) == \
        sorted(d.name for d in exported["mine"].values())  # no temporary of its own left either


def test_only_marked_temporaries_are_swept(tmp_path):
    """The sweep itself: a marked temporary of a dead export goes; an unmarked one, a symlink to
    a marked one, and a marker that is a symlink or holds other text all stay."""
    from tpumk.export import paths

    host = paths._host_tag()
    dead = f"{2 ** 22 + 17}.{host}"
    marked = tmp_path / f".tmp-aaaaaaaaaaaaaaaa.{dead}.x"
    unmarked = tmp_path / f".tmp-bbbbbbbbbbbbbbbb.{dead}.y"
    wrong_text = tmp_path / f".tmp-cccccccccccccccc.{dead}.z"
    link_marker = tmp_path / f".tmp-dddddddddddddddd.{dead}.w"
    link_dir = tmp_path / f".tmp-eeeeeeeeeeeeeeee.{dead}.v"
    elsewhere = tmp_path / "elsewhere"
    for d in (marked, unmarked, wrong_text, link_marker, elsewhere):
        d.mkdir()
        (d / "f").write_text("x")
    (marked / paths.TMP_MARKER).write_bytes(paths.TMP_MARKER_TEXT)
    (wrong_text / paths.TMP_MARKER).write_text("mine, not tpumk's\n")
    (elsewhere / paths.TMP_MARKER).write_bytes(paths.TMP_MARKER_TEXT)
    (link_marker / paths.TMP_MARKER).symlink_to(elsewhere / paths.TMP_MARKER)
    link_dir.symlink_to(elsewhere)
    removed = paths.clean_stale_tmps(tmp_path, now=time.time() + 3 * paths.STALE_SECONDS)
    assert removed == [marked] and not marked.exists()
    for d in (unmarked, wrong_text, link_marker, elsewhere):
        assert (d / "f").exists(), d
    assert link_dir.is_symlink()


# ---------------------------------------------------------------------- a hostile manifest on the terminal
def test_inspect_escapes_a_hostile_manifest(exported, tmp_path, monkeypatch):
    """A manifest whose fields hold terminal escape sequences (an OSC title change, a screen
    clear, a bell, a right-to-left override) is shown with them escaped, on stdout and in the
    one error line."""
    evil = tmp_path / "evil"
    shutil.copytree(exported["path"], evil)
    mf = evil / "manifest.toml"
    text = mf.read_text()
    assert 'name = "tiny-dense"' in text
    mf.write_text(text.replace('name = "tiny-dense"', 'name = "tiny\\u001b]0;pwned\\u0007\\u001b[2J\\u202edense"', 1))
    for k in SIGNING_VARS:
        monkeypatch.delenv(k, raising=False)
    r = CliRunner().invoke(main, ["inspect", str(evil)])
    out = r.stdout + r.stderr
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out, out[:500]
    assert "\\x1b]0;pwned\\x07" in out
    r = CliRunner().invoke(main, ["inspect", str(tmp_path)])  # the listing of a tree holding it
    out = r.stdout + r.stderr
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out, out[:500]
