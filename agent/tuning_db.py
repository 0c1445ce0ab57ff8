"""The tuning database: every measured candidate of every run, kept across runs in one SQLite file a user keeps
(`--db PATH`, default ~/.cache/hgemm-agent/tuning.sqlite or $HGEMM_AGENT_TUNING_DB), so that a new run starts from
everything measured before on the same GPU model.

One row per candidate per run: the device, the problem, the family and its parameters, the outcome (status, warm
and cold times, cuBLAS's times in the same process, the median speed-up over the run's measurements). The run store
forwards each result to a `TuningRecorder` as it is recorded; `import_run` copies a finished run store in.
"""

from __future__ import annotations

import json
import os
import sqlite3
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from core.device import DeviceFacts
from core.records import Candidate, EvalResult, Problem, Status, Timing

ENV_PATH = "HGEMM_AGENT_TUNING_DB"
MARKER = "hgemm-agent tuning db v1"
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS measured (
    run_id TEXT NOT NULL, candidate_id TEXT NOT NULL, created REAL,
    device TEXT NOT NULL, sms INT, arch TEXT,
    m INT, n INT, k INT, b_layout TEXT, dtype TEXT, bias INT,
    family TEXT, origin TEXT, params TEXT, edited INT,
    status TEXT, reason TEXT, warm_us REAL, cold_us REAL, cublas_warm_us REAL, cublas_cold_us REAL,
    speedup REAL, measurements INT, epilogue TEXT DEFAULT 'none',
    PRIMARY KEY (run_id, candidate_id));
CREATE INDEX IF NOT EXISTS measured_device ON measured (device);
"""
# one problem, as a column expression
PROBLEM_SQL = "m || '_' || n || '_' || k || b_layout || dtype || bias || epilogue"


class TuningDbError(ValueError):
    """The file cannot be opened as a tuning database (not SQLite, another tool's file, no permission)."""


def default_path() -> Path:
    return Path(os.environ.get(ENV_PATH) or Path.home() / ".cache" / "hgemm-agent" / "tuning.sqlite")


@dataclass(frozen=True)
class TuningRow:
    """One measured candidate, as the cost model sees it."""

    device: str
    sms: int
    problem: Problem
    family: str
    params: dict
    edited: bool  # an edited template (from an LLM): its parameters do not describe the kernel
    status: Status
    speedup: float | None  # median t_cuBLAS / t over the run's measurements; None where it failed
    run_id: str = ""


class TuningDB:
    def __init__(self, path: Path):
        self.path = Path(path).expanduser()
        self.lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # results may be recorded from the loop's worker threads: one connection, writes under a lock
            self.db = sqlite3.connect(self.path, isolation_level=None, timeout=10.0, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")  # several runs may write at once
            self.db.execute("PRAGMA synchronous=NORMAL")  # as the run store: safe from a crash, not a power loss
            self.db.executescript(SCHEMA)
            row = self.db.execute("SELECT value FROM meta WHERE key = 'marker'").fetchone()
            if row is None:
                self.db.execute("INSERT INTO meta VALUES ('marker', ?)", (MARKER,))
            elif row[0] != MARKER:
                raise TuningDbError(f"{self.path} is not a tuning database of this tool")
            if "epilogue" not in {r[1] for r in self.db.execute("PRAGMA table_info(measured)")}:
                self.db.execute("ALTER TABLE measured ADD COLUMN epilogue TEXT DEFAULT 'none'")
        except (sqlite3.Error, OSError) as e:
            raise TuningDbError(f"cannot open the tuning database {self.path}: {e}") from None

    def close(self) -> None:
        self.db.close()

    def record(self, run_id: str, device: DeviceFacts, arch: str, c: Candidate, r: EvalResult,
               speedups: list[float]) -> None:
        """Insert or update the candidate's row for this run (a re-measurement updates the median speed-up; a
        later failure replaces the outcome). Compile-only results are not measurements and are not kept."""
        if r.status is Status.SKIPPED:
            return
        p = c.problem
        ok = r.status is Status.OK
        speedup = statistics.median(speedups) if ok and speedups else r.speedup if ok else None
        with self.lock:
            self.db.execute(
                "INSERT OR REPLACE INTO measured VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (run_id, c.id, time.time(), device.name, device.sms, arch, p.m, p.n, p.k, p.b_layout, p.dtype,
                 int(p.bias), c.family, c.origin, json.dumps(c.params, sort_keys=True),
                 int(c.template_override is not None), r.status.value, r.reason[:300], _us(r.warm), _us(r.cold),
                 _us(r.cublas_warm), _us(r.cublas_cold), speedup, len(speedups), p.epilogue))

    def rows(self, device: str | None = None) -> list[TuningRow]:
        q = ("SELECT device, sms, m, n, k, b_layout, dtype, bias, epilogue, family, params, edited, status, speedup, "
             "run_id FROM measured" + (" WHERE device = ?" if device else "") + " ORDER BY created")
        with self.lock:  # a run reads (its cost model retrains) while it records
            found = self.db.execute(q, (device,) if device else ()).fetchall()
        out = []
        for d, sms, m, n, k, layout, dtype, bias, epi, family, params, edited, status, speedup, run in found:
            out.append(TuningRow(d, sms, Problem(m, n, k, layout, dtype, bool(bias), epi), family, json.loads(params),
                                 bool(edited), Status(status), speedup, run))
        return out

    def problem_count(self, device: str) -> int:
        """Distinct problems measured on this GPU model."""
        with self.lock:
            return self.db.execute(f"SELECT COUNT(DISTINCT {PROBLEM_SQL}) FROM measured WHERE device = ?",
                                   (device,)).fetchone()[0]

    def summary(self) -> list[tuple[str, str, int, int, int]]:
        """(device, family, rows, passed, distinct problems) per device and family."""
        return self.db.execute(
            f"SELECT device, family, COUNT(*), SUM(status = 'ok'), COUNT(DISTINCT {PROBLEM_SQL}) FROM measured "
            "GROUP BY device, family ORDER BY device, family").fetchall()

    def import_run(self, store) -> int:
        """Copy a run store's results in (agent.store.RunStore); returns the rows written. Runs that never ran on
        a GPU (compile only, or from before devices were recorded) have nothing to give."""
        facts = store.get_meta("device")
        if not facts:
            raise TuningDbError(f"run {store.run_id} recorded no GPU (compile only, or an older run): nothing to "
                                "import")
        device, arch, written = DeviceFacts.from_dict(facts), store.get_meta("arch") or "", 0
        for problem in store.problems():
            for c, r in store.results(problem):
                if r.status is not Status.SKIPPED:
                    self.record(store.run_id, device, arch, c, r, store.speedups(c.id))
                    written += 1
        return written


def _us(timing: Timing | None) -> float | None:
    return timing.median_us if timing else None


class TuningRecorder:
    """What the run store calls with each recorded result: writes it to the tuning database. A write that fails
    (disk full, the file locked too long) switches the recorder off and is reported once through `on_error`; the
    run goes on."""

    def __init__(self, db: TuningDB, run_id: str, device: DeviceFacts, arch: str,
                 on_error: Callable[[str], None]):
        self.db, self.run_id, self.device, self.arch, self.on_error = db, run_id, device, arch, on_error
        self.failed = False

    def __call__(self, c: Candidate, r: EvalResult, speedups: list[float]) -> None:
        if self.failed:
            return
        try:
            self.db.record(self.run_id, self.device, self.arch, c, r, speedups)
        except sqlite3.Error as e:
            self.failed = True
            self.on_error(f"tuning database {self.db.path}: {e}; this run's results are no longer kept there")
