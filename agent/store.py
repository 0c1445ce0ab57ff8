"""The run store: one SQLite file per run under runs/<run-id>/run.sqlite, no server.

Every record is committed as soon as it exists (WAL journal), so a crash or Ctrl-C loses at most the candidate in
flight, and `--resume` continues from what is there. Commits are not flushed to the disk one by one (synchronous
NORMAL): a process that dies loses nothing committed; only a power loss may lose the last few.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from core.records import BuildResult, Candidate, EvalResult, ModelCall, Patch, Problem, ProfileResult, Status

MARKER = "hgemm-agent run store v1"
DB_NAME = "run.sqlite"
DEFAULT_RUNS_DIR = "runs"  # where runs live unless --runs-dir says otherwise

WINNERS_TABLE = "CREATE TABLE IF NOT EXISTS winners (problem_key TEXT PRIMARY KEY, candidate_id TEXT);"
MODEL_CALLS_TABLE = """CREATE TABLE IF NOT EXISTS model_calls (seq INTEGER PRIMARY KEY, problem_key TEXT, ts REAL,
    record TEXT);"""
BUCKET_ENDS_TABLE = """CREATE TABLE IF NOT EXISTS bucket_ends (seq INTEGER PRIMARY KEY, problem_key TEXT,
    candidate_id TEXT, m INT, record TEXT);"""
PROFILES_TABLE = """CREATE TABLE IF NOT EXISTS profiles (candidate_id TEXT PRIMARY KEY, ok INT, metrics TEXT,
    summary TEXT, error TEXT);"""
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS problems (key TEXT PRIMARY KEY, m INT, n INT, k INT, b_layout TEXT, dtype TEXT,
                                     position INT, bias INT DEFAULT 0, epilogue TEXT DEFAULT 'none', m_lo INT,
                                     m_hi INT);
CREATE TABLE IF NOT EXISTS candidates (id TEXT PRIMARY KEY, seq INTEGER, problem_key TEXT, family TEXT,
    params TEXT, origin TEXT, rationale TEXT, template_override TEXT, created REAL, patch TEXT);
CREATE TABLE IF NOT EXISTS builds (candidate_id TEXT PRIMARY KEY, arch TEXT, ok INT, source TEXT, cubin BLOB,
    log TEXT, registers INT, smem_static INT, spill_bytes INT, stack_bytes INT, compile_s REAL, cached INT,
    error TEXT);
CREATE TABLE IF NOT EXISTS results (candidate_id TEXT PRIMARY KEY, status TEXT, time_us REAL, speedup REAL,
    record TEXT, created REAL);
CREATE TABLE IF NOT EXISTS measurements (candidate_id TEXT, time_us REAL, cublas_us REAL, speedup REAL,
    created REAL, honest INT DEFAULT 0, wall_s REAL);
CREATE TABLE IF NOT EXISTS events (ts REAL, kind TEXT, message TEXT);
""" + PROFILES_TABLE + WINNERS_TABLE + MODEL_CALLS_TABLE + BUCKET_ENDS_TABLE


@dataclass(frozen=True)
class Winner:
    """A shape's leader: a candidate that passed every check, its latest result, and its median speed-up over
    cuBLAS across all its measurements (> 1 means faster than cuBLAS)."""

    candidate: Candidate
    result: EvalResult
    speedup: float


class StoreError(ValueError):
    """A run id that does not exist, or a folder that is not one of our runs."""


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


# Called with a candidate, its latest result and its speed-ups so far whenever a result or measurement is recorded
# (the tuning database's recorder).
Listener = Callable[[Candidate, EvalResult, list[float]], None]


class RunStore:
    def __init__(self, folder: Path, *, create: bool = False):
        self.folder = Path(folder)
        self.listeners: list[Listener] = []
        db = self.folder / DB_NAME
        if create:
            try:
                self.folder.mkdir(parents=True, exist_ok=False)
            except OSError as e:
                raise StoreError(f"cannot create the run folder {self.folder} ({e.strerror or e})") from None
        elif not self.folder.is_dir():
            raise StoreError(f"no run {self.folder.name!r} in {self.folder.parent}")
        elif not db.is_file():
            raise StoreError(f"{self.folder} is not a run folder of this tool (no {DB_NAME})")
        try:
            self.db = sqlite3.connect(db, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            if create:
                self.db.executescript(SCHEMA)
                self.set_meta("marker", MARKER)
            elif self.get_meta("marker") != MARKER:
                raise StoreError(f"{db} is not a run store of this tool")
            else:
                self._upgrade()
        except sqlite3.DatabaseError as e:
            raise StoreError(f"{db} is corrupt or not a run store ({e})") from None

    def _upgrade(self) -> None:
        """Runs from before a table or column existed gain it (nothing else changes)."""
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(problems)")}
        if "bias" not in columns:
            self.db.execute("ALTER TABLE problems ADD COLUMN bias INT DEFAULT 0")
        if "m_lo" not in columns:
            self.db.execute("ALTER TABLE problems ADD COLUMN m_lo INT")
            self.db.execute("ALTER TABLE problems ADD COLUMN m_hi INT")
        if "epilogue" not in columns:
            self.db.execute("ALTER TABLE problems ADD COLUMN epilogue TEXT DEFAULT 'none'")
        measured = {row[1] for row in self.db.execute("PRAGMA table_info(measurements)")}
        if "honest" not in measured:
            self.db.execute("ALTER TABLE measurements ADD COLUMN honest INT DEFAULT 0")
        if "wall_s" not in measured:  # each evaluation's own wall time (a re-measurement's differs from the first)
            self.db.execute("ALTER TABLE measurements ADD COLUMN wall_s REAL")
        if "patch" not in {row[1] for row in self.db.execute("PRAGMA table_info(candidates)")}:
            self.db.execute("ALTER TABLE candidates ADD COLUMN patch TEXT")
        self.db.executescript(PROFILES_TABLE + WINNERS_TABLE + MODEL_CALLS_TABLE + BUCKET_ENDS_TABLE)

    @property
    def run_id(self) -> str:
        return self.folder.name

    @property
    def compile_only(self) -> bool:
        """A run that rendered and compiled its candidates and ran none (nothing checked or timed)."""
        return bool((self.get_meta("config") or {}).get("compile_only"))

    def close(self) -> None:
        self.db.close()

    # meta and problems
    def set_meta(self, key: str, value: Any) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))

    def get_meta(self, key: str, default: Any = None) -> Any:
        try:
            row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        except sqlite3.OperationalError:
            return default
        return json.loads(row[0]) if row else default

    def add_problems(self, problems: list[Problem]) -> None:
        for i, p in enumerate(problems):
            lo, hi = p.m_range or (None, None)
            self.db.execute("INSERT OR IGNORE INTO problems (key, m, n, k, b_layout, dtype, position, bias, epilogue, "
                            "m_lo, m_hi) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (p.key, p.m, p.n, p.k, p.b_layout, p.dtype, i, int(p.bias), p.epilogue, lo, hi))

    def problems(self) -> list[Problem]:
        rows = self.db.execute("SELECT m, n, k, b_layout, dtype, bias, epilogue, m_lo, m_hi FROM problems "
                               "ORDER BY position").fetchall()
        return [_problem(*r) for r in rows]

    # candidates and their records
    def add_candidate(self, c: Candidate) -> None:
        seq = self.db.execute("SELECT COUNT(*) FROM candidates").fetchone()[0]
        self.db.execute("INSERT OR IGNORE INTO candidates (id, seq, problem_key, family, params, origin, rationale, "
                        "template_override, created, patch) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (c.id, seq, c.problem.key, c.family, json.dumps(c.params, sort_keys=True), c.origin,
                         c.rationale, c.template_override, time.time(), c.patch.to_json() if c.patch else None))

    def add_build(self, b: BuildResult) -> None:
        d = asdict(b)
        self.db.execute("INSERT OR REPLACE INTO builds VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (d["candidate_id"], d["arch"], int(d["ok"]), d["source"], d["cubin"], d["log"],
                         d["registers"], d["smem_static"], d["spill_bytes"], d["stack_bytes"], d["compile_s"],
                         int(d["cached"]), d["error"]))

    def add_result(self, r: EvalResult) -> None:
        self.db.execute("INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?, ?, ?)",
                        (r.candidate_id, r.status.value, r.time_us if r.status is Status.OK else None,
                         r.speedup, r.to_json(), time.time()))
        self._notify(r.candidate_id)

    def add_measurement(self, r: EvalResult) -> None:
        self.db.execute("INSERT INTO measurements VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (r.candidate_id, r.time_us, r.ranked[1].median_us, r.speedup, time.time(),
                         int(r.honest is not None), r.wall_s))
        self._notify(r.candidate_id)

    def _notify(self, cid: str) -> None:
        if self.listeners:
            c, r, speedups = self.candidate(cid), self.result(cid), self.speedups(cid)
            for listener in self.listeners:
                listener(c, r, speedups)

    def speedups(self, cid: str) -> list[float]:
        """A candidate's speed-ups over cuBLAS: its honest measurements where it has any (re-measurements, past the
        first screen), else every measurement."""
        rows = self.db.execute("SELECT speedup, honest FROM measurements WHERE candidate_id = ?", (cid,)).fetchall()
        honest = [r[0] for r in rows if r[1]]
        return honest or [r[0] for r in rows]

    def event(self, kind: str, message: str) -> None:
        self.db.execute("INSERT INTO events VALUES (?, ?, ?)", (time.time(), kind, message))

    def candidate(self, cid: str) -> Candidate:
        row = self.db.execute("SELECT c.id, p.m, p.n, p.k, p.b_layout, p.dtype, p.bias, p.epilogue, p.m_lo, p.m_hi, "
                              "c.family, c.params, c.origin, c.rationale, c.template_override, c.patch FROM candidates "
                              "c JOIN problems p ON c.problem_key = p.key WHERE c.id = ?", (cid,)).fetchone()
        if row is None:
            raise StoreError(f"no candidate {cid!r} in run {self.run_id}")
        return Candidate(_problem(*row[1:10]), row[10], json.loads(row[11]), row[12], row[13], row[14],
                         Patch.from_json(row[15]) if row[15] else None)

    def candidates(self, problem: Problem | None = None) -> list[Candidate]:
        q = "SELECT id FROM candidates" + (" WHERE problem_key = ?" if problem else "") + " ORDER BY seq"
        return [self.candidate(r[0]) for r in self.db.execute(q, (problem.key,) if problem else ())]

    def build(self, cid: str) -> BuildResult | None:
        row = self.db.execute("SELECT * FROM builds WHERE candidate_id = ?", (cid,)).fetchone()
        if row is None:
            return None
        return BuildResult(row[0], bool(row[2]), row[1], row[3], row[4], row[5], *row[6:11], bool(row[11]), row[12])

    def result(self, cid: str) -> EvalResult | None:
        row = self.db.execute("SELECT record FROM results WHERE candidate_id = ?", (cid,)).fetchone()
        return EvalResult.from_json(row[0]) if row else None

    def results(self, problem: Problem) -> list[tuple[Candidate, EvalResult]]:
        return [(c, r) for c in self.candidates(problem) if (r := self.result(c.id)) is not None]

    def median_speedup(self, cid: str) -> float:
        """A candidate's median speed-up over cuBLAS across all its measurements (0 if it has none)."""
        return statistics.median(self.speedups(cid) or [0.0])

    def leaders(self, problem: Problem) -> list[tuple[Candidate, EvalResult]]:
        """The candidates that passed every check, highest median speed-up first."""
        ok = [(c, r) for c, r in self.results(problem) if r.status is Status.OK]
        return sorted(ok, key=lambda cr: -self.median_speedup(cr[0].id))

    def set_winner(self, problem: Problem, cid: str) -> None:
        """Record the re-measurement's (successive halving's) verdict for the shape."""
        self.db.execute("INSERT OR REPLACE INTO winners VALUES (?, ?)", (problem.key, cid))

    def winner(self, problem: Problem) -> Winner | None:
        """The shape's leader, defined once for the loop, the report, export and bench: the candidate the
        re-measurement picked where it ran and that candidate still stands (no later failure), else the one with the
        highest median speed-up over all its measurements (cuBLAS timed alongside)."""
        leaders = self.leaders(problem)
        row = self.db.execute("SELECT candidate_id FROM winners WHERE problem_key = ?", (problem.key,)).fetchone()
        picked = next((cr for cr in leaders if row and cr[0].id == row[0]), leaders[0] if leaders else None)
        if picked is None:
            return None
        return Winner(picked[0], picked[1], self.median_speedup(picked[0].id))

    def failure_counts(self, problem: Problem | None = None) -> dict[str, int]:
        q = ("SELECT r.status, COUNT(*) FROM results r JOIN candidates c ON c.id = r.candidate_id "
             + ("WHERE c.problem_key = ? " if problem else "") + "GROUP BY r.status")
        return dict(self.db.execute(q, (problem.key,) if problem else ()).fetchall())

    # a bucket's leaders re-timed at the bucket's probe M (agent.buckets.EndChecks)
    def add_bucket_end(self, bucket: Problem, cid: str, m: int, r: EvalResult) -> None:
        self.db.execute("INSERT INTO bucket_ends (problem_key, candidate_id, m, record) VALUES (?, ?, ?, ?)",
                        (bucket.key, cid, m, r.to_json()))

    def bucket_ends(self, bucket: Problem) -> dict[str, dict[int, EvalResult]]:
        """Candidate id -> M -> its latest result at that end of the bucket."""
        out: dict[str, dict[int, EvalResult]] = {}
        for cid, m, record in self.db.execute("SELECT candidate_id, m, record FROM bucket_ends WHERE problem_key = ? "
                                              "ORDER BY seq", (bucket.key,)):
            out.setdefault(cid, {})[m] = EvalResult.from_json(record)
        return out

    # Nsight Compute profiles
    def add_profile(self, cid: str, p: ProfileResult) -> None:
        self.db.execute("INSERT OR REPLACE INTO profiles VALUES (?, ?, ?, ?, ?)",
                        (cid, int(p.ok), json.dumps(p.metrics), p.summary, p.error))

    def profile(self, cid: str) -> ProfileResult | None:
        row = self.db.execute("SELECT ok, metrics, summary, error FROM profiles WHERE candidate_id = ?",
                              (cid,)).fetchone()
        return ProfileResult(bool(row[0]), json.loads(row[1]), row[2], row[3]) if row else None

    # the model's calls (LLM proposers), each with what became of its proposals
    def add_model_call(self, call: ModelCall) -> None:
        self.db.execute("INSERT INTO model_calls (problem_key, ts, record) VALUES (?, ?, ?)",
                        (call.problem_key, time.time(), call.to_json()))

    def model_calls(self) -> list[ModelCall]:
        rows = self.db.execute("SELECT record FROM model_calls ORDER BY seq").fetchall()
        return [ModelCall.from_json(r[0]) for r in rows]

    def events(self) -> list[tuple[float, str, str]]:
        return self.db.execute("SELECT ts, kind, message FROM events ORDER BY ts").fetchall()


def _problem(m, n, k, b_layout, dtype, bias, epilogue="none", m_lo=None, m_hi=None) -> Problem:
    return Problem(m, n, k, b_layout, dtype, bool(bias), epilogue, m_range=None if m_lo is None else (m_lo, m_hi))


def list_runs(root: Path) -> list[RunStore]:
    if not root.is_dir():
        return []
    runs = []
    for folder in sorted(root.iterdir()):
        if (folder / DB_NAME).is_file():
            try:
                runs.append(RunStore(folder))
            except StoreError:
                continue
    return runs
