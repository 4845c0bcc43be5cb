"""Shared study storages: two `tpumk tune` processes on one Journal file, and on a real
PostgreSQL server started on loopback for the test (the way a team spreads a study over many
machines), finish one study without evaluating any configuration twice. Plus the heartbeat
that lets a rerun fail a killed run's trials, on JournalStorage too.

Each process gets its own result cache directory, as processes on different machines would:
the only thing that can keep them from evaluating a configuration twice is the claim they
make through the shared storage.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import optuna
import pytest

from tpumk.child_process import command
from tpumk.compat import optuna_heartbeat_enabled
from tpumk.tune.cache import ResultCache
from tpumk.tune.storage import fail_stale, open_storage, storage_url
from tpumk.tune.study import open_study
from tpumk.tune.space import SPACES_DIR, load_space

TINY_SPACE = str(SPACES_DIR / "tiny.toml")


# ---------------------------------------------------------------------- heartbeat on a journal
def test_journal_storage_fails_stale_trials_but_not_live_ones(tmp_path):
    storage = open_storage(storage_url(str(tmp_path / "s.journal"), "x"), heartbeat=1)
    assert optuna_heartbeat_enabled(storage)
    study = optuna.create_study(storage=storage, study_name="x")
    with pytest.warns(UserWarning, match="Heartbeat"):  # Optuna: heartbeats are for optimize()
        dead = study.ask()  # left RUNNING, as by a killed process
    storage.record_heartbeat(dead._trial_id)
    fail_stale(study)
    assert study.trials[dead.number].state.name == "RUNNING"  # within the grace period (3 s)

    # A live trial under optimize() keeps beating while it runs past the grace period.
    def slow(trial):
        time.sleep(4.5)
        return 1.0

    live = threading.Thread(target=lambda: study.optimize(slow, n_trials=1))
    live.start()
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        fail_stale(study)
        time.sleep(0.5)
    live.join()
    states = [t.state.name for t in study.trials]
    assert states == ["FAIL", "COMPLETE"]


# ---------------------------------------------------------------------- two processes, one study
def run_two_processes(tmp_path: Path, storage: str, name: str) -> None:
    space = load_space(TINY_SPACE)
    study = open_study(storage_url(storage, name), name, None, None, heartbeat=1)
    d = space.default_values()
    # The same configurations queued back to back, so the processes meet them at the same time.
    study.enqueue_trial(d, user_attrs={"tpumk_default": True})
    for ring in (8, 8, 4, 4):
        study.enqueue_trial({**d, "ring_depth": ring})
    procs = []
    for i in range(2):
        # tiny-dense: the claim protocol is the same for every model, its compile the quickest
        cmd = [*command("tpumk.cli"), "tune", "--model", "tiny-dense", "--target", "tpu7x", "--space",
               TINY_SPACE, "--objective", "model", "--trials", "4", "--storage", storage, "--study", name,
               "--heartbeat", "1", "--seed", str(10 + i), "--cache-dir", str(tmp_path / f"cache{i}"), "--json"]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=400)
            assert p.returncode == 0, err[-2000:]
            outs.append(json.loads(out))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    study = optuna.load_study(study_name=name, storage=open_storage(storage_url(storage, name)))
    trials = study.trials
    states = [t.state.name for t in trials]
    compiled_or_reused = [t for t in trials if t.state.name == "COMPLETE"
                          or t.user_attrs.get("prune_stage") not in (None, "tuning", "constraint", "plan")]
    # The budget: distinct evaluated configurations (the queued duplicates do not count).
    assert len({t.user_attrs["config_key"] for t in compiled_or_reused}) == 4  # 3 queued, 1 sampled
    assert not {"RUNNING", "WAITING"} & set(states)
    assert all(o["this_run"]["trials"] > 0 for o in outs)  # both processes worked on the study
    logs = [ResultCache(tmp_path / f"cache{i}").compile_log() for i in range(2)]
    compiled = [e["key"] for log in logs for e in log]
    assert compiled and len(compiled) == len(set(compiled))  # no configuration evaluated twice
    by_key: dict[str, list] = {}
    for t in trials:
        if t.state.name in ("COMPLETE", "PRUNED") and "config_key" in t.user_attrs:
            by_key.setdefault(t.user_attrs["config_key"], []).append(t)
    assert set(by_key) == set(compiled)
    dups = 0
    for key, ts in by_key.items():
        owners = [t for t in ts if not t.user_attrs["cached"]]
        assert len(owners) == 1  # one trial evaluated it ...
        for t in ts:
            if t is not owners[0]:  # ... the others reused its result
                dups += 1
                assert t.value == owners[0].value and t.state == owners[0].state
    assert dups >= 2  # the queued duplicates


# The full tier: two processes on one study run in the default run through PostgreSQL (below:
# the same claim protocol, storage-agnostic); tune on a journal file, resumed after a torn
# write, in test_hostile_files.py::test_tune_resumes_a_torn_journal.
@pytest.mark.full
def test_two_processes_share_a_journal_file(tmp_path):
    run_two_processes(tmp_path, str(tmp_path / "study.journal"), "shared-journal")


# ---------------------------------------------------------------------- a real PostgreSQL server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres_url():
    """A PostgreSQL server of Debian's `postgresql` package, started for these tests on a free
    loopback port in a temporary directory and removed afterwards. Skipped only where the
    server is not installed outside CI; in CI (.ci/run installs it) a missing server fails."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL server binaries missing (/usr/lib/postgresql/*/bin/initdb); .ci/run installs them")
        pytest.skip("PostgreSQL server not installed (apt-get install postgresql)")
    bindir = Path(found[-1]).parent
    root = Path(tempfile.mkdtemp(prefix="tpumk-pg-"))
    prefix: list[str] = []
    if os.geteuid() == 0:  # the server refuses to run as root: run it as the postgres system user
        if subprocess.run(["id", "-u", "postgres"], capture_output=True).returncode != 0:
            subprocess.run(["useradd", "--system", "--no-create-home", "postgres"], check=True)
        shutil.chown(root, "postgres")
        prefix = ["runuser", "-u", "postgres", "--"]

    def pg(*cmd):
        r = subprocess.run(prefix + [str(c) for c in cmd], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            log = root / "server.log"
            raise RuntimeError(f"{cmd[0]} failed: {r.stderr.strip()[-1000:]}"
                               + (f"\nserver log: {log.read_text()[-1000:]}" if log.exists() else ""))
        return r

    data, port = root / "data", _free_port()
    pg(bindir / "initdb", "-D", data, "-A", "trust", "-U", "postgres", "--no-sync")
    pg(bindir / "pg_ctl", "-D", data, "-l", root / "server.log", "-w", "-t", "60", "-o",
       f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
    try:
        pg(bindir / "createdb", "-h", "127.0.0.1", "-p", port, "-U", "postgres", "tpumk")
        yield f"postgresql://postgres@127.0.0.1:{port}/tpumk"
    finally:
        subprocess.run(prefix + [str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


def test_two_processes_share_a_postgresql_study(tmp_path, postgres_url):
    run_two_processes(tmp_path, postgres_url, "shared-postgres")


def test_storage_urls(tmp_path):
    assert storage_url(None, "s", Path("artifacts/tune")) == "sqlite:///artifacts/tune/s.db"
    assert storage_url("x/s.db", "s") == "sqlite:///x/s.db"
    assert storage_url("journal:x/s.log", "s") == "journal:x/s.log"
    assert storage_url("postgresql://u@h/db", "s") == "postgresql://u@h/db"
    # Both journal spellings open a JournalStorage with heartbeats, creating the directory.
    for spec in (f"journal:{tmp_path}/a/s.log", str(tmp_path / "b" / "s.journal")):
        st = open_storage(storage_url(spec, "s"), heartbeat=2)
        assert type(st).__name__ == "JournalHeartbeatStorage" and st.get_heartbeat_interval() == 2
    assert (tmp_path / "a" / "s.log").exists() and (tmp_path / "b" / "s.journal").exists()


# ---------------------------------------------------------------------- secrets in storage URLs
SECRET = "S3cr3tPW"


@pytest.mark.parametrize("url, shown", [
    (f"postgresql://u@host/db?password={SECRET}", "postgresql://u@host/db?password=***"),
    (f"postgresql://u:{SECRET}@host:5432/db", "postgresql://u:***@host:5432/db"),
    # an unescaped '@' in the password: the userinfo ends at the LAST '@' before the host
    (f"postgresql://u:ab@{SECRET}@host/db", "postgresql://u:***@host/db"),
    (f"postgresql://u:{SECRET}%40x@host/db", "postgresql://u:***@host/db"),  # percent-encoded
    (f"postgresql://u:a/b?{SECRET}@host/db", "postgresql://u:***@host/db"),  # '/' and '?' in it
    (f"postgresql://u@host/db?sslmode=require&sslpassword={SECRET}&application_name=a",
     "postgresql://u@host/db?sslmode=require&sslpassword=***&application_name=a"),
    (f"postgresql:///db?host=/tmp&PASSWORD={SECRET}", "postgresql:///db?host=/tmp&PASSWORD=***"),
    (f"postgresql://u@host/db?pass%77ord={SECRET}", "postgresql://u@host/db?pass%77ord=***"),
    (f"mysql+pymysql://u@h/d?token={SECRET}&api_key={SECRET}&secret={SECRET}&pwd={SECRET}&passwd={SECRET}",
     "mysql+pymysql://u@h/d?token=***&api_key=***&secret=***&pwd=***&passwd=***"),
    ("sqlite:///artifacts/tune/s.db", "sqlite:///artifacts/tune/s.db"),
    ("sqlite:///file::memory:?uri=true", "sqlite:///file::memory:?uri=true"),
    ("x/s.journal", "x/s.journal"),
])
def test_every_secret_of_a_storage_url_is_redacted(url, shown):
    """Before: only `user:password@` was hidden, and an unescaped '@' left the rest of the
    password in view (`***@S3cr3tPW@host`); query parameters were printed as given."""
    from tpumk.tune.storage import redact, scrub

    assert redact(url) == shown
    # a driver's error text quoting the URL: the URL redacted
    assert scrub(f"cannot parse {url!r}", url) == f"cannot parse {shown!r}"


def test_a_drivers_error_text_loses_every_piece_of_the_password():
    """A driver that reads `u:ab@S3cr3tPW@host` takes `S3cr3tPW@host` for the host and says so."""
    from tpumk.tune.storage import scrub

    url = f"postgresql://u:ab@{SECRET}@host/db?sslpassword={SECRET}x%21"
    text = scrub(f'could not translate host name "{SECRET}@host"; sslpassword {SECRET}x!', url)
    assert SECRET not in text and text.startswith('could not translate host name "***@host"')


def _stand_in_worker(self, trial, tuning):
    v = 1e-6 * tuning.ring_depth
    return ({"ok": True, "stage": "done", "value": v, "value_kind": "tpumk model", "source": "stand-in",
             "compile_seconds": 0.1, "lower_seconds": 0.1, "custom_calls": 1, "model_seconds": v,
             "model_source": "stand-in"}, "", 0)


def test_a_postgresql_password_is_never_printed_or_stored(tmp_path, monkeypatch, postgres_url):
    """A study on PostgreSQL with a password in the userinfo and as a query parameter: neither
    reaches the progress line, the JSON summary, the tuned file, `tpumk report`'s line naming
    the storage or an error line. (Before: `?password=` was printed in `study ... in ...`, stored in the JSON `storage`
    field and the tuned TOML's header.)"""
    from click.testing import CliRunner

    from tpumk.cli import main
    from tpumk.tune.trial import TrialRunner

    monkeypatch.setattr(TrialRunner, "_run_worker", _stand_in_worker)
    monkeypatch.chdir(tmp_path)
    # the server trusts loopback: the passwords are sent and ignored
    host = postgres_url.removeprefix("postgresql://postgres@")
    url = f"postgresql://postgres:{SECRET}%40x@{host}?password={SECRET}&sslmode=disable"
    run = lambda *a: CliRunner().invoke(main, [str(x) for x in a])  # noqa: E731
    r = run("tune", "--model", "tiny-dense", "--target", "tpu7x", "--space", TINY_SPACE, "--objective", "model",
            "--trials", 1, "--storage", url, "--study", "secret", "--out", tmp_path / "t.toml", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["storage"] == f"postgresql://postgres:***@{host}?password=***&sslmode=disable"
    rr = run("report", "--storage", url, "--study", "nosuch", "--out", tmp_path / "plots")  # names the storage
    assert rr.exit_code == 1 and "no such study in postgresql://postgres:***@" in rr.stderr, rr.output
    # refused or failing: a malformed URL, no server on the port, an unescaped '@'
    bad = [run("report", "--storage", u, "--out", tmp_path / "p2") for u in (
        url.replace(host.split("/")[0], "127.0.0.1:notaport"), url.replace(host.split("/")[0], "127.0.0.1:1"),
        url.replace("%40", "@"))]
    assert [b.exit_code for b in bad] == [1, 1, 1] and "%40" in bad[2].stderr
    shown = [r.stdout, r.stderr, rr.stdout, rr.stderr, (tmp_path / "t.toml").read_text(),
             *[b.stderr for b in bad]]
    assert not [s for s in shown if SECRET in s], shown
