"""Where a study lives: storage URLs, opening an Optuna storage with heartbeats, stale trials.

- default: `sqlite:///artifacts/tune/<study>.db` (one file per study, under the working directory;
  for one process: SQLite cannot lock a trial for update, so several processes should share a
  journal file or PostgreSQL);
- `PATH.journal` or `journal:PATH`: a JournalStorage file, for several processes on one machine
  (its append lock is an flock on `PATH.journal.flock`, released by the kernel when a holder
  dies, so a killed run leaves no stale lock; a file that is not a readable journal is a
  one-line error naming it);
- any Optuna RDB URL, e.g. `postgresql://user:pw@host/db` for workers on many machines.

Trials send Optuna heartbeats (RDBStorage's own; JournalStorage gets the same through
`JournalHeartbeatStorage`), so a killed run's RUNNING trials become FAIL after a grace period
(`fail_stale`) and stop counting. A heartbeat that cannot be written (a full disk, a database
that went away) is skipped quietly: it runs in Optuna's own thread, whose error would be a
traceback, and the trial's next write meets the same failure and stops the study in one line
(tpumk.tune.study.why_stopped).
"""

from __future__ import annotations

import functools
import os
import re
import stat
import sys
import threading
import time
import warnings
from pathlib import Path

from tpumk.errors import ConfigError, one_line
from tpumk.files import kind_of

DEFAULT_ROOT = Path("artifacts") / "tune"
DEFAULT_HEARTBEAT = 5  # seconds between trial heartbeats
GRACE_FACTOR = 3  # a RUNNING trial whose heartbeat is this many intervals old is stale
SCHEMA_RACE_ATTEMPTS = 5  # opens of a new RDB whose schema another process is creating meanwhile


@functools.lru_cache(maxsize=None)
def _journal_heartbeat_class():
    from optuna.storages import JournalStorage
    from optuna.trial import TrialState

    from tpumk.compat import optuna_heartbeat_base

    BaseHeartbeat = optuna_heartbeat_base()

    class JournalHeartbeatStorage(JournalStorage, BaseHeartbeat):
        """A JournalStorage with Optuna's heartbeat protocol (RDBStorage has its own): the
        heartbeat is a trial system attr, so `study.optimize` records it and
        `fail_stale_trials` fails trials of a killed process, as with RDBStorage. Heartbeats
        compare wall clocks of the processes sharing the file, i.e. of one machine."""

        HEARTBEAT = "tpumk:heartbeat"

        def __init__(self, backend, heartbeat_interval: int, grace_period: int) -> None:
            super().__init__(backend)
            self.heartbeat_interval = heartbeat_interval
            self.grace_period = grace_period

        def record_heartbeat(self, trial_id: int) -> None:
            import optuna

            try:
                self.set_trial_system_attr(trial_id, self.HEARTBEAT, time.time())
            except optuna.exceptions.UpdateFinishedTrialError:
                pass  # failed as stale meanwhile (a paused process): nothing left to keep alive
            except Exception:  # noqa: BLE001 - a storage that cannot be written: see the module docstring
                pass

        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            now = time.time()
            stale = []
            for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
                beat = t.system_attrs.get(self.HEARTBEAT)
                if beat is None and t.datetime_start is not None:
                    beat = t.datetime_start.timestamp()
                if beat is not None and now - beat > self.grace_period:
                    stale.append(t._trial_id)
            return stale

        def get_heartbeat_interval(self) -> int | None:
            return self.heartbeat_interval

        def get_heartbeat_stale_trial_callback(self):
            return None

    return JournalHeartbeatStorage


@functools.lru_cache(maxsize=None)
def _flock_lock_class():
    import fcntl

    try:
        from optuna.storages.journal import BaseJournalFileLock
    except ImportError:  # optuna 4/5 export the lock classes but not their base
        from optuna.storages.journal._file import BaseJournalFileLock

    class JournalFileFlock(BaseJournalFileLock):
        """The journal's append lock as an flock(2) on `FILE.journal.flock`, for processes on
        one machine (what a journal file is for). Optuna's own locks (JournalFileSymlinkLock,
        the default, and JournalFileOpenLock) are a file that exists while held: a process
        killed while holding it leaves it behind, and every later process waits out the lock's
        grace period (30 s) before breaking it, and may break a live holder's lock that merely
        held it long. The kernel releases an flock when its holder dies, so a killed run never
        delays the next, and a live holder is never broken. Each acquire opens its own file
        description, so threads of one process exclude each other too."""

        def __init__(self, journal_path: str) -> None:
            self.path = journal_path + ".flock"
            self._local = threading.local()

        def acquire(self) -> bool:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            self._local.fd = fd
            return True

        def release(self) -> None:
            fd = getattr(self._local, "fd", None)
            if fd is None:
                return
            self._local.fd = None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    return JournalFileFlock


@functools.lru_cache(maxsize=None)
def _rdb_storage_class():
    """RDBStorage whose stale trials include a RUNNING trial with no heartbeat at all, once it
    started a grace period ago. Optuna's RDB skips those, but a run killed between creating a
    trial and its heartbeat thread's first beat leaves exactly one: RUNNING for ever, so a resumed
    run counting it ahead of its own trials waited for it without end (seen in CI: the resumed
    `tpumk tune` of tests/test_tune.py stopped at [2/3 evaluated]). A live trial beats within
    moments of starting (tpumk's trials record a beat before anything else), so one still silent
    after the grace period is dead. JournalStorage already counts from the start time."""
    import optuna

    class HeartbeatRDBStorage(optuna.storages.RDBStorage):
        def record_heartbeat(self, trial_id: int) -> None:
            try:
                super().record_heartbeat(trial_id)
            except Exception:  # noqa: BLE001 - a storage that cannot be written: see the module docstring
                pass

        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            import datetime

            from optuna.storages._rdb import models  # the heartbeat table: no public reader

            stale = set(super()._get_stale_trial_ids(study_id))
            with self.scoped_session() as session:
                beating = {r[0] for r in session.query(models.TrialHeartbeatModel.trial_id)}
            now = datetime.datetime.now()  # Optuna stamps datetime_start with the local clock
            for t in self.get_all_trials(study_id, deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
                if (t._trial_id not in beating and t.datetime_start is not None
                        and (now - t.datetime_start).total_seconds() > self.grace_period):
                    stale.add(t._trial_id)
            return sorted(stale)

    return HeartbeatRDBStorage


@functools.lru_cache(maxsize=None)
def _sqlite_storage_class():
    class SQLiteStorage(_rdb_storage_class()):
        """RDBStorage on SQLite, with trial state changes serialised in this process. SQLite has
        no SELECT ... FOR UPDATE, so two worker threads could both take the same WAITING
        (enqueued) trial; under the lock the second sees it RUNNING and takes another. Several
        processes should share a journal file or PostgreSQL instead, which lock properly."""

        _state_lock = threading.Lock()

        def set_trial_state_values(self, trial_id, state, values=None):
            with self._state_lock:
                return super().set_trial_state_values(trial_id, state, values)

    return SQLiteStorage


# Query parameters whose value is a secret: password, passwd, sslpassword, pwd, secret, token,
# api_key, sslkey, credentials... (named like one: hiding a file path named so costs nothing).
_SECRET_PARAM = re.compile(r"pass|pwd|secret|token|key|credential|auth", re.IGNORECASE)


def _split_userinfo(rest: str) -> tuple[str, str] | None:
    """(userinfo, the rest after it) of what follows `scheme://`, split at the LAST '@': a
    password may hold an unescaped '@' (or '/', '?', ':'), and hiding too much is safe where
    hiding too little is not. None when there is no userinfo (`sqlite:///path`: no authority)."""
    if rest.startswith("/") or "@" not in rest:
        return None
    userinfo, _, after = rest.rpartition("@")
    return userinfo, after


def _secret_params(query: str) -> list[tuple[str, str]]:
    """(name, value) of the query parameters named like a secret."""
    from urllib.parse import unquote_plus

    out = []
    for part in re.split(r"[&;]", query):
        name, eq, value = part.partition("=")
        if eq and _SECRET_PARAM.search(unquote_plus(name)):
            out.append((name, value))
    return out


def redact(url: str) -> str:
    """A storage URL fit to print or store (progress lines, JSON, the tuned file, errors): the
    userinfo's password (everything between the user's ':' and the last '@') and the value of
    every query parameter named like a secret (`?password=`, `sslpassword`, `token`, ...)
    become `***`; the rest is kept as typed (never re-encoded). A path (a journal, FILE.db) is
    returned as it is."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    split = _split_userinfo(rest)
    if split is not None:
        userinfo, after = split
        user, colon, _ = userinfo.partition(":")
        rest = f"{user}{':***' if colon else ''}@{after}"
    head, q, query = rest.partition("?")
    if q:
        query, h, fragment = query.partition("#")
        secret = {name for name, _ in _secret_params(query)}
        parts = re.split(r"([&;])", query)
        query = "".join(f"{p.partition('=')[0]}=***" if p.partition("=")[0] in secret and "=" in p else p
                        for p in parts)
        rest = f"{head}?{query}{h}{fragment}"
    return scheme + sep + rest


def secrets_of(url: str) -> list[str]:
    """The secrets a storage URL holds (as typed and percent-decoded, and each '@'-separated
    piece of a password: a driver that misreads an unescaped '@' shows the rest as the host),
    longest first: what `scrub` removes from a driver's error text."""
    from urllib.parse import unquote, unquote_plus

    scheme, sep, rest = url.partition("://")
    if not sep:
        return []
    found: list[str] = []
    split = _split_userinfo(rest)
    if split is not None:
        password = split[0].partition(":")[2]
        if password:
            found += [password, unquote(password), *password.split("@")]
        rest = split[1]
    query = rest.partition("?")[2].partition("#")[0]
    for _, value in _secret_params(query):
        found += [value, unquote_plus(value)]
    return sorted({s for s in found if s}, key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """`text` (a driver's or Optuna's error message about `url`) with the URL shown redacted and
    every secret of the URL replaced by `***`."""
    text = text.replace(url, redact(url))
    for secret in secrets_of(url):
        text = text.replace(secret, "***")
    return text


MAX_STUDY_NAME = 200  # characters: the name plus ".toml" stays a legal file name (255 bytes)
_NAME_PUNCTUATION = frozenset("._-+=@,: ")


def check_study_name(name: str, option: str = "--study") -> str:
    """A study name becomes file names (`artifacts/tune/<study>.db`, `<study>.toml`): refuse
    one that is not a plain file name, one line naming the option. Letters, digits and
    `. _ - + = @ , :` or spaces, not starting with a dot or a space, at most 200 characters:
    never a path separator, `.` or `..` (or a hidden file), a NUL or control character, or URL
    syntax (`? # %`)."""
    bad = sorted({c for c in name if not (c.isalnum() or c in _NAME_PUNCTUATION)})
    if not name or name.strip() != name or name.startswith(".") or bad or len(name) > MAX_STUDY_NAME:
        why = ("is empty" if not name else
               f"contains {', '.join(repr(c) for c in bad[:5])}" if bad else
               f"is longer than {MAX_STUDY_NAME} characters" if len(name) > MAX_STUDY_NAME else
               "starts with a dot" if name.startswith(".") else
               "starts or ends with a space")
        shown = name if len(name) <= 80 else name[:80] + "..."
        raise ConfigError(f"{option} {shown!r}: not a usable study name ({why}); a study name is a file name "
                          f"under {DEFAULT_ROOT}: letters, digits and . _ - + = @ , : or spaces, "
                          f"not starting with a dot")
    return name


def storage_url(storage: str | None, study_name: str, root: Path = DEFAULT_ROOT) -> str:
    """The storage a study uses: the --storage value normalised, or the default SQLite file
    (named after the study, which must then be a safe file name: `check_study_name`)."""
    if storage is None or storage == "":
        check_study_name(study_name, "study name")
        return f"sqlite:///{root / (study_name + '.db')}"
    if storage.startswith("journal:") or ("://" not in storage and storage.endswith(".journal")):
        return storage
    if "://" in storage:
        return storage
    if storage.endswith((".db", ".sqlite", ".sqlite3")):
        return f"sqlite:///{storage}"
    raise ConfigError(f"--storage {_quoted(storage)}: expected an Optuna storage URL (sqlite:///FILE.db, "
                      "postgresql://user:pw@host/db), a FILE.journal or journal:FILE, or a FILE.db")


def _quoted(storage: str) -> str:
    """A --storage value for an error line: quoted, its secrets redacted (a URL missing its
    scheme, `user:pw@host/db`, is redacted as if it had one)."""
    if "://" not in storage and "@" in storage:
        return repr(redact("x://" + storage).removeprefix("x://"))
    return repr(redact(storage))


def sqlite_path(url: str) -> Path | None:
    """The database file of a `sqlite:///FILE` URL (None for other URLs and in-memory SQLite:
    `sqlite://`, `sqlite:///:memory:`, and with `?uri=true` a `file::memory:` or
    `file:NAME?mode=memory` URI filename, which SQLite opens in memory)."""
    from urllib.parse import parse_qs, unquote

    if url.split("://", 1)[0].split("+", 1)[0] != "sqlite" or ":///" not in url:
        return None
    db, _, query = url.split(":///", 1)[1].partition("?")
    params = {k.lower(): v[-1].lower() for k, v in parse_qs(query).items()}
    if params.get("uri") in ("true", "1") and db.startswith("file:"):
        # SQLite's URI filename (https://sqlite.org/uri.html): file:PATH, file:///PATH, file://localhost/PATH
        db = db.removeprefix("file:")
        if db.startswith("//"):
            db = "/" + db[2:].partition("/")[2]
        db = unquote(db)
        if params.get("mode") == "memory":
            return None
    return Path(db) if db and db != ":memory:" else None


def local_path(url: str) -> Path | None:
    """The file a storage URL from `storage_url` keeps its study in on this machine (a SQLite
    database or a journal), or None (a database server, in-memory SQLite)."""
    if url.startswith("journal:") or ("://" not in url and url.endswith(".journal")):
        path = Path(url.removeprefix("journal:"))
        return path if path.name else None
    return sqlite_path(url)


def not_regular(path: Path) -> str | None:
    """What `path` is when it exists and is not a regular file ("a FIFO (named pipe)", "a
    character device", "a directory", ...), else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else kind_of(mode)


def open_storage(url: str, heartbeat: int = DEFAULT_HEARTBEAT):
    """An Optuna storage with heartbeats on, for a URL from `storage_url`."""
    import optuna

    grace = GRACE_FACTOR * heartbeat
    if url.startswith("journal:") or ("://" not in url and url.endswith(".journal")):
        path = Path(url.removeprefix("journal:"))
        if not path.name:
            raise ConfigError(f"--storage {url!r}: expected journal:FILE")
        kind = not_regular(path)
        if kind:
            raise ConfigError(f"--storage {url}: {path} is {kind}, not a regular file (a journal is one)")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--storage {url}: cannot create {path.parent}: {e.strerror or e}") from None
        from optuna.storages.journal import JournalFileBackend

        lock = _flock_lock_class()(str(path))
        for salvage in (False, True):
            repaired = repair_journal(path, lock, salvage)
            if repaired:
                print(f"tpumk: {repaired}", file=sys.stderr, flush=True)
            try:
                backend = JournalFileBackend(str(path), lock_obj=lock)
                # Reading the journal replays every log line; a corrupt file fails here.
                return _journal_heartbeat_class()(backend, heartbeat, grace)
            except Exception as e:  # noqa: BLE001 - a damaged or foreign file: one line naming it
                if not salvage and isinstance(e, ValueError):  # a record an old tpumk appended onto a torn line
                    continue
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ConfigError(f"--storage {url}: {path} is not a readable Optuna journal "
                                  f"({type(e).__name__}: {first[:200]}); move it aside or give another "
                                  "--storage") from None
    scheme = url.split("://", 1)[0].split("+", 1)[0]
    db = sqlite_path(url)
    if scheme == "sqlite" and db is None:
        raise ConfigError(f"--storage {redact(url)}: an in-memory SQLite database cannot hold a study: it is gone "
                          "when tpumk exits (nothing to resume) and every connection gets its own empty one "
                          "(nothing shared); give a file, e.g. sqlite:///study.db")
    if db is not None:
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a parent that is a regular file, no permission
            raise ConfigError(f"--storage {redact(url)}: cannot create {db.parent}: {e.strerror or e}") from None
        check_sqlite(url, db)
    given = url
    shown = redact(url)  # as given (before the driver is named), secrets hidden
    if scheme in ("postgresql", "postgres"):
        if "+" not in url.split("://", 1)[0]:
            # SQLAlchemy 2.1 defaults to the psycopg 3 driver; tpumk depends on psycopg2-binary.
            url = "postgresql+psycopg2://" + url.split("://", 1)[1]
        if url.startswith("postgresql+psycopg2://"):
            import importlib.util

            if importlib.util.find_spec("psycopg2") is None:
                raise ConfigError(f"--storage {shown}: PostgreSQL needs psycopg2 (pip install psycopg2-binary)")
    if scheme != "sqlite" and "@" in (_host(url) or ""):
        raise ConfigError(f"--storage {shown}: the password (or user name) holds an unescaped '@', so the "
                          "database driver would take the rest of it for the host; write each '@' in it as %40")
    cls = _sqlite_storage_class() if scheme == "sqlite" else _rdb_storage_class()
    for attempt in range(SCHEMA_RACE_ATTEMPTS):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return cls(url, heartbeat_interval=heartbeat, grace_period=grace)
        except Exception as e:  # bad URL, server down, wrong password, unknown dialect
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            # Two processes opening a new database at once both create Optuna's schema; the
            # loser sees the winner's tables or alembic_version row. It exists then: open again.
            raced = "alembic_version" in first or "already exists" in first
            if raced and attempt + 1 < SCHEMA_RACE_ATTEMPTS:
                time.sleep(0.2 * (attempt + 1))
                continue
            raise ConfigError(f"--storage {shown}: cannot open: {scrub(scrub(first, url), given)[:300]}") from None


def _host(url: str) -> str | None:
    """The host SQLAlchemy reads from `url` (None when it cannot parse it: opening says why)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).host
    except Exception:  # noqa: BLE001 - any parse failure: the open reports it
        return None


def check_sqlite(url: str, db: Path) -> None:
    """Refuse, in one line that says how to recover, a SQLite file that is not a sound database
    (not SQLite at all, or pages damaged by a crash, a full disk or a partial copy), before
    Optuna opens it: a damaged page would otherwise surface as a traceback mid-study."""
    import sqlite3

    try:
        st = os.stat(db)
    except FileNotFoundError:
        return  # a new study: Optuna creates it
    except OSError as e:
        raise ConfigError(f"--storage {redact(url)}: cannot open {db}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"--storage {redact(url)}: {db} is {kind_of(st.st_mode)}, not a regular file (a SQLite "
                          "database is one)")
    if st.st_size == 0:
        return  # created empty (a killed first open): SQLite treats it as a new database
    recover = (f"restore it from a backup, or move it aside to start a new study (`sqlite3 {db} .recover "
               f"| sqlite3 recovered.db` may salvage its trials; then give --storage sqlite:///recovered.db)")
    why = None
    try:
        con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
        try:
            rows = con.execute("PRAGMA quick_check").fetchall()
        finally:
            con.close()
        if rows != [("ok",)]:
            why = f"damaged ({' '.join(str(rows[0][0]).split())[:120]})" if rows else "damaged"
    except sqlite3.DatabaseError as e:  # "file is not a database", "database disk image is malformed"
        why = one_line(e)[:120]
    except sqlite3.Error as e:  # locked for longer than the timeout, cannot open
        raise ConfigError(f"--storage {redact(url)}: cannot open {db}: {one_line(e)[:200]}") from None
    if why:
        raise ConfigError(f"--storage {redact(url)}: {db} is not a sound SQLite database ({why}); {recover}")


def repair_journal(path: Path, lock, salvage: bool = False) -> str | None:
    """Repair a journal a crash (or a full disk) left torn, under the journal's lock; returns
    what was done, or None when the file is whole.

    A torn tail (the last record cut short: no newline at the end) is truncated away: Optuna
    would append the next record onto it and every later read would fail. With `salvage`, a
    file already damaged that way (a line that is a partial record with a complete one appended,
    written by an older tpumk) has each bad line replaced by the complete record it ends with,
    and the file is replaced atomically. Every complete record is kept; a line that holds none is
    left, and opening the journal then fails in one line."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        return None
    except OSError:
        return None  # no permission, a FIFO with no reader...: opening the journal says why
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or os.pread(fd, len(_RECORD_START), 0) != _RECORD_START:
            return None  # empty, or not an Optuna journal: never touched (opening it says why)
        lock.acquire()
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return None
            if salvage:
                return _salvage_journal(path, fd)
            tail_len = min(size, 1 << 16)
            while True:  # the last newline: scan back from the end
                tail = os.pread(fd, tail_len, size - tail_len)
                if tail.endswith(b"\n"):
                    return None
                cut = tail.rfind(b"\n")
                if cut >= 0 or tail_len == size:
                    keep = size - tail_len + cut + 1
                    break
                tail_len = min(size, tail_len * 4)
            if not _whole_record(fd, keep):
                return None  # what precedes the tail is not a complete record: not a torn journal
            os.ftruncate(fd, keep)
            os.fsync(fd)
            return (f"repaired the tuning journal {path}: dropped a partial last record ({size - keep} bytes, "
                    "what a crash or a full disk leaves mid-write); every complete record is kept")
        finally:
            lock.release()
    finally:
        os.close(fd)


_RECORD_START = b'{"op_code":'  # how Optuna's JournalStorage writes each record (compact JSON)


def _whole_record(fd: int, keep: int) -> bool:
    """The last line of the first `keep` bytes (ending in a newline) is a complete journal record
    (a record over 1 MiB counts as not: no repair), or nothing is kept (one torn record)."""
    if keep == 0:
        return True
    n = min(keep, 1 << 20)
    line = os.pread(fd, n, keep - n)[:-1].rsplit(b"\n", 1)[-1]
    return line.startswith(_RECORD_START) and _parses(line)


def _parses(line: bytes) -> bool:
    import json

    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _salvage_journal(path: Path, fd: int) -> str | None:
    import json

    with open(fd, "rb", closefd=False) as f:
        f.seek(0)
        lines = f.read().split(b"\n")
    tail = lines.pop()  # b"" after a final newline; else a torn record
    out, fixed = [], 0
    for ln in lines:
        if ln.startswith(_RECORD_START) and _parses(ln):
            out.append(ln)
            continue
        start = ln.rfind(_RECORD_START)
        while start > 0:
            try:
                json.loads(ln[start:])
                break
            except ValueError:
                start = ln.rfind(_RECORD_START, 0, start)
        if start <= 0:
            return None  # not the damage a torn append leaves: let the open say the file is unreadable
        out.append(ln[start:])
        fixed += 1
    if not fixed and not tail:
        return None
    text = b"".join(ln + b"\n" for ln in out)
    tmp = path.with_name(f".{path.name}.repair-{os.getpid()}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, stat.S_IMODE(os.fstat(fd).st_mode))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        return None
    return (f"repaired the tuning journal {path}: dropped {fixed + bool(tail)} partial record(s) a crash or a "
            f"full disk left mid-write; kept every complete record ({len(out)})")


def fail_stale(study) -> None:
    """Fail the RUNNING trials whose heartbeat is older than the grace period (a killed run's)."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
